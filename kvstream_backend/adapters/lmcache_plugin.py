"""``KVStreamBackend``: the LMCache 0.5.6 storage plugin (the only module that imports LMCache
besides the CLI's config check).

Selected from LMCache's YAML with ``storage_plugins: ["kvstream"]`` and
``extra_config: {storage_plugin.kvstream.module_path: kvstream_backend,
storage_plugin.kvstream.class_name: KVStreamBackend, kvstream.tiers: [...]}``.

How LMCache's calls map onto the engine:

* lookup (``batched_contains(keys, pin=True)`` / ``batched_async_contains``) counts the prefix
  hit, pins it, and registers the hits as *prefetches*: the engine reads them into MemoryObjs
  from ``local_cpu_backend`` whenever no tier has demanded work, allocating each buffer when a
  tier claims it (at most ``kvstream.prefetch_max_gb`` of prefetch buffers not yet demanded).
  A prefetch is dropped, unread if no tier had claimed it, on ``unpin``, on
  ``cancel_request`` of its lookup id, or after ``kvstream.prefetch_timeout_s``;
* ``batched_get_blocking`` / ``batched_get_non_blocking`` *demand* those prefetches (they join
  the step's pool at once, ahead of every prefetch) or add the missing chunks to the pool, and
  wait; results follow LMCache's prefix convention: everything after the first miss is
  released and returned as ``None`` (blocking) or left out (non-blocking);
* ``batched_submit_put_task`` takes a reference on each object and stages it for the deferred,
  replicated writer; it returns at once (it runs on the forward thread). The reference is
  dropped when every tier's copy is finished; ``on_complete_callback`` fires when the first copy
  is published.
"""

from __future__ import annotations

import asyncio
import collections
import itertools
import logging
import threading
import time
from collections.abc import Callable, Sequence
from concurrent.futures import Future
from typing import Any

import msgspec
import torch
from lmcache.logging import init_logger
from lmcache.utils import CacheEngineKey
from lmcache.v1.memory_management import MemoryFormat, MemoryObj
from lmcache.v1.storage_backend.abstract_backend import StoragePluginInterface

from ..config import ConfigError, parse_config
from ..engine import ChunkInfo, Engine, ReadHandle

log = init_logger("kvstream")

# Lookup hits waiting for a get (a few hundred bytes each). Registering one costs no buffer
# (it comes when a tier claims the chunk), so far more can wait than prefetch_max_gb holds.
PREFETCH_RECORDS = 1 << 16


class ChunkMeta(msgspec.Struct, array_like=True, frozen=True):
    """What LMCache needs to rebuild a MemoryObj: format, dtype(s) and shape(s)."""

    fmt: int
    dtype: str
    shape: list[int]
    dtypes: list[str] | None = None
    shapes: list[list[int]] | None = None


_ENC = msgspec.msgpack.Encoder()
_DEC = msgspec.msgpack.Decoder(ChunkMeta)


def _dtype(name: str) -> torch.dtype:
    dt = getattr(torch, name.removeprefix("torch."), None)
    if not isinstance(dt, torch.dtype):
        raise ValueError(f"unknown dtype {name!r}")
    return dt


def encode_meta(obj: MemoryObj) -> bytes:
    m = obj.metadata
    return _ENC.encode(ChunkMeta(
        m.fmt.value, str(m.dtype), list(m.shape),
        [str(d) for d in m.dtypes] if m.dtypes else None,
        [list(s) for s in m.shapes] if m.shapes else None,
    ))


class _Layout(msgspec.Struct, frozen=True):
    """A decoded, size-checked allocation request."""

    shapes: list[torch.Size] | torch.Size
    dtypes: list[torch.dtype] | torch.dtype
    fmt: MemoryFormat


def decode_meta(meta: bytes, payload_len: int) -> _Layout | None:
    """The allocation for a chunk, or None if the metadata is malformed or disagrees with
    ``payload_len`` (so a hostile header can never make us allocate more than the payload)."""
    try:
        cm = _DEC.decode(meta)
        fmt = MemoryFormat(cm.fmt)
        if cm.shapes and cm.dtypes:
            shapes = [torch.Size(s) for s in cm.shapes]
            dtypes = [_dtype(d) for d in cm.dtypes]
            size = sum(s.numel() * d.itemsize for s, d in zip(shapes, dtypes, strict=True))
            layout = _Layout(shapes, dtypes, fmt)
        else:
            shape, dtype = torch.Size(cm.shape), _dtype(cm.dtype)
            size = shape.numel() * dtype.itemsize
            layout = _Layout(shape, dtype, fmt)
    except (msgspec.DecodeError, ValueError, TypeError):
        return None
    return layout if size == payload_len else None


