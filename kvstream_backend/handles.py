"""The contract between the engine and its adapters: buffers, chunk descriptions, read handles.

Adapters (the LMCache plugin, the L2 adapter, the bench, tests) import this module and
:class:`~kvstream_backend.engine.Engine`; nothing else of the engine's internals.

Buffer ownership: a buffer handed to :meth:`Engine.read` (or allocated by the engine through
the request's ``alloc``) belongs to the engine until the handle delivers it. A delivered buffer
(``handle.result``) belongs to whoever holds the handle, who must ``release()`` it (or call
``handle.discard()``). The engine releases every other buffer it allocated or was given.
"""

from __future__ import annotations

import ctypes
import logging
import threading
from collections.abc import Callable
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


@dataclass(frozen=True)
class ChunkInfo:
    """What a lookup learned from a valid header: the payload's size and adapter metadata."""

    digest: bytes
    payload_len: int
    meta: bytes


def payload_view(addr: int, n: int) -> memoryview:
    """A temporary view of ``n`` bytes at ``addr`` (for checksums); no copy."""
    return memoryview((ctypes.c_ubyte * n).from_address(addr)).cast("B")


_PENDING, _DONE, _ABANDONED = 0, 1, 2


class ReadHandle:
    """Completion of one pooled chunk read; safe to wait on from any thread.

    A handle is created by :meth:`Engine.read` either *demanded* (a get waits for it: it joins
    the step's pool) or as a *prefetch* (a lookup expects a get to follow: read only when no
    tier has demanded work). :meth:`Engine.demand` promotes prefetches; :meth:`discard` gives a
    handle up, and a prefetch that was not yet claimed is then never read.
    """

    __slots__ = (
        "key", "info", "buffer", "alloc", "result", "reason", "demanded", "deadline", "rid",
        "_state", "_lock", "_event", "_callbacks", "_on_discard",
    )

    def __init__(self, key: str, info: ChunkInfo, buffer: Buffer | None, alloc: Alloc | None,
                 demanded: bool, deadline: float) -> None:
        self.key = key
        self.info = info
        self.buffer = buffer  # the request's own buffer (None: allocated when claimed)
        self.alloc = alloc  # buffers for lazy allocation and hedges (None: neither)
        self.result: Buffer | None = None
        self.reason = ""
        self.demanded = demanded
        self.deadline = deadline  # a prefetch not demanded by then is dropped
        self.rid = -1  # the router's id, set by the completion loop
        self._state = _PENDING
        self._lock = threading.Lock()
        self._event = threading.Event()
        self._callbacks: list[Callable[[ReadHandle], None]] = []
        self._on_discard: Callable[[ReadHandle], None] | None = None

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
        if self._on_discard is not None:
            self._on_discard(self)
        for fn in callbacks:
            _safe(fn, self)

    def _deliver(self, buf: Buffer | None, reason: str = "") -> bool:
        """Hand ``buf`` (or a miss) over; False if the handle was abandoned (buf released)."""
        with self._lock:
            if self._state != _PENDING:
                if buf is not None:
                    buf.release()
                return False
            self.result = buf
            self.reason = reason
            self._state = _DONE
            callbacks, self._callbacks = self._callbacks, []
        self._event.set()
        for fn in callbacks:
            _safe(fn, self)
        return True


def _safe(fn: Callable, *args: object) -> None:
    try:
        fn(*args)
    except Exception:  # noqa: BLE001 - a caller's callback must not kill the loop
        log.exception("kvstream: callback raised")
