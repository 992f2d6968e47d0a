"""``KVStreamBackend``: the LMCache 0.5.6 storage plugin.

Selected from LMCache's YAML with ``storage_plugins: ["kvstream"]`` and
``extra_config: {storage_plugin.kvstream.module_path: kvstream_backend,
storage_plugin.kvstream.class_name: KVStreamBackend, kvstream.tiers: [...]}``.

A thin translation of LMCache's calls onto the engine, which owns every pin and every
lookup-time read (:mod:`kvstream_backend.engine.lookups`); the plugin holds no read state.
The owner of a lookup is LMCache's lookup id in async mode, and ``""`` in sync mode (whose
unpins name only keys):

* lookup (``batched_contains(keys, pin=True)`` / ``batched_async_contains``): the engine pins
  the prefix hit and starts reading it at once, into MemoryObjs from ``local_cpu_backend``
  (allocated when a tier claims each chunk; at most ``kvstream.prefetch_max_gb`` of them not yet
  taken by a get). The lookups of a step's requests are that step's pool, read from both ends.
  What a lookup holds is released on ``unpin``, on ``cancel_request`` of its lookup id, after
  its get (async mode), or after ``kvstream.prefetch_timeout_s``;
* ``batched_get_blocking`` / ``batched_get_non_blocking`` take the lookup's reads (reading any
  chunk no lookup registered) and wait; results follow LMCache's prefix convention: everything
  after the first miss is released and returned as ``None`` (blocking) or left out
  (non-blocking);
* ``batched_submit_put_task`` takes a reference on each object and stages it for the deferred,
  replicated writer; it returns at once (it runs on the forward thread). The reference is
  dropped when every tier's copy is finished; ``on_complete_callback`` fires when the first copy
  is published.
"""

from __future__ import annotations

import asyncio
import logging
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
from ..engine import Alloc, ChunkInfo, Engine, ReadHandle, ReadRequest

log = init_logger("kvstream")

SYNC = ""  # the owner of LMCache's sync-mode lookups (its unpins name only keys)


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
        if self.cfg.metrics_port:
            from ..metrics import serve

            serve(self.engine, self.cfg.metrics_port)

    def __str__(self) -> str:
        return "KVStreamBackend"

    # ---- lookup ---------------------------------------------------------------------------
    def contains(self, key: CacheEngineKey, pin: bool = False) -> bool:
        if pin:
            return self.pin(key)
        return self.engine.lookup(key.to_string()) is not None

    def batched_contains(self, keys: list[CacheEngineKey], pin: bool = False) -> int:
        return self._lookup(SYNC, keys, pin)

    def _lookup(self, owner: str, keys: list[CacheEngineKey], pin: bool) -> int:
        """The prefix hit; with ``pin``, pinned for ``owner`` and read at once."""
        skeys = [k.to_string() for k in keys]
        if pin:
            read = self._allocator if self.local_cpu_backend is not None else None
            return len(self.engine.lookup_and_pin(owner, skeys, read=read))
        n = 0
        for k in skeys:
            if self.engine.lookup(k) is None:
                break
            n += 1
        return n

    async def batched_async_contains(
        self, lookup_id: str, keys: list[CacheEngineKey], pin: bool = False
    ) -> int:
        # Header reads of chunks published by other processes are file I/O: keep them off the
        # StorageManager's event loop.
        return await asyncio.get_running_loop().run_in_executor(
            None, self._lookup, lookup_id, keys, pin)

    def exists_in_put_tasks(self, key: CacheEngineKey) -> bool:
        return self.engine.writing(key.to_string())

    # ---- pins -----------------------------------------------------------------------------
    def pin(self, key: CacheEngineKey) -> bool:
        return bool(self.engine.lookup_and_pin(SYNC, [key.to_string()]))  # the prefix hit

    def unpin(self, key: CacheEngineKey) -> bool:
        return self.engine.release(SYNC, [key.to_string()]) > 0

    def remove(self, key: CacheEngineKey, force: bool = True) -> bool:
        return self.engine.remove(key.to_string())

    def cancel_request(self, req_id: str) -> None:
        """Release what an aborted request's lookup holds (async loading registers it under
        its lookup id; in sync mode LMCache unpins, which releases it too)."""
        self.engine.release(req_id)

    def touch_cache(self) -> None:
        """Recency is updated by the reads themselves."""

    # ---- reads ----------------------------------------------------------------------------
    def _allocator(self, info: ChunkInfo) -> Alloc | None:
        """A function allocating one MemoryObj for ``info`` (None if it cannot be rebuilt)."""
        lcb = self.local_cpu_backend
        layout = decode_meta(info.meta, info.payload_len)
        if lcb is None or layout is None:
            return None

        def alloc(_n: int) -> _ObjBuffer | None:
            obj = lcb.allocate(layout.shapes, layout.dtypes, layout.fmt, busy_loop=False)
            return _ObjBuffer(obj) if obj is not None else None

        return alloc

    def _handles_for(self, owner: str, keys: Sequence[CacheEngineKey]
                     ) -> list[ReadHandle | None]:
        """A handle per key a get waits for: the lookup's read, or a new read of the chunk."""
        skeys = [k.to_string() for k in keys]
        handles: list[ReadHandle | None] = [self.engine.take(owner, k) for k in skeys]
        self.engine.demand([h for h in handles if h is not None])
        missing: list[tuple[int, ReadRequest]] = []
        for i, (k, h) in enumerate(zip(skeys, handles, strict=True)):
            if h is not None and not h.abandoned:
                continue
            handles[i] = None
            info = self.engine.lookup(k)
            alloc = self._allocator(info) if info is not None else None
            buf = alloc(info.payload_len) if alloc is not None and info is not None else None
            if buf is None or info is None:
                break
            missing.append((i, ReadRequest(info, buf, alloc)))
        for (i, _), h in zip(missing, self.engine.read([r for _, r in missing]), strict=True):
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
        handles = self._handles_for(SYNC, keys)
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
        handles = await loop.run_in_executor(None, self._handles_for, lookup_id, keys)
        # The get holds the chunks now (they are not evictable while read): the lookup's
        # pins have done their job (LMCache 0.5.6 never unpins plugins in this mode).
        self.engine.release(lookup_id)
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
        self.engine.close()  # releases every lookup; logs the staged chunks it had to drop
        logging.getLogger("kvstream").info("kvstream: closed")
