"""Thread-pool queue: ``os.preadv``/``os.pwritev`` for tiers where io_uring is unavailable."""

from __future__ import annotations

import collections
import os
from concurrent.futures import ThreadPoolExecutor

from .memory import exporter
from .ops import IoOp, Waker


def transfer(op: IoOp) -> None:
    """Move all of ``op`` (looping over short transfers); set ``op.result``."""
    try:
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


class ThreadQueue:
    kind = "threads"

    def __init__(self, depth: int, threads: int, waker: Waker, name: str) -> None:
        self._pool = ThreadPoolExecutor(max_workers=threads, thread_name_prefix=f"kvs-{name}")
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
        self._pool.shutdown(wait=True)
