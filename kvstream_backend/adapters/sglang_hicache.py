"""``KVStreamHiCacheStorage``: kvstream as the storage (L3) backend of SGLang's HiCache.

``python -m sglang.launch_server ... --enable-hierarchical-cache --hicache-storage-backend
dynamic --hicache-storage-backend-extra-config @kvstream-hicache.json`` with::

    {"backend_name": "kvstream", "module_path": "kvstream_backend",
     "class_name": "KVStreamHiCacheStorage", "interface_v1": 1,
     "tiers": [{"name": "nvme", "path": "/mnt/nvme/kv", "max_size_gb": 500},
               {"name": "pfs", "path": "/mnt/pfs/kv", "max_size_gb": 2000}]}

The other keys of that dict are the ``kvstream.*`` options without the prefix; errors name the
key (``extra_config.tiers[1].path``). Tier directories are created if missing, as SGLang's file
backend does (the L2 adapter, a shared server, never creates them). SGLang's own keys
(``prefetch_threshold``, ...) are popped by SGLang before the backend sees the dict; the four
loader keys are ignored here.

Call protocol (SGLang 0.5.23, ``HiCacheStorage`` with ``interface_v1``; one prefetch thread
reads, one backup thread writes, each call blocks its thread, never SGLang's scheduler):

* ``register_mem_pool_host(host)`` fixes the key namespace: model, TP rank (not for MLA, whose
  pages every rank shares), PP rank, layout, dtype, page size and page bytes. Keys from two
  layouts, dtypes or models never meet. Pools other than KV (hybrid models) are refused.
* ``batch_exists(keys)``: the leading run of pages found on any healthy tier; each is pinned
  (no eviction) until the ``batch_get_v1`` that reads it, or ``prefetch_timeout_s``.
* ``batch_get_v1(keys, host_indices)``: every page of the call is one read of the shared pool,
  straight into the host pool's regions (one scattered read per page: O_DIRECT where each region
  is page-aligned, through an aligned bounce buffer where one is not). A copy that fails its
  checksum or its read is read from the next tier holding the page; only then is the page
  False. Never raises (SGLang counts an exception as a whole batch of misses), and returns only
  once the engine is done with every region, so a False page's memory is SGLang's again.
* ``batch_set_v1(keys, host_indices)``: each page is copied once into kvstream's staging memory
  (at most ``staging_budget_mb`` at once; the call waits for room), because SGLang reuses the
  host page as soon as the call returns while the deferred writer is still replicating it to
  every tier. A page is True once its first copy is published, or if it is already stored or
  being stored by another writer (first writer wins).

The legacy tensor path (``get``/``set`` and their batches, used without ``interface_v1``) reads
and writes contiguous page tensors under a namespace of its own; the zero-copy path is the one
to use.
"""

from __future__ import annotations

import ctypes
import functools
import logging
import threading
import time
from collections.abc import Sequence
from typing import Any

import torch
from sglang.srt.mem_cache.hicache_storage import (
    HiCacheStorage,
    HiCacheStorageConfig,
    HiCacheStorageExtraInfo,
)

from ..config import ConfigError, KVStreamConfig, parse_params
from ..engine import Engine, ReadRequest
from ..handles import Regions, Segment
from ..io.memory import AlignedBuffer
from .settle import Settlement

log = logging.getLogger("kvstream")

LOADER_KEYS = ("backend_name", "module_path", "class_name", "interface_v1")
IGNORED_KEYS = (*LOADER_KEYS, "file_storage_path")  # set by SGLang for its file backend
PINS = "hicache"  # the engine owner of batch_exists' pins


def parse_extra_config(extra: dict[str, Any] | None, *,
                       check_paths: bool = True) -> KVStreamConfig:
    """The kvstream options of SGLang's ``extra_config``; errors name ``extra_config.<key>``.
    ``check_paths``: create missing tier directories and check them (at start)."""
    if not extra or "tiers" not in extra:
        raise ConfigError('extra_config.tiers is required: a list of {name, path, max_size_gb} '
                          '(--hicache-storage-backend-extra-config)')
    if not extra.get("interface_v1"):
        raise ConfigError('extra_config.interface_v1: set it to 1 (kvstream serves HiCache '
                          "through the zero-copy v1 interface)")
    return parse_params({k: v for k, v in extra.items() if k not in IGNORED_KEYS},
                        label="extra_config", check_paths=check_paths)


