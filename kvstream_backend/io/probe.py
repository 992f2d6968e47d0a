"""Decide, per tier directory, which I/O path works there: io_uring or threads, O_DIRECT or not.

The probe does a real round trip (write then read back one aligned block through the candidate
queue) in the directory itself, so a file system that accepts ``O_DIRECT`` at open but fails it
at I/O time, or a sandbox without io_uring, is detected before the first chunk.
"""

from __future__ import annotations

import os
import select
from dataclasses import dataclass
from typing import Literal

from ..format import ALIGN
from . import files
from .memory import AlignedBuffer
from .ops import IoOp, IoQueue, Waker
from .threads import ThreadQueue

PROBE_TIMEOUT_S = 10.0


@dataclass(frozen=True)
class IoPath:
    kind: Literal["uring", "threads"]
    direct: bool
    reason: str


def make_queue(kind: str, depth: int, threads: int, waker: Waker, name: str) -> IoQueue:
    if kind == "uring":
        from .uring import UringQueue  # imported lazily: the binding may be absent or refused

        return UringQueue(depth, waker)
    return ThreadQueue(depth, threads, waker, name)


def _round_trip(directory: str, kind: str, direct: bool, mode: int) -> None:
    """Write and read back one block through a fresh queue of ``kind``; raise on any failure."""
    waker = Waker()
    queue = make_queue(kind, 2, 1, waker, "probe")
    src, dst = AlignedBuffer(ALIGN), AlignedBuffer(ALIGN)
    src.view[:] = os.urandom(ALIGN)
    wfd, path = files.create_temp(directory, mode, direct)
    rfd = -1
    try:
        for write, buf in ((True, src), (False, dst)):
            if not write:
                rfd = files.open_read(path, direct)
            op = IoOp(wfd if write else rfd, [(buf.addr, ALIGN)], 0, write, None)
            if not queue.submit(op):
                raise OSError("probe queue refused an op")
            queue.flush()
            done: list[IoOp] = []
            poller = select.poll()
            poller.register(waker.fd, select.POLLIN)
            while not done:
                if not poller.poll(PROBE_TIMEOUT_S * 1000):
                    raise TimeoutError(f"{kind} probe I/O timed out")
                waker.clear()
                done = queue.reap()
            if op.result != ALIGN:
                raise OSError(-op.result if op.result < 0 else 5, os.strerror(-op.result)
                              if op.result < 0 else "short transfer")
        if src.view.tobytes() != dst.view.tobytes():
            raise OSError(5, "probe read back different bytes")
    finally:
        for fd in (wfd, rfd):
            if fd >= 0:
                os.close(fd)
        files.unlink_quiet(path)
        queue.close()
        waker.close()
        src.release()
        dst.release()


def probe(directory: str, io_mode: str, direct_mode: str, mode: int) -> IoPath:
    """Return the best working :class:`IoPath` for ``directory`` under the configured modes.

    Raises ``OSError`` only when no combination works (the directory itself is unusable).
    """
    kinds = ["uring", "threads"] if io_mode == "auto" else [io_mode]
    directs = {"auto": [True, False], "on": [True], "off": [False]}[direct_mode]
    failures: list[str] = []
    for kind in kinds:
        for direct in directs:
            try:
                _round_trip(directory, kind, direct, mode)
            except Exception as e:  # noqa: BLE001 - any failure just rules the combination out
                failures.append(f"{kind}{'+direct' if direct else ''}: {e}")
                continue
            why = "; ".join(failures) if failures else "first choice"
            return IoPath(kind, direct, why)  # type: ignore[arg-type]
    raise OSError(5, f"no working I/O path in {directory}: {'; '.join(failures)}")