def _resolver(
    loop: asyncio.AbstractEventLoop, fut: asyncio.Future[None]
) -> Callable[[ReadHandle], None]:
    """A handle callback (completion-loop thread) that resolves ``fut`` on its event loop."""

    def settle() -> None:
        if not fut.done():
            fut.set_result(None)

    def on_done(_h: ReadHandle) -> None:
        loop.call_soon_threadsafe(settle)

    return on_done


class _ObjBuffer:
    """An engine :class:`~kvstream_backend.engine.Buffer` over a MemoryObj (no copy)."""

    __slots__ = ("obj", "addr", "capacity")

    def __init__(self, obj: MemoryObj) -> None:
        self.obj = obj
        self.addr = obj.data_ptr
        self.capacity = obj.get_physical_size()

    def release(self) -> None:
        self.obj.ref_count_down()


def _close_first(local_cpu_backend: Any, close: Callable[[], None]) -> None:
    """Run ``close`` before ``local_cpu_backend`` frees its memory.

    LMCache 0.5.6's ``StorageManager.close()`` closes backends in creation order, so
    ``LocalCPUBackend.close()`` -> ``memory_allocator.close()`` frees every MemoryObj buffer
    (reference counts notwithstanding) before a plugin's ``close()`` runs. kvstream's staged
    writes and reads in flight point into those buffers: writing them afterwards sent O_DIRECT
    writes from freed memory (EFAULT, SIGSEGV, or a reused mapping's bytes under a valid
    checksum). So kvstream drains and stops first; its own ``close()`` is idempotent.
    """
    free = local_cpu_backend.close

    def close_kvstream_then_free() -> None:
        try:
            close()
        finally:
            free()

    local_cpu_backend.close = close_kvstream_then_free


