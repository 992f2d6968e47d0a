"""Thread-pool queue: ``os.preadv``/``os.pwritev`` for tiers where io_uring is unavailable (and
for memory-backed tiers where the native loop is built); and the daemon worker threads that it
and a tier's file steps run on.

A read that carries a ``hash_span`` is read in pieces of :data:`HASH_PIECE` bytes, each hashed
by the same thread right after it lands, from its cache. Hashed after the whole chunk (16-32
MiB, past any core's cache) the checksum is one more pass over memory: on a 2-core machine's
tmpfs the engine read a median 0.79x of the plain reader that way and 0.87x hashing each piece. Each
piece costs two GIL hand-offs in Python, which caps it on many cores: on a 16-core host, tmpfs
read with one such reader per core (what a memory-backed tier gets on this path) at 0.54-0.71x,
with the default 4 at 0.30x, and io_uring with the verify threads at 0.62-0.69x. Where
``_kvstream_native`` is built (:data:`NATIVE`), the whole read and its hashing run in one C
loop without the GIL: 0.85-0.86x on that host, so memory-backed tiers take this path first
there (:func:`kvstream_backend.io.probe.probe`).

Hashing while reading pays only where a read is a copy out of memory: on GlusterFS (FUSE) the
pieces serialized the round trips, 0.55-0.62 GB/s against 0.69-0.73 for one read per chunk, so
tier workers ask for it on tmpfs and ramfs only.
"""

from __future__ import annotations

import collections
import logging
import os
import queue
import threading
from collections.abc import Callable
from types import ModuleType
from typing import Any

import xxhash

from .memory import exporter
from .ops import IoOp, Waker


def _load_native() -> ModuleType | None:
    """The read-and-hash loop in C (``setup.py`` builds it where a compiler is found)."""
    try:
        import _kvstream_native
    except ImportError:  # pragma: no cover - depends on the install
        return None
    return _kvstream_native


_native = _load_native()
NATIVE = _native is not None
"""Whether a hashed read runs in one native loop without the GIL (else in Python, piece by
piece, two GIL hand-offs per piece)."""

log = logging.getLogger("kvstream")

HASH_PIECE = 1 << 20
"""Bytes per ``preadv`` while hashing: hashed while they are still in the core's L2 cache."""


class Workers:
    """``n`` daemon threads that run submitted calls, first submitted first started.

    Daemon threads, unlike :class:`concurrent.futures.ThreadPoolExecutor`'s, which the
    interpreter joins at exit: a call blocked on a dead hard-mounted network file system must not
    hold the process's exit. A call hands its result back itself; one that raises is logged, and
    the thread goes on. With ``cpus`` the threads run on those CPUs only.
    """

    def __init__(self, n: int, name: str, cpus: frozenset[int] | None = None) -> None:
        self._calls: queue.SimpleQueue[tuple[Callable[..., None], tuple[Any, ...]] | None] = \
            queue.SimpleQueue()
        self._threads = [threading.Thread(target=self._run, args=(cpus,), name=f"{name}-{i}",
                                          daemon=True) for i in range(n)]
        for t in self._threads:
            t.start()

    def submit(self, fn: Callable[..., None], *args: Any) -> None:
        self._calls.put((fn, args))

    def _run(self, cpus: frozenset[int] | None) -> None:
        if cpus:  # this thread only (Linux: pid 0 is the calling thread)
            os.sched_setaffinity(0, cpus)
        while (call := self._calls.get()) is not None:
            fn, args = call
            try:
                fn(*args)
            except Exception:  # noqa: BLE001 - keep the thread; the call's owner times it out
                log.exception("kvstream: %s failed", getattr(fn, "__qualname__", fn))

    def shutdown(self) -> None:
        """Run what was submitted, then stop the threads (callers shut down when idle)."""
        for _ in self._threads:
            self._calls.put(None)
        for t in self._threads:
            t.join()


def transfer(op: IoOp) -> None:
    """Move all of ``op`` (looping over short transfers); set ``op.result``."""
    try:
        if op.hash_span is not None and not op.write:
            _read_hashing(op, op.hash_span)
        while op.done < op.length:
            segs, offset = op.remaining()
            views = [exporter(s) for s in segs]
            n = os.pwritev(op.fd, views, offset) if op.write else os.preadv(op.fd, views, offset)
            if n == 0:
                break
            op.done += n
        op.result = op.done
    except OSError as e:
        op.result = -(e.errno or 5)


def _read_hashing(op: IoOp, span: tuple[int, int]) -> None:
    """Read ``op`` piece by piece, hashing each piece's share of ``span`` as soon as it lands;
    set ``op.digest``. Returns at end of file or after the last segment (``op.done`` counts).
    With :data:`NATIVE` the loop runs in C without the GIL, else here."""
    lo, hi = span
    if _native is not None:
        moved, op.digest, err = _native.read_hashed(op.fd, op.segs, op.offset, lo, hi,
                                                    HASH_PIECE)
        op.done += moved
        if err:
            raise OSError(err, os.strerror(err))
        return
    hasher = xxhash.xxh3_64()
    try:
        _read_hashing_here(op, lo, hi, hasher)
    finally:
        op.digest = hasher.intdigest()


def _read_hashing_here(op: IoOp, lo: int, hi: int, hasher: xxhash.xxh3_64) -> None:
    pos = 0  # op position of the segment's first byte
    for addr, n in op.segs:
        view = exporter((addr, n))
        at = 0
        while at < n:
            got = os.preadv(op.fd, [view[at:at + min(n - at, HASH_PIECE)]], op.offset + pos + at)
            if got == 0:
                return
            a, b = max(lo, pos + at), min(hi, pos + at + got)
            if a < b:
                hasher.update(view[a - pos:b - pos])
            at += got
            op.done += got
        pos += n


class ThreadQueue:
    kind = "threads"
    hashes_reads = True

    def __init__(self, depth: int, threads: int, waker: Waker, name: str,
                 cpus: frozenset[int] | None = None) -> None:
        self._pool = Workers(threads, f"kvs-{name}", cpus)
        self._depth = depth
        self._waker = waker
        self._done: collections.deque[IoOp] = collections.deque()
        self.inflight = 0

    def _run(self, op: IoOp) -> None:
        transfer(op)
        self._done.append(op)
        self._waker.wake()

    def submit(self, op: IoOp) -> bool:
        if self.inflight >= self._depth:
            return False
        self.inflight += 1
        self._pool.submit(self._run, op)
        return True

    def flush(self) -> None:
        return None

    def reap(self) -> list[IoOp]:
        out: list[IoOp] = []
        while self._done:
            out.append(self._done.popleft())
        self.inflight -= len(out)
        return out

    def close(self) -> None:
        self._pool.shutdown()
