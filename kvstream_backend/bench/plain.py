"""A plain reader that is not the engine: the device limit where fio is not installed.

It reads whole files with O_DIRECT ``preadv`` from a pool of ``depth`` threads into aligned
buffers (each thread reuses one buffer), with no pooling, routing, verification or Python
bookkeeping per chunk: what the file system gives at that queue depth.
"""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor

from ..io.memory import AlignedBuffer


def read_files(files: list[str], depth: int) -> tuple[float, int]:
    """Read ``files`` once; return (seconds, bytes)."""
    size = max(os.stat(f).st_size for f in files)
    local = threading.local()
    bufs: list[AlignedBuffer] = []
    lock = threading.Lock()

    def one(path: str) -> int:
        buf = getattr(local, "buf", None)
        if buf is None:
            buf = local.buf = AlignedBuffer(size)
            with lock:
                bufs.append(buf)
        fd = os.open(path, os.O_RDONLY | os.O_DIRECT)
        try:
            return os.preadv(fd, [buf.view], 0)
        finally:
            os.close(fd)

    try:
        with ThreadPoolExecutor(max_workers=depth) as pool:
            t0 = time.perf_counter()
            total = sum(pool.map(one, files))
            secs = time.perf_counter() - t0
    finally:
        for b in bufs:
            b.release()
    return secs, total


def best_read(files: list[str], max_threads: int,
              before: Callable[[], object] | None = None) -> tuple[float, dict[int, float]]:
    """The read limit of ``files``: :func:`read_files` from 1, 2, 4, ... ``max_threads`` threads
    (``before`` runs ahead of each, e.g. dropping the page cache); returns (best bytes/s,
    bytes/s per thread count)."""
    rates: dict[int, float] = {}
    t = 1
    while t <= max_threads:
        if before is not None:
            before()
        secs, n = read_files(files, t)
        rates[t] = n / secs
        t *= 2
    return max(rates.values()), rates


def write_files(workdirs: list[str], size: int, block: int, depth: int
                ) -> list[tuple[float, int]]:
    """:func:`write_file` in each of ``workdirs``, all at once (see :func:`fio.write_files`)."""
    with ThreadPoolExecutor(max_workers=len(workdirs)) as pool:
        return list(pool.map(lambda w: write_file(w, size, block, depth), workdirs))


def write_file(workdir: str, size: int, block: int, depth: int) -> tuple[float, int]:
    """Write ``size`` bytes to a new O_DIRECT file in ``workdir`` from ``depth`` threads;
    return (seconds, bytes). The file is removed."""
    buf = AlignedBuffer(block)
    path = os.path.join(workdir, f".kvstream-write-limit-{os.getpid()}")
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_DIRECT, 0o600)
    try:
        with ThreadPoolExecutor(max_workers=depth) as pool:
            t0 = time.perf_counter()
            total = sum(pool.map(lambda off: os.pwritev(fd, [buf.view], off),
                                 range(0, size - size % block, block)))
            os.fsync(fd)
            secs = time.perf_counter() - t0
    finally:
        os.close(fd)
        os.unlink(path)
        buf.release()
    return secs, total
