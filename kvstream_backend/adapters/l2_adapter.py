"""``KVStreamL2Adapter``: kvstream as one L2 adapter of LMCache's multi-process server.

``lmcache server --l2-adapter '{"type": "plugin", "module_path": "kvstream_backend",
"class_name": "KVStreamL2Adapter", "adapter_params": {"tiers": [...], ...}}'``. This is how
SGLang (0.5.23) and vLLM's ``LMCacheMPConnector`` reach LMCache. ``adapter_params`` takes the
``kvstream.*`` options without the prefix (:func:`~kvstream_backend.config.parse_params`).

Why one adapter for all tiers: LMCache's default policies replicate a store to every adapter but
load each chunk from the lowest-index adapter holding it, so tiers registered as separate adapters
never read at the same time. Here every tier belongs to one engine, and every load task
outstanding at once, from every request and every engine attached to the server, joins one pool
that the tiers claim from opposite ends as their reads complete.

How the storage controllers' calls map onto the engine (call protocol of
``lmcache/v1/distributed/l2_adapters/base.py``; every ``submit_*`` returns at once):

* ``submit_lookup_and_lock_task``: on a helper thread (a lookup may read headers of chunks that
  another process published), the engine pins each key, then looks it up, as it does for the
  LMCache plugin; a miss is unpinned. The bitmap reports exactly the keys left pinned, so an
  eviction cannot remove a chunk between lookup and load. ``submit_unlock`` drops one pin per
  key (memory only: it cannot fail).
* ``submit_load_task``: the caller's L1 buffers are read into directly (no copy, no kvstream
  memory), as demanded reads of the shared pool. A key is settled when its chunk is delivered,
  or, on a miss, once the engine has handed the buffer back (no read still writes into it); the
  task completes when every key is settled. A chunk whose stored size differs from the buffer's
  is a miss, never a partial fill. No reads start at lookup time here: the buffers are the
  caller's and only arrive with the load, and the controller submits the load as soon as the
  lookup returns. Reads into caller buffers are not hedged (a hedge would need kvstream memory
  and a copy); claims of ``claim_batch`` chunks keep the tiers' finishing times close anyway.
* ``submit_store_task``: each chunk is staged for the deferred, replicated writer (every
  healthy tier that lacks it; deferred while loads are outstanding; bounded by
  ``staging_budget_mb``). The L1 buffer must stay valid until every copy is finished, so the task
  completes then (LMCache holds its read lock until the task completes). A chunk that another
  store is already writing, or that every healthy tier holds, counts as stored: first writer
  wins. The task fails if any of its chunks ended up on no tier.
* Capacity: kvstream evicts on each tier itself (LRU, never a pinned chunk), so the adapter
  declares no capacity to LMCache (``max_capacity_bytes=0``: LMCache's global L2 eviction stays
  off) and ``get_usage`` reports the bytes on the fullest tier.
"""

from __future__ import annotations

import functools
import itertools
import threading
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from types import MappingProxyType
from typing import Any

import msgspec
from lmcache.lmcache_native import Bitmap
from lmcache.logging import init_logger
from lmcache.v1.distributed.api import MemoryLayoutDesc, ObjectKey
from lmcache.v1.distributed.internal_api import L2StoreResult
from lmcache.v1.distributed.l2_adapters.base import AdapterUsage, L2AdapterInterface, L2TaskId
from lmcache.v1.distributed.l2_adapters.config import L2AdapterConfigBase
from lmcache.v1.memory_management import MemoryObj
from lmcache.v1.platform import create_event_notifier

from ..config import ConfigError, KVStreamConfig, parse_params
from ..engine import Engine, ReadRequest
from .settle import Settlement

log = init_logger("kvstream")  # the engine logs to "kvstream" too: through LMCache's handler

LOOKUP_THREADS = 2  # header reads of chunks other processes published; never the I/O path
LOCKS = "l2"  # the engine owner of the storage controller's locks


