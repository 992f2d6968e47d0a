"""A plain reader that is not the engine: the device limit where fio is not installed.

It reads whole files with O_DIRECT ``preadv`` from a pool of ``depth`` threads into aligned
buffers (each thread reuses one buffer), with no pooling, routing, verification or Python
bookkeeping per chunk: what the file system gives at that queue depth. Given a torch
``device``, each thread also copies what it read to that device before its next read, the way
LMCache brings a chunk from storage to the GPU: what the tier delivers into GPU memory when
the reads and the host->GPU copies share the host.
"""

from __future__ import annotations

import ctypes
import os
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from ..format import ALIGN
from ..io.memory import AlignedBuffer


class _Lane:
    """One thread's reusable read buffer and, with a ``device``, the copy of each read there:
    from pinned host memory (as LMCache's buffers are) on the thread's own CUDA stream."""

    def __init__(self, size: int, device: Any) -> None:
        self._aligned: AlignedBuffer | None = None
        if device is None:
            self._aligned = AlignedBuffer(size)
            self.view = self._aligned.view
            return
        import torch

        cuda = device.type == "cuda"
        raw = torch.empty(size + ALIGN, dtype=torch.uint8, pin_memory=cuda)
        skip = -raw.data_ptr() % ALIGN  # O_DIRECT wants an aligned buffer
        self.host = raw[skip:skip + size]
        self.view = memoryview((ctypes.c_ubyte * size).from_address(self.host.data_ptr()))
        self.dst = torch.empty(size, dtype=torch.uint8, device=device)
        self.stream = torch.cuda.Stream(device) if cuda else None

    def deliver(self, n: int) -> None:
        """Copy the ``n`` bytes just read to the device; return when they are there."""
        if self._aligned is not None:
            return
        if self.stream is None:
            self.dst[:n].copy_(self.host[:n])
            return
        import torch

        with torch.cuda.stream(self.stream):
            self.dst[:n].copy_(self.host[:n], non_blocking=True)
        self.stream.synchronize()

    def release(self) -> None:
        self.view.release()
        if self._aligned is not None:
            self._aligned.release()


def read_files(files: list[str], depth: int, device: Any = None) -> tuple[float, int]:
    """Read ``files`` once (and copy each to ``device``, if given); return (seconds, bytes)."""
    size = max(os.stat(f).st_size for f in files)
    local = threading.local()
    lanes: list[_Lane] = []
    lock = threading.Lock()

    def one(path: str) -> int:
        lane = getattr(local, "lane", None)
        if lane is None:
            lane = local.lane = _Lane(size, device)
            with lock:
                lanes.append(lane)
        fd = os.open(path, os.O_RDONLY | os.O_DIRECT)
        try:
            n = os.preadv(fd, [lane.view], 0)
        finally:
            os.close(fd)
        lane.deliver(n)
        return n

    try:
        with ThreadPoolExecutor(max_workers=depth) as pool:
            t0 = time.perf_counter()
            total = sum(pool.map(one, files))
            secs = time.perf_counter() - t0
    finally:
        for lane in lanes:
            lane.release()
        lanes.clear()
        if device is not None and device.type == "cuda":  # hand the copies' memory back
            import torch

            torch.cuda.empty_cache()
    return secs, total


def best_read(files: list[str], max_threads: int, before: Callable[[], object] | None = None,
              device: Any = None) -> tuple[float, dict[int, float]]:
    """The read limit of ``files``: :func:`read_files` from 1, 2, 4, ... ``max_threads`` threads
    (``before`` runs ahead of each, e.g. dropping the page cache; ``device``: into there);
    returns (best bytes/s, bytes/s per thread count)."""
    rates: dict[int, float] = {}
    t = 1
    while t <= max_threads:
        if before is not None:
            before()
        secs, n = read_files(files, t, device)
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
