"""The contract between the engine and its adapters: buffers, chunk descriptions, read handles.

Adapters (the LMCache plugin, the L2 adapter, the bench, tests) import this module and
:class:`~kvstream_backend.engine.Engine`; nothing else of the engine's internals.

A buffer is one range of memory, or a :class:`Regions`: one chunk's payload scattered over
several ranges of the caller's memory (a page of SGLang's host pool: K and V apart, or one range
per layer), read into and written from in place.

Buffer ownership: a buffer handed to :meth:`Engine.read` (or allocated by the engine through
the request's ``alloc``) belongs to the engine until the handle delivers it. A delivered buffer
(``handle.result``) belongs to whoever holds the handle, who must ``release()`` it (or call
``handle.discard()``). The engine releases every other buffer it allocated or was given.
"""

from __future__ import annotations

import ctypes
import logging
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Protocol

log = logging.getLogger("kvstream")


class Buffer(Protocol):
    """Memory a chunk is read into or written from: ``capacity`` bytes at ``addr``."""

    addr: int
    capacity: int

    def release(self) -> None: ...


Alloc = Callable[[int], "Buffer | None"]
"""Allocates a buffer for an ``n``-byte payload, or returns None when memory is short."""

Segment = tuple[int, int]  # (address, length)


class Regions:
    """A buffer made of ``segments``, in payload order: the payload's first bytes fill the
    first segment, and so on. ``addr`` is the first segment's, ``capacity`` their sum;
    ``release`` calls ``on_release`` (the memory stays the caller's)."""

    __slots__ = ("segments", "addr", "capacity", "_on_release")

    def __init__(self, segments: Sequence[Segment],
                 on_release: Callable[[], None] | None = None) -> None:
        if not segments or any(n <= 0 for _, n in segments):
            raise ValueError("Regions: need at least one segment, each of positive length")
        self.segments = tuple(segments)
        self.addr = segments[0][0]
        self.capacity = sum(n for _, n in segments)
        self._on_release = on_release

    def release(self) -> None:
        if self._on_release is not None:
            self._on_release()


def segments(buf: Buffer, n: int) -> list[Segment]:
    """The memory that holds the first ``n`` bytes of ``buf``'s payload, in order."""
    if not isinstance(buf, Regions):
        return [(buf.addr, n)]
    out: list[Segment] = []
    for addr, size in buf.segments:
        if n <= 0:
            break
        out.append((addr, min(size, n)))
        n -= size
    return out


@dataclass(frozen=True)
class ChunkInfo:
    """What a lookup learned from a valid header: the chunk's key and its digest (computed
    once, together, so they always agree), the payload's size and adapter metadata."""

    key: str
    digest: bytes
    payload_len: int
    meta: bytes


@dataclass(frozen=True)
class ReadRequest:
    """One chunk to read: what a lookup returned, where to put it (``buffer``; None:
    allocated with ``alloc`` when a tier claims it) and how to allocate more (hedges; None:
    no hedge)."""

    info: ChunkInfo
    buffer: Buffer | None = None
    alloc: Alloc | None = None


def payload_view(addr: int, n: int) -> memoryview:
    """A temporary view of ``n`` bytes at ``addr`` (for checksums); no copy."""
    return memoryview((ctypes.c_ubyte * n).from_address(addr)).cast("B")


def payload_views(buf: Buffer, n: int) -> list[memoryview]:
    """Temporary views of the first ``n`` payload bytes of ``buf``, in order; no copy."""
    return [payload_view(a, m) for a, m in segments(buf, n)]


_PENDING, _DONE, _ABANDONED = 0, 1, 2


class ReadHandle:
    """Completion of one pooled chunk read; safe to wait on from any thread.

    Created by the engine, either *demanded* (a get waits for it) or for a lookup (read at once
    as part of the step's pool, held until a get takes it); :meth:`discard` gives it up, and a
    read that no tier claimed yet is then never issued. The engine resolves it with
    :meth:`deliver`, once; ``on_discard`` tells the engine a handle was given up.
    """

    __slots__ = (
        "info", "buffer", "alloc", "result", "reason", "demanded", "rid", "delivered_at",
        "_state", "_lock", "_event", "_callbacks", "_on_discard",
    )

    def __init__(self, req: ReadRequest, demanded: bool,
                 on_discard: Callable[[ReadHandle], None]) -> None:
        self.info = req.info
        self.buffer = req.buffer  # the request's own buffer (None: allocated when claimed)
        self.alloc = req.alloc  # buffers for lazy allocation and hedges (None: neither)
        self.result: Buffer | None = None
        self.reason = ""
        self.demanded = demanded
        self.rid = -1  # the router's id, set by the completion loop
        self.delivered_at = 0.0  # time.perf_counter() when it was resolved (0: not yet)
        self._state = _PENDING
        self._lock = threading.Lock()
        self._event = threading.Event()
        self._callbacks: list[Callable[[ReadHandle], None]] = []
        self._on_discard = on_discard

    @property
    def key(self) -> str:
        return self.info.key

    def add_done_callback(self, fn: Callable[[ReadHandle], None]) -> None:
        """Call ``fn(handle)`` once the chunk is delivered (at once if it already is).

        Callbacks run on the completion loop and must only hand off (e.g. to an event loop).
        """
        with self._lock:
            if self._state == _PENDING:
                self._callbacks.append(fn)
                return
        fn(self)

    def done(self) -> bool:
        return self._event.is_set()

    @property
    def abandoned(self) -> bool:
        return self._state == _ABANDONED

    def wait(self, timeout: float | None = None) -> Buffer | None:
        """The verified buffer, or None on a miss or when ``timeout`` passes (then discarded)."""
        if self._event.wait(timeout):
            return self.result
        with self._lock:
            if self._state == _DONE:
                return self.result
        self.reason = "timeout"
        self.discard()
        return None

    def discard(self) -> None:
        """Give the chunk up: a delivered buffer is released now, a pending read's when it ends,
        and a prefetch that no tier claimed yet is dropped without being read."""
        with self._lock:
            if self._state == _ABANDONED:
                return
            if self._state == _DONE and self.result is not None:
                self.result.release()
                self.result = None
            self._state = _ABANDONED
            callbacks, self._callbacks = self._callbacks, []
        self._on_discard(self)
        for fn in callbacks:
            call_safely(fn, self)

    def deliver(self, buf: Buffer | None, reason: str = "") -> bool:
        """Engine side: hand ``buf`` (or a miss) over, once; False if the handle was
        abandoned (``buf`` is released)."""
        with self._lock:
            if self._state != _PENDING:
                if buf is not None:
                    buf.release()
                return False
            self.result = buf
            self.reason = reason
            self.delivered_at = time.perf_counter()
            self._state = _DONE
            callbacks, self._callbacks = self._callbacks, []
        self._event.set()
        for fn in callbacks:
            call_safely(fn, self)
        return True


def call_safely(fn: Callable, *args: object) -> None:
    """Run a caller's callback; an exception is logged, never raised into the engine."""
    try:
        fn(*args)
    except Exception:  # noqa: BLE001 - a caller's callback must not kill the loop
        log.exception("kvstream: callback raised")