def key_string(key: ObjectKey) -> str:
    """The engine's key for an :class:`ObjectKey` (all five fields; ``@`` cannot occur in the
    model name or the salt, so the string is unambiguous)."""
    s = f"l2@{key.model_name}@{key.kv_rank:#010x}@{key.object_group_id:x}@{key.chunk_hash.hex()}"
    return f"{s}@{key.cache_salt}" if key.cache_salt else s


class StoredKey(msgspec.Struct, array_like=True, frozen=True):
    """The header metadata of a chunk stored through the adapter: its full ObjectKey."""

    model_name: str
    kv_rank: int
    object_group_id: int
    chunk_hash: bytes
    cache_salt: str = ""


_META = msgspec.msgpack.Encoder()


def encode_key(key: ObjectKey) -> bytes:
    return _META.encode(StoredKey(key.model_name, key.kv_rank, key.object_group_id,
                                  key.chunk_hash, key.cache_salt))


class KVStreamL2AdapterConfig(L2AdapterConfigBase):
    """``adapter_params``: the ``kvstream.*`` options without the prefix (``tiers`` required).

    Errors are raised at server start and name the key (``adapter_params.tiers[0].path``).
    """

    def __init__(self, kvstream: KVStreamConfig) -> None:
        self.kvstream = kvstream

    @classmethod
    def from_dict(cls, d: dict) -> KVStreamL2AdapterConfig:
        try:
            return cls(parse_params(d))
        except ConfigError as e:
            raise ValueError(f"kvstream L2 adapter: {e}") from None

    @classmethod
    def help(cls) -> str:
        return ("kvstream L2 adapter: adapter_params takes the kvstream.* options without the "
                'prefix, e.g. {"tiers": [{"name": "nvme", "path": "/mnt/nvme/kv", '
                '"max_size_gb": 500}, {"name": "pfs", "path": "/mnt/pfs/kv", '
                '"max_size_gb": 2000}]}')


class _L1Buffer:
    """An engine buffer over a caller's MemoryObj (no copy). ``release`` means "the engine no
    longer touches this memory"; the memory itself stays the caller's."""

    __slots__ = ("addr", "capacity", "_on_release")

    def __init__(self, obj: MemoryObj, on_release: Callable[[], None] | None = None) -> None:
        self.addr = obj.data_ptr
        self.capacity = obj.get_physical_size()
        self._on_release = on_release

    def release(self) -> None:
        if self._on_release is not None:
            self._on_release()


class _StoreTask:
    """Counts a store task's chunks until every copy of each is finished."""

    def __init__(self, keys: list[ObjectKey], done: Callable[[_StoreTask], None]) -> None:
        self._lock = threading.Lock()
        self._keys = keys
        self._left = len(keys)
        self.failed = 0
        self.bytes = 0
        self.stored: dict[int, int] = {}  # index -> size, published by this task
        self._done = done

    def published(self, i: int, size: int, _skey: str) -> None:
        with self._lock:
            self.stored[i] = size
            self.bytes += size

    def chunk_done(self, i: int, ok: bool | None = None) -> None:
        """Chunk ``i`` is finished; ``ok`` None: judged by whether a copy was published."""
        with self._lock:
            self.failed += not (i in self.stored if ok is None else ok)
            self._left -= 1
            finished = self._left == 0
        if finished:
            self._done(self)

    def stored_keys(self) -> tuple[list[ObjectKey], list[int]]:
        return [self._keys[i] for i in self.stored], list(self.stored.values())


