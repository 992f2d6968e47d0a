"""A queue factory whose queues do real I/O but can be held or made to block (for the engine's
deterministic tests). The only fake is *when* an op is handed on; every byte is really moved
by the thread-pool queue underneath, on real files.
"""

from __future__ import annotations

import threading

from kvstream_backend.io.ops import IoOp, Waker
from kvstream_backend.io.threads import ThreadQueue


class Control:
    """What the test steers: a gate that holds submissions, a submit that blocks, a log."""

    def __init__(self) -> None:
        self.open = threading.Event()
        self.open.set()
        self.block: dict[str, threading.Event] = {}  # queue name -> released when set
        self.blocked: dict[str, threading.Event] = {}  # set once the queue's submit blocks
        self.log: list[tuple[str, IoOp]] = []
        self.wakers: list[Waker] = []
        self._lock = threading.Lock()

    def block_submit(self, name: str) -> threading.Event:
        """Make the first submit of queue ``name`` block until the returned event is set."""
        self.block[name] = threading.Event()
        self.blocked[name] = threading.Event()
        return self.block[name]

    def release(self) -> None:
        """Open the gate: held submissions go on."""
        self.open.set()
        for w in self.wakers:
            w.wake()

    def factory(self, kind: str, depth: int, threads: int, waker: Waker, name: str,
                cpus: frozenset[int] | None = None):
        self.wakers.append(waker)
        return ControlledQueue(ThreadQueue(depth, threads, waker, name, cpus), name, self)

    def reads(self, tier: str | None = None) -> list[IoOp]:
        """Read ops (of one tier, or all) in the order they reached the queues underneath."""
        with self._lock:
            return [op for n, op in self.log
                    if n.endswith("-r") and (tier is None or n == f"{tier}-r")]


class ControlledQueue:
    kind = "threads"

    def __init__(self, inner: ThreadQueue, name: str, ctl: Control) -> None:
        self._inner = inner
        self._name = name
        self._ctl = ctl
        self._held: list[IoOp] = []

    @property
    def inflight(self) -> int:
        return self._inner.inflight + len(self._held)

    @property
    def hashes_reads(self) -> bool:
        return self._inner.hashes_reads

    def submit(self, op: IoOp) -> bool:
        release = self._ctl.block.get(self._name)
        if release is not None and not self._ctl.blocked[self._name].is_set():
            self._ctl.blocked[self._name].set()
            release.wait(30)
        if not self._ctl.open.is_set() or self._held:  # FIFO: none passes the ops held
            self._held.append(op)  # (once the gate opens, the tier thread's next flush)
            return True
        with self._ctl._lock:
            self._ctl.log.append((self._name, op))
        return self._inner.submit(op)

    def flush(self) -> None:
        if self._held and self._ctl.open.is_set():
            held, self._held = self._held, []
            for op in held:
                with self._ctl._lock:
                    self._ctl.log.append((self._name, op))
                assert self._inner.submit(op)
        self._inner.flush()

    def reap(self) -> list[IoOp]:
        return self._inner.reap()

    def close(self) -> None:
        self._inner.close()
