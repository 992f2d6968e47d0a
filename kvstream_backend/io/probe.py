"""Decide, per tier directory, which I/O path works there: io_uring or threads, O_DIRECT or not.

The probe does a real round trip (write then read back one aligned block through the candidate
queue) in the directory itself, so a file system that accepts ``O_DIRECT`` at open but fails it
at I/O time, or a sandbox without io_uring, is detected before the first chunk.

Before the ``liburing`` binding is used in-process at all, :func:`binding_usable` tries it in a
child process: the 2026.3.x wheels are built with AVX-512 (``vmovups %zmm0`` in
``Ring.__new__``) and die with SIGILL on CPUs without it, which no ``except`` can catch.
"""

from __future__ import annotations

import functools
import os
import select
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from typing import Literal, Protocol

from ..format import ALIGN
from . import files, threads
from .memory import AlignedBuffer
from .ops import IoOp, IoQueue, Waker
from .threads import ThreadQueue

PROBE_TIMEOUT_S = 10.0


@dataclass(frozen=True)
class IoPath:
    kind: Literal["uring", "threads"]
    direct: bool
    reason: str
    inline_issue: str = ""  # what the inline-issue probe measured (io_uring only)


_BINDING_CHECK = (
    "import liburing as L\n"
    "r = L.Ring()\n"
    "L.io_uring_queue_init(2, r)\n"
    "L.io_uring_queue_exit(r)\n"
)


@functools.cache
def binding_usable() -> tuple[bool, str]:
    """Whether the ``liburing`` binding can set up a ring here, tried in a child process."""
    # isolated (-I: no cwd, no environment), but with this process's import path, so a binding
    # installed through PYTHONPATH or --target is found exactly as the engine will find it
    check = f"import sys; sys.path[:] = {sys.path!r}\n{_BINDING_CHECK}"
    try:
        p = subprocess.run([sys.executable, "-I", "-c", check], capture_output=True,
                           timeout=60, text=True)
    except (OSError, subprocess.TimeoutExpired) as e:
        return False, f"liburing check could not run: {e}"
    if p.returncode == 0:
        return True, ""
    if p.returncode < 0:
        sig = signal.Signals(-p.returncode).name
        hint = " (the wheel needs AVX-512, which this CPU lacks)" if sig == "SIGILL" else ""
        return False, f"liburing binding killed by {sig}{hint}"
    last = (p.stderr.strip().splitlines() or ["?"])[-1]
    return False, f"liburing binding unusable: {last}"


class QueueFactory(Protocol):
    """How the engine builds its queues: ``threads`` and ``cpus`` (the CPUs those threads run
    on; ``None``: anywhere) concern the thread-pool path only."""

    def __call__(self, kind: str, depth: int, threads: int, waker: Waker, name: str,
                 cpus: frozenset[int] | None = None) -> IoQueue: ...


def make_queue(kind: str, depth: int, threads: int, waker: Waker, name: str,
               cpus: frozenset[int] | None = None) -> IoQueue:
    """The real queue of ``kind`` (the engine's default queue factory)."""
    if kind == "uring":
        ok, why = binding_usable()
        if not ok:
            raise OSError(95, why)
        from .uring import UringQueue  # imported lazily: the binding may be absent or refused

        return UringQueue(depth, waker)
    return ThreadQueue(depth, threads, waker, name, cpus)


def inline_issue(directory: str, direct: bool, mode: int, n: int = 4, size: int = 1 << 20) -> str:
    """Measure whether ``io_uring_submit`` issues reads inline on this file system.

    Reads ``n`` x ``size`` bytes with one submit and without ``IOSQE_ASYNC``, and reports how
    much of the total the submit call took (the engine always sets ``IOSQE_ASYNC``).
    """
    from .uring import UringQueue

    waker = Waker()
    queue = UringQueue(n, waker, async_issue=False)
    buf = AlignedBuffer(n * size)
    wfd, path = files.create_temp(directory, mode, direct)
    fds: list[int] = []
    try:
        os.pwritev(wfd, [buf.view], 0)
        for i in range(n):
            fds.append(files.open_read(path, direct))
            queue.submit(IoOp(fds[-1], [(buf.addr + i * size, size)], i * size, False, None))
        t0 = time.perf_counter()
        queue.flush()
        t_submit = time.perf_counter() - t0
        done = 0
        deadline = t0 + PROBE_TIMEOUT_S
        while done < n and time.perf_counter() < deadline:
            done += len(queue.reap())
            if done < n:
                select.select([waker.fd], [], [], 0.01)
                waker.clear()
        total = time.perf_counter() - t0
    finally:
        for fd in (wfd, *fds):
            os.close(fd)
        files.unlink_quiet(path)
        queue.close()
        waker.close()
        buf.release()
    blocks = t_submit > 0.5 * total
    return (f"inline issue {'BLOCKS' if blocks else 'does not block'}: submit took "
            f"{t_submit * 1e3:.1f} of {total * 1e3:.1f} ms for {n} x {size >> 20} MiB "
            "without IOSQE_ASYNC (kvstream sets it)")


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
    first = "first choice"
    if io_mode == "auto" and threads.NATIVE and files.memory_backed(directory):
        # a read from memory is a CPU copy: one native loop that copies and hashes each piece
        # in cache reads tmpfs at 0.85x of the plain limit on 16 cores, io_uring with the
        # verify threads' second pass at 0.64-0.66x (docs/benchmarks.md)
        kinds = ["threads", "uring"]
        first = "first choice: in memory, read and hashed in one native loop"
    directs = {"auto": [True, False], "on": [True], "off": [False]}[direct_mode]
    failures: list[str] = []
    for kind in kinds:
        for direct in directs:
            try:
                _round_trip(directory, kind, direct, mode)
            except Exception as e:  # noqa: BLE001 - any failure just rules the combination out
                failures.append(f"{kind}{'+direct' if direct else ''}: {e}")
                continue
            why = "; ".join(failures) if failures else first
            inline = "n/a: a thread pool issues each op on its own worker thread"
            if kind == "uring":
                try:
                    inline = inline_issue(directory, direct, mode)
                except Exception as e:  # noqa: BLE001 - the probe is informational
                    inline = f"inline-issue probe failed: {e}"
            return IoPath(kind, direct, why, inline)  # type: ignore[arg-type]
    raise OSError(5, f"no working I/O path in {directory}: {'; '.join(failures)}")