class KVStreamBackend(StoragePluginInterface):
    def __init__(
        self,
        dst_device: str = "cpu",
        config: Any = None,
        metadata: Any = None,
        local_cpu_backend: Any = None,
        loop: asyncio.AbstractEventLoop | None = None,
    ) -> None:
        super().__init__(dst_device, config, metadata, local_cpu_backend, loop)
        try:
            # never create tier roots: a missing one is a tier down (an unmounted PFS)
            self.cfg = parse_config(getattr(config, "extra_config", None), check_paths=False)
        except ConfigError as e:
            log.error("KVSTREAM PLUGIN DISABLED: invalid configuration: %s", e)
            raise
        if local_cpu_backend is None:
            log.warning("kvstream: no local_cpu_backend (scheduler role?): lookups only; "
                        "gets and puts are refused")
        self.engine = Engine(self.cfg)
        if local_cpu_backend is not None:
            _close_first(local_cpu_backend, self.close)
        self._lock = threading.Lock()
        self._prefetch: dict[CacheEngineKey, ReadHandle] = {}
        # Async loading: the keys each lookup id pinned, with the time their pins expire.
        # LMCache 0.5.6 never unpins plugins in that mode (``lookup_unpin`` only calls
        # ``cleanup_memory_objs``, cache_engine.py ~1573), so kvstream releases a lookup's pins
        # itself: when its get arrives, on ``cancel_request``, or after prefetch_timeout_s.
        self._by_lookup: collections.OrderedDict[str, tuple[float, list[CacheEngineKey]]] = (
            collections.OrderedDict())
        if self.cfg.metrics_port:
            from ..metrics import serve

            serve(self.engine, self.cfg.metrics_port)

    def __str__(self) -> str:
        return "KVStreamBackend"

    # ---- lookup ---------------------------------------------------------------------------
    def _info(self, key: CacheEngineKey) -> ChunkInfo | None:
        return self.engine.lookup(key.to_string())

    def contains(self, key: CacheEngineKey, pin: bool = False) -> bool:
        info = self._info(key)
        if info is None:
            return False
        if pin:
            self.engine.pin(key.to_string())
        return True

    def batched_contains(self, keys: list[CacheEngineKey], pin: bool = False) -> int:
        hits: list[tuple[CacheEngineKey, ChunkInfo]] = []
        for key in keys:
            info = self._info(key)
            if info is None:
                break
            hits.append((key, info))
        if pin and hits:
            for key, _ in hits:
                self.engine.pin(key.to_string())
            self._start_prefetch(hits)
        return len(hits)

    async def batched_async_contains(
        self, lookup_id: str, keys: list[CacheEngineKey], pin: bool = False
    ) -> int:
        # Header reads of chunks published by other processes are file I/O: keep them off the
        # StorageManager's event loop.
        n = await asyncio.get_running_loop().run_in_executor(
            None, self.batched_contains, keys, pin
        )
        if pin and n:
            deadline = time.monotonic() + self.cfg.prefetch_timeout_s
            with self._lock:
                old = self._by_lookup.pop(lookup_id, None)
                self._by_lookup[lookup_id] = (deadline, keys[:n])
            if old is not None:  # the same id looked up again: its earlier pins go
                self._unpin_keys(old[1])
        return n

    def _release_lookup(self, lookup_id: str) -> list[CacheEngineKey]:
        """Unpin what an async lookup pinned; return its keys (empty if none are held)."""
        with self._lock:
            entry = self._by_lookup.pop(lookup_id, None)
        keys = entry[1] if entry is not None else []
        self._unpin_keys(keys)
        return keys

    def _unpin_keys(self, keys: list[CacheEngineKey]) -> None:
        for k in keys:
            self.engine.unpin(k.to_string())

    def _expire_lookups(self) -> None:
        now = time.monotonic()
        with self._lock:  # entries are in deadline order: only the stale front is looked at
            stale = list(itertools.takewhile(lambda i: self._by_lookup[i][0] < now,
                                             self._by_lookup))
        for i in stale:
            for k in self._release_lookup(i):
                self._drop_prefetch(k)

    def exists_in_put_tasks(self, key: CacheEngineKey) -> bool:
        return self.engine.writing(key.to_string())

    # ---- pins -----------------------------------------------------------------------------
    def pin(self, key: CacheEngineKey) -> bool:
        if self._info(key) is None:
            return False
        self.engine.pin(key.to_string())
        return True

    def unpin(self, key: CacheEngineKey) -> bool:
        self._drop_prefetch(key)
        return self.engine.unpin(key.to_string())

    def remove(self, key: CacheEngineKey, force: bool = True) -> bool:
        self._drop_prefetch(key)
        return self.engine.remove(key.to_string())

    def cancel_request(self, req_id: str) -> None:
        """Drop the prefetches of an aborted request's lookup (async loading registers them
        under its lookup id; in sync mode LMCache unpins, which drops them too)."""
        for k in self._release_lookup(req_id):
            self._drop_prefetch(k)

    def touch_cache(self) -> None:
        """Recency is updated by the reads themselves."""

    # ---- reads ----------------------------------------------------------------------------
    def _allocator(self, info: ChunkInfo) -> Callable[[int], _ObjBuffer | None] | None:
        """A function allocating one MemoryObj for ``info`` (None if it cannot be rebuilt)."""
        lcb = self.local_cpu_backend
        layout = decode_meta(info.meta, info.payload_len)
        if lcb is None or layout is None:
            return None

        def alloc(_n: int) -> _ObjBuffer | None:
            obj = lcb.allocate(layout.shapes, layout.dtypes, layout.fmt, busy_loop=False)
            return _ObjBuffer(obj) if obj is not None else None

        return alloc

    def _start_prefetch(self, hits: list[tuple[CacheEngineKey, ChunkInfo]]) -> None:
        """Register lookup hits as prefetches (no memory is allocated here)."""
        if self.local_cpu_backend is None:
            return
        self._forget_stale()
        reqs: list[tuple[str, ChunkInfo, None, Callable[[int], _ObjBuffer | None]]] = []
        keys: list[CacheEngineKey] = []
        with self._lock:
            for key, info in hits:
                if key in self._prefetch:
                    continue
                alloc = self._allocator(info)
                if alloc is None or len(self._prefetch) + len(reqs) >= PREFETCH_RECORDS:
                    break
                reqs.append((key.to_string(), info, None, alloc))
                keys.append(key)
            for key, h in zip(keys, self.engine.read(reqs, prefetch=True), strict=True):
                self._prefetch[key] = h

    def _take_prefetch(self, key: CacheEngineKey) -> ReadHandle | None:
        with self._lock:
            return self._prefetch.pop(key, None)

    def _drop_prefetch(self, key: CacheEngineKey) -> None:
        h = self._take_prefetch(key)
        if h is not None:
            h.discard()

    def _forget_stale(self) -> None:
        """Forget prefetches the engine dropped (expired) so their keys can register again,
        and release async lookups that no get or cancel followed."""
        self._expire_lookups()
        now = time.monotonic()
        # Registered in deadline order (all under the lock, one timeout), and a prefetch is
        # abandoned only once popped from here or past its deadline: the stale ones are a
        # prefix, so a lookup never scans the whole table.
        with self._lock:
            stale = list(itertools.takewhile(lambda k: self._prefetch[k].deadline < now,
                                             self._prefetch))
        for k in stale:
            self._drop_prefetch(k)

    def _handles_for(self, keys: Sequence[CacheEngineKey]) -> list[ReadHandle | None]:
        """A demanded handle per key: a prefetch promoted, or a new read added to the pool."""
        handles: list[ReadHandle | None] = [self._take_prefetch(k) for k in keys]
        self.engine.demand([h for h in handles if h is not None])
        missing = []
        for i, (k, h) in enumerate(zip(keys, handles, strict=True)):
            if h is None or h.abandoned:
                handles[i] = None
                info = self._info(k)
                if info is None:
                    break
                missing.append((i, k, info))
        reqs = []
        for _, k, info in missing:
            alloc = self._allocator(info)
            buf = alloc(info.payload_len) if alloc is not None else None
            if buf is None:
                break
            reqs.append((k.to_string(), info, buf, alloc))
        for (i, _, _), h in zip(missing, self.engine.read(reqs), strict=False):
            handles[i] = h
        return handles

    @staticmethod
    def _prefix(handles: list[ReadHandle | None]) -> list[MemoryObj | None]:
        """Results in LMCache's prefix convention: after the first miss, release and None."""
        out: list[MemoryObj | None] = []
        missed = False
        for h in handles:
            buf = None if missed or h is None else h.result
            if buf is None:
                missed = True
                if h is not None:
                    h.discard()
                out.append(None)
            else:
                out.append(buf.obj)  # type: ignore[attr-defined]
        return out

    def batched_get_blocking(self, keys: list[CacheEngineKey]) -> list[MemoryObj | None]:
        if self.local_cpu_backend is None:
            log.error("kvstream: get refused: no local_cpu_backend to allocate into")
            return [None] * len(keys)
        handles = self._handles_for(keys)
        deadline = time.monotonic() + self.cfg.get_timeout_s
        for h in handles:
            if h is None:
                break
            if h.wait(max(0.0, deadline - time.monotonic())) is None:
                break
        return self._prefix(handles)

    def get_blocking(self, key: CacheEngineKey) -> MemoryObj | None:
        return self.batched_get_blocking([key])[0]

    async def batched_get_non_blocking(
        self, lookup_id: str, keys: list[CacheEngineKey], transfer_spec: Any = None
    ) -> list[MemoryObj]:
        if self.local_cpu_backend is None:
            log.error("kvstream: get refused: no local_cpu_backend to allocate into")
            return []
        loop = asyncio.get_running_loop()
        handles = await loop.run_in_executor(None, self._handles_for, keys)
        # The get holds the chunks now (they are not evictable while read): the lookup's
        # pins have done their job.
        self._release_lookup(lookup_id)
        waits = []
        for h in handles:
            if h is None:
                break
            fut: asyncio.Future[None] = loop.create_future()
            h.add_done_callback(_resolver(loop, fut))
            waits.append(fut)
        try:
            await asyncio.wait_for(asyncio.gather(*waits), self.cfg.get_timeout_s)
        except asyncio.TimeoutError:
            log.warning("kvstream: async get of %d chunks timed out", len(waits))
        return [o for o in self._prefix(handles) if o is not None]

    # ---- writes ---------------------------------------------------------------------------
    def batched_submit_put_task(
        self,
        keys: Sequence[CacheEngineKey],
        objs: list[MemoryObj],
        transfer_spec: Any = None,
        on_complete_callback: Callable[[CacheEngineKey], None] | None = None,
    ) -> list[Future] | None:
        if self.local_cpu_backend is None:
            return None
        for key, obj in zip(keys, objs, strict=True):
            skey = key.to_string()
            if self.engine.stored_everywhere(skey):
                continue  # on every healthy tier already (index only: no forward-thread I/O)
            obj.ref_count_up()
            published = None
            if on_complete_callback is not None:
                published = lambda _s, k=key, cb=on_complete_callback: cb(k)  # noqa: E731
            if not self.engine.write(skey, _ObjBuffer(obj), obj.get_size(), encode_meta(obj),
                                     on_published=published, on_done=obj.ref_count_down):
                obj.ref_count_down()
        return None

    # ---- lifecycle ------------------------------------------------------------------------
    def get_allocator_backend(self):  # type: ignore[override]
        return self.local_cpu_backend

    def close(self) -> None:
        with self._lock:
            keys = list(self._prefetch)
        for k in keys:
            self._drop_prefetch(k)
        self.engine.close()  # logs the staged chunks it had to drop, if any
        logging.getLogger("kvstream").info("kvstream: closed")
