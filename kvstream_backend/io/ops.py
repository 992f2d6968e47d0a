"""The unit of I/O and the queue protocol that both I/O paths implement."""

from __future__ import annotations

import contextlib
import os
from typing import Any, Protocol

from .memory import Segment


class IoOp:
    """One positional vectored read or write of ``length`` bytes at ``offset`` of ``fd``.

    ``segs`` are ``(address, length)`` pairs, page-aligned when the fd is O_DIRECT; the memory
    must stay valid until the op is handed back. Queues complete short
    transfers themselves; when an op is handed back, ``result`` is the number of bytes moved
    (less than ``length`` only at end of file) or ``-errno``. ``ctx`` belongs to the submitter.

    A read may carry a ``hash_span`` ``(start, end)``, byte positions within the op: a queue
    whose ``hashes_reads`` is True sets ``digest`` to the XXH3-64 of exactly the bytes of that
    span that landed, hashed on the thread that moved them while they are still in that core's
    cache (others leave ``digest`` None, and the submitter hashes the memory afterwards).
    """

    __slots__ = ("fd", "segs", "offset", "length", "write", "done", "result", "ctx", "t_submit",
                 "hash_span", "digest")

    def __init__(
        self, fd: int, segs: list[Segment], offset: int, write: bool, ctx: Any
    ) -> None:
        self.fd = fd
        self.segs = segs
        self.offset = offset
        self.length = sum(n for _, n in segs)
        self.write = write
        self.done = 0
        self.result = 0
        self.ctx = ctx
        self.t_submit = 0.0
        self.hash_span: tuple[int, int] | None = None
        self.digest: int | None = None

    def remaining(self) -> tuple[list[Segment], int]:
        """The segments and file offset still to transfer after ``done`` bytes."""
        skip, out = self.done, []
        for addr, n in self.segs:
            if skip >= n:
                skip -= n
                continue
            out.append((addr + skip, n - skip))
            skip = 0
        return out, self.offset + self.done


class Waker:
    """One eventfd that every queue signals on completion; the completion loop polls it."""

    def __init__(self) -> None:
        self.fd = os.eventfd(0, os.EFD_NONBLOCK | os.EFD_CLOEXEC)

    def wake(self) -> None:
        with contextlib.suppress(BlockingIOError):
            os.eventfd_write(self.fd, 1)

    def clear(self) -> None:
        with contextlib.suppress(BlockingIOError):
            os.eventfd_read(self.fd)

    def close(self) -> None:
        os.close(self.fd)


class IoQueue(Protocol):
    """Submission protocol, driven from one thread (the completion loop).

    ``submit`` queues an op and returns False when the queue is at its depth; ``flush`` hands
    queued ops to the kernel or workers; ``reap`` returns finished ops (never blocking) and
    the queue signals the shared :class:`Waker` whenever more may be reaped. ``inflight`` is
    the number of submitted, unreaped ops. ``hashes_reads``: the queue sets a read's
    ``digest`` (see :class:`IoOp`).
    """

    kind: str
    inflight: int
    hashes_reads: bool

    def submit(self, op: IoOp) -> bool: ...

    def flush(self) -> None: ...

    def reap(self) -> list[IoOp]: ...

    def close(self) -> None: ...