class _Staging:
    """Page-aligned copies of pages being written, at most ``budget`` bytes at once; freed
    copies are kept for reuse up to the same bound. Thread-safe."""

    def __init__(self, budget: int) -> None:
        self._budget = budget
        self._cond = threading.Condition()
        self._held = 0
        self._free: dict[int, list[AlignedBuffer]] = {}
        self._free_bytes = 0

    def get(self, size: int, deadline: float) -> AlignedBuffer | None:
        """A buffer of ``size`` bytes; waits for room (None if ``deadline`` passes first). One
        buffer larger than the budget is granted when nothing else is held."""
        with self._cond:
            while self._held and self._held + size > self._budget:
                left = deadline - time.monotonic()
                if left <= 0 or not self._cond.wait(left):
                    return None
            self._held += size
            free = self._free.get(size)
            if free:
                self._free_bytes -= size
                return free.pop()
        return AlignedBuffer(size)

    def put(self, buf: AlignedBuffer) -> None:
        with self._cond:
            self._held -= buf.size
            if self._free_bytes + buf.size <= self._budget:
                self._free.setdefault(buf.size, []).append(buf)
                self._free_bytes += buf.size
                buf = None  # type: ignore[assignment]
            self._cond.notify_all()
        if buf is not None:
            buf.release()

    def close(self) -> None:
        with self._cond:
            bufs = [b for free in self._free.values() for b in free]
            self._free.clear()
            self._free_bytes = 0
        for b in bufs:
            b.release()


class _PageWrite:
    """One page's write: True once its first copy is published; ``finished`` once the call
    may stop waiting for it (published, or every copy ended)."""

    __slots__ = ("ok", "finished")

    def __init__(self) -> None:
        self.ok = False
        self.finished = threading.Event()

    def published(self, _key: str) -> None:
        self.ok = True
        self.finished.set()