class KVStreamL2Adapter(L2AdapterInterface):
    """All of kvstream's tiers as one L2 adapter; thread-safe (two controller threads call it)."""

    def __init__(self, config: KVStreamL2AdapterConfig | dict[str, Any], *,
                 l1_memory_desc: Any = None) -> None:
        super().__init__(max_capacity_bytes=0)
        if not isinstance(config, KVStreamL2AdapterConfig):
            config = KVStreamL2AdapterConfig.from_dict(config)
        self.cfg = config.kvstream
        self.engine = Engine(self.cfg)
        self._lookups_pool = ThreadPoolExecutor(LOOKUP_THREADS, "kvstream-l2-lookup")
        self._store_efd = create_event_notifier()
        self._lookup_efd = create_event_notifier()
        self._load_efd = create_event_notifier()
        self._lock = threading.Lock()
        self._ids = itertools.count()
        self._stores: dict[L2TaskId, _StoreTask] = {}
        self._lookups: dict[L2TaskId, Bitmap] = {}
        self._loads: dict[L2TaskId, tuple[list[ObjectKey], Bitmap]] = {}
        self._closed = False
        log.info("kvstream L2 adapter: %d tiers (%s)", len(self.cfg.tiers),
                 ", ".join(f"{t.name}={t.path}" for t in self.cfg.tiers))

    # ---- event fds ------------------------------------------------------------------------
    def get_store_event_fd(self) -> int:
        return self._store_efd.fileno()

    def get_lookup_and_lock_event_fd(self) -> int:
        return self._lookup_efd.fileno()

    def get_load_event_fd(self) -> int:
        return self._load_efd.fileno()

    def _task_id(self) -> L2TaskId:
        with self._lock:
            return next(self._ids)

    # ---- store ----------------------------------------------------------------------------
    def submit_store_task(self, keys: list[ObjectKey], objects: list[MemoryObj]) -> L2TaskId:
        tid = self._task_id()
        task = _StoreTask(keys, functools.partial(self._stored, tid))
        if not keys:
            self._stored(tid, task)
        for i, (key, obj) in enumerate(zip(keys, objects, strict=True)):
            skey = key_string(key)
            if self.engine.stored_everywhere(skey):
                task.chunk_done(i, ok=True)
                continue
            size = obj.get_size()
            staged = self.engine.write(
                skey, _L1Buffer(obj), size, encode_key(key),
                on_published=functools.partial(task.published, i, size),
                on_done=functools.partial(task.chunk_done, i),
            )
            if not staged:  # first writer wins; while closing nothing is staged
                task.chunk_done(i, ok=self.engine.writing(skey))
        return tid

    def _stored(self, tid: L2TaskId, task: _StoreTask) -> None:
        with self._lock:
            self._stores[tid] = task
        self._store_efd.notify()

    def pop_completed_store_tasks(self) -> dict[L2TaskId, L2StoreResult]:
        with self._lock:
            done, self._stores = self._stores, {}
        for t in done.values():
            keys, sizes = t.stored_keys()
            if keys:
                self._notify_keys_stored(keys, sizes)
        return {tid: L2StoreResult(t.failed == 0, t.bytes) for tid, t in done.items()}

    # ---- lookup and lock ------------------------------------------------------------------
    def submit_lookup_and_lock_task(
        self, keys: list[ObjectKey], group_layout_descs: dict[int, MemoryLayoutDesc]
    ) -> L2TaskId:
        tid = self._task_id()
        self._lookups_pool.submit(self._lookup_and_lock, tid, keys)
        return tid

    def _lookup_and_lock(self, tid: L2TaskId, keys: list[ObjectKey]) -> None:
        bitmap = Bitmap(len(keys))
        try:  # locked until submit_unlock: the controller always unlocks what it locked
            infos = self.engine.lookup_and_pin(LOCKS, [key_string(k) for k in keys],
                                               prefix=False, expires=False)
            for i, info in enumerate(infos):
                if info is not None:
                    bitmap.set(i)
        except Exception:  # noqa: BLE001 - the controller waits for this task's result
            log.exception("kvstream L2: lookup task %d failed; reporting what was found", tid)
        with self._lock:
            self._lookups[tid] = bitmap
        self._lookup_efd.notify()

    def query_lookup_and_lock_result(self, task_id: L2TaskId) -> Bitmap | None:
        with self._lock:
            return self._lookups.pop(task_id, None)

    def submit_unlock(self, keys: list[ObjectKey]) -> None:
        self.engine.release(LOCKS, [key_string(k) for k in keys])

    # ---- load -----------------------------------------------------------------------------
    def submit_load_task(self, keys: list[ObjectKey], objects: list[MemoryObj]) -> L2TaskId:
        tid = self._task_id()
        task = Settlement(len(keys), functools.partial(self._loaded, tid, keys))
        if keys:
            self._lookups_pool.submit(self._admit_load, task, keys, objects)
        return tid

    def _admit_load(self, task: Settlement, keys: list[ObjectKey],
                    objects: list[MemoryObj]) -> None:
        reqs, idx = [], []
        for i, (key, obj) in enumerate(zip(keys, objects, strict=True)):
            skey = key_string(key)
            info = self.engine.lookup(skey)
            if info is None or info.payload_len != obj.get_size():
                task.miss(i)
                continue
            buf = _L1Buffer(obj, functools.partial(task.released, i))
            reqs.append(ReadRequest(info, buf, None))
            idx.append(i)
        for i, h in zip(idx, self.engine.read(reqs), strict=True):
            h.add_done_callback(functools.partial(task.delivered, i))

    def _loaded(self, tid: L2TaskId, keys: list[ObjectKey], hits: list[bool]) -> None:
        bitmap = Bitmap(len(keys))
        for i, ok in enumerate(hits):
            if ok:
                bitmap.set(i)
        with self._lock:
            self._loads[tid] = (keys, bitmap)
        self._load_efd.notify()

    def query_load_result(self, task_id: L2TaskId) -> Bitmap | None:
        with self._lock:
            entry = self._loads.pop(task_id, None)
        if entry is None:
            return None
        keys, bitmap = entry
        hits = [keys[i] for i in bitmap.get_indices_list()]
        if hits:
            self._notify_keys_accessed(hits)
        return bitmap

    # ---- management -----------------------------------------------------------------------
    def delete(self, keys: list[ObjectKey]) -> None:
        gone, sizes = [], []
        for key in keys:
            skey = key_string(key)
            info = self.engine.lookup(skey)
            if self.engine.remove(skey):
                gone.append(key)
                sizes.append(info.payload_len if info is not None else 0)
        if gone:
            self._notify_keys_deleted(gone, sizes)

    def get_usage(self) -> AdapterUsage:
        return AdapterUsage(total_bytes_used=self.engine.usage(), total_capacity_bytes=0,
                            bytes_by_cache_salt=MappingProxyType({}))

    def report_status(self) -> dict:
        st = self.engine.stats()
        return {
            "is_healthy": not self._closed and any(t.up for t in st.tiers),
            "type": "KVStreamL2Adapter",
            "tiers": [{"name": t.name, "path": t.path, "up": t.up, "down_reason": t.down_reason,
                       "chunks": t.chunks, "used_bytes": t.used_bytes,
                       "capacity_bytes": t.capacity_bytes, "io": t.io, "direct": t.direct}
                      for t in st.tiers],
            "chunks_read": st.chunks_read,
            "misses": st.misses,
            "writes_published": st.writes_published,
            "writes_failed": st.writes_failed,
            "writes_dropped": st.writes_dropped,
            "pinned": self.engine.pinned(),
        }

    def close(self) -> None:
        """Drain staged stores (bounded by ``close_timeout_s``), finish reads in flight, stop.
        Tasks still pending complete first, so the controller's buffers are released."""
        if self._closed:
            return
        self._closed = True
        self._lookups_pool.shutdown(wait=True)
        self.engine.close()
        for efd in (self._store_efd, self._lookup_efd, self._load_efd):
            efd.close()
        log.info("kvstream L2 adapter: closed")