class KVStreamHiCacheStorage(HiCacheStorage):
    """All of kvstream's tiers as one HiCache storage backend, over one engine."""

    def __init__(self, storage_config: HiCacheStorageConfig,
                 kwargs: dict[str, Any] | None = None) -> None:
        self.cfg = parse_extra_config(storage_config.extra_config)
        self.storage_config = storage_config
        self.engine = Engine(self.cfg)
        self._staging = _Staging(self.cfg.staging_budget_bytes)
        self._ns = ""  # key namespace; set by register_mem_pool_host
        self._page_bytes = 0
        self._closed = False
        self.pages_read = self.pages_missed = self.pages_written = self.pages_failed = 0
        log.info("kvstream HiCache storage: %d tiers (%s)", len(self.cfg.tiers),
                 ", ".join(f"{t.name}={t.path}" for t in self.cfg.tiers))

    # ---- host pool and keys ---------------------------------------------------------------
    def register_mem_pool_host(self, mem_pool_host: Any) -> None:
        super().register_mem_pool_host(mem_pool_host)
        if not hasattr(mem_pool_host, "get_page_buffer_meta"):
            raise TypeError(f"kvstream HiCache storage: host pool {type(mem_pool_host).__name__}"
                            " has no get_page_buffer_meta (zero-copy pages)")
        sc = self.storage_config
        page = mem_pool_host.page_size
        _, sizes = mem_pool_host.get_page_buffer_meta(torch.arange(page, dtype=torch.int64))
        self._page_bytes = sum(sizes)
        model = (sc.model_name or "").replace("/", "-")
        rank = "mla" if sc.is_mla_model else f"tp{sc.tp_rank}of{sc.tp_size}"
        if sc.pp_size > 1:
            rank += f"-pp{sc.pp_rank}of{sc.pp_size}"
        if sc.attn_cp_size > 1:
            rank += f"-cp{sc.attn_cp_rank}of{sc.attn_cp_size}"
        if sc.dcp_size > 1:
            rank += f"-dcp{sc.dcp_rank}of{sc.dcp_size}"
        dtype = str(mem_pool_host.dtype).removeprefix("torch.")
        self._ns = (f"hicache@{model}@{rank}@{mem_pool_host.layout}@{dtype}@p{page}"
                    f"@{self._page_bytes}@")
        log.info("kvstream HiCache storage: namespace %s (%s, %d regions per page)", self._ns,
                 type(mem_pool_host).__name__, len(sizes))

    def register_mem_host_pool_v2(self, host_pool: Any, host_pool_name: Any) -> None:
        if str(host_pool_name) != "kv":
            raise ValueError(f"kvstream HiCache storage: pool {host_pool_name!r} is not "
                             "supported (hybrid models: SWA, Mamba, DSA sidecars); use it "
                             "with a model whose only pool is KV")
        super().register_mem_host_pool_v2(host_pool, host_pool_name)

    def _key(self, key: str) -> str:
        if not self._ns:
            raise RuntimeError("kvstream HiCache storage: no host pool registered")
        return self._ns + key

    def _pages(self, keys: Sequence[str], host_indices: torch.Tensor) -> list[list[Segment]]:
        """Each page's regions in the host pool, in payload order."""
        ptrs, sizes = self.mem_pool_host.get_page_buffer_meta(host_indices)
        per, rest = divmod(len(ptrs), len(keys)) if keys else (0, 0)
        if rest or (keys and sum(sizes[:per]) != self._page_bytes):
            raise ValueError(f"host pool gave {len(ptrs)} regions for {len(keys)} pages")
        return [list(zip(ptrs[i * per:(i + 1) * per], sizes[i * per:(i + 1) * per],
                         strict=True)) for i in range(len(keys))]

    # ---- v1: zero-copy --------------------------------------------------------------------
    def batch_exists(self, keys: list[str],
                     extra_info: HiCacheStorageExtraInfo | None = None) -> int:
        try:
            return len(self.engine.lookup_and_pin(PINS, [self._key(k) for k in keys]))
        except Exception:  # noqa: BLE001 - SGLang gets a miss, never an exception
            log.exception("kvstream HiCache: batch_exists failed; reporting no hit")
            return 0

    def batch_get_v1(self, keys: list[str], host_indices: torch.Tensor,
                     extra_info: HiCacheStorageExtraInfo | None = None) -> list[bool]:
        if not keys:
            return []
        try:
            pages = self._pages(keys, host_indices)
            skeys = [self._key(k) for k in keys]
        except Exception:  # noqa: BLE001 - never raise into SGLang: every page is a miss
            log.exception("kvstream HiCache: batch_get_v1 of %d pages failed", len(keys))
            return [False] * len(keys)
        try:
            hits = self._read(skeys, pages)
        finally:
            self.engine.release(PINS, skeys)
        n = sum(hits)
        self.pages_read += n
        self.pages_missed += len(keys) - n
        return hits

    def _read(self, skeys: list[str], pages: Sequence[list[Segment]]) -> list[bool]:
        """Read ``skeys`` into ``pages`` as one pool; returns once every read is settled."""
        out: list[bool] = []
        settled = threading.Event()

        def done(hits: list[bool]) -> None:
            out.extend(hits)
            settled.set()

        task = Settlement(len(skeys), done)
        reqs, idx = [], []
        for i, (skey, segs) in enumerate(zip(skeys, pages, strict=True)):
            info = self.engine.lookup(skey)
            if info is None or info.payload_len != sum(n for _, n in segs):
                task.miss(i)  # a page of another size is a miss, never a partial fill
                continue
            reqs.append(ReadRequest(info, Regions(segs, functools.partial(task.released, i))))
            idx.append(i)
        handles = self.engine.read(reqs)
        for i, h in zip(idx, handles, strict=True):
            h.add_done_callback(functools.partial(task.delivered, i))
        if not settled.wait(self.cfg.get_timeout_s):
            log.warning("kvstream HiCache: %d-page read not done in %.0f s; giving it up",
                        len(skeys), self.cfg.get_timeout_s)
            for h in handles:
                h.discard()
            settled.wait()  # the regions are SGLang's again only once no read writes there
        return out

    def batch_set_v1(self, keys: list[str], host_indices: torch.Tensor,
                     extra_info: HiCacheStorageExtraInfo | None = None) -> list[bool]:
        if not keys:
            return []
        try:
            pages = self._pages(keys, host_indices)
            skeys = [self._key(k) for k in keys]
        except Exception:  # noqa: BLE001 - a failed backup is False, never an exception
            log.exception("kvstream HiCache: batch_set_v1 of %d pages failed", len(keys))
            return [False] * len(keys)
        return self._write_all(skeys, pages)

    def _write_all(self, skeys: list[str], pages: Sequence[list[Segment]]) -> list[bool]:
        writes = [self._write(skey, segs) for skey, segs in zip(skeys, pages, strict=True)]
        deadline = time.monotonic() + self.cfg.get_timeout_s
        for w in writes:
            if w is not None:
                w.finished.wait(max(0.0, deadline - time.monotonic()))
        ok = [w is not None and w.ok for w in writes]
        self.pages_written += sum(ok)
        self.pages_failed += len(ok) - sum(ok)
        return ok

    def _write(self, skey: str, segs: list[Segment]) -> _PageWrite | None:
        """Stage one page; a _PageWrite already ok if the page is stored or being stored;
        None if no staging memory was free in time."""
        w = _PageWrite()
        if self.engine.stored_everywhere(skey) or self.engine.writing(skey):
            w.published(skey)
            return w
        size = sum(n for _, n in segs)
        buf = self._staging.get(size, time.monotonic() + self.cfg.get_timeout_s)
        if buf is None:
            log.warning("kvstream HiCache: no staging memory for %s within %.0f s", skey,
                        self.cfg.get_timeout_s)
            return None
        _gather(buf, segs)

        def copies_done() -> None:
            w.finished.set()
            self._staging.put(buf)

        if not self.engine.write(skey, buf, size, skey.encode(), on_published=w.published,
                                 on_done=copies_done):
            self._staging.put(buf)  # another writer won the race, or the engine is closing
            if self.engine.writing(skey) or self.engine.stored_everywhere(skey):
                w.published(skey)
            w.finished.set()
        return w

    # ---- the tensor path (without interface_v1) ----------------------------------------------
    def get(self, key: str, target_location: Any = None, target_sizes: Any = None) -> Any:
        return self.batch_get([key], [target_location])[0]

    def batch_get(self, keys: list[str], target_locations: Any = None,
                  target_sizes: Any = None) -> list[torch.Tensor | None]:
        try:
            hits = self._read([self._key("flat@" + k) for k in keys],
                              [_tensor_segments(t) for t in target_locations])
        except Exception:  # noqa: BLE001 - never raise into SGLang
            log.exception("kvstream HiCache: batch_get of %d pages failed", len(keys))
            return [None] * len(keys)
        return [t if ok else None for t, ok in zip(target_locations, hits, strict=True)]

    def set(self, key: str, value: Any = None, target_location: Any = None,
            target_sizes: Any = None) -> bool:
        return self.batch_set([key], [value])

    def batch_set(self, keys: list[str], values: Any = None, target_locations: Any = None,
                  target_sizes: Any = None) -> bool:
        try:
            return all(self._write_all([self._key("flat@" + k) for k in keys],
                                       [_tensor_segments(v) for v in values]))
        except Exception:  # noqa: BLE001 - never raise into SGLang
            log.exception("kvstream HiCache: batch_set of %d pages failed", len(keys))
            return False

    def exists(self, key: str) -> bool:
        try:
            return self.engine.lookup(self._key(key)) is not None
        except Exception:  # noqa: BLE001
            log.exception("kvstream HiCache: exists failed")
            return False

    # ---- management -----------------------------------------------------------------------
    def clear(self) -> None:
        """Remove every chunk from every tier (SGLang's "flush the storage"; the tiers are
        this backend's: give other users of kvstream other directories)."""
        self.engine.clear()

    def get_stats(self) -> None:
        return None  # kvstream's counters: its Prometheus metrics and the stats file

    def close(self) -> None:
        """Drain staged writes (bounded by ``close_timeout_s``), stop the engine."""
        if self._closed:
            return
        self._closed = True
        self.engine.close()
        self._staging.close()
        log.info("kvstream HiCache storage: closed (%d pages read, %d missed, %d written, "
                 "%d not written)", self.pages_read, self.pages_missed, self.pages_written,
                 self.pages_failed)


def _tensor_segments(t: torch.Tensor) -> list[Segment]:
    if not t.is_contiguous() or t.device.type != "cpu":
        raise ValueError("kvstream HiCache: pages must be contiguous CPU tensors")
    return [(t.data_ptr(), t.numel() * t.element_size())]


def _gather(dst: AlignedBuffer, segs: list[Segment]) -> None:
    """Copy ``segs`` back to back into ``dst``."""
    at = dst.addr
    for addr, n in segs:
        ctypes.memmove(at, addr, n)
        at += n
