"""The completion loop's thread: commands in from any thread, finished jobs in from the tier
workers, one turn at a time, and a snapshot of the outcome for threads that wait on it.

Call protocol:

* ``post(cmd)`` (any thread) queues ``cmd(now)``; the loop runs queued commands in order at the
  start of each turn.
* ``deliver(job)`` (tier workers) queues a finished job; the turn takes it from its ``jobs``
  iterator (one at a time: what a turn that fails leaves queued is taken by the next).
* ``wait(pred, timeout)`` (any thread) wakes the loop once and waits until ``pred(settled,
  caught_up)`` holds, where ``settled`` is what the last turn published and ``caught_up`` says
  whether that turn had taken every command posted so far.
* ``start()`` once; ``stop()`` asks the loop to end once ``busy()`` is false and no command
  is queued; ``join`` waits for that.

Ownership: ``_cmds`` (appended with ``_posted`` under ``_posted_lock``, drained by the loop) and
``_done`` (appended by workers, drained by the loop) are deques, thread-safe by contract;
``_settled`` is written by the loop and read by waiters, both under ``_turned``. The turn
function owns everything else and runs only on this thread.
"""

from __future__ import annotations

import collections
import logging
import select
import threading
import time
from collections.abc import Callable, Iterator
from typing import Generic, NamedTuple, TypeVar

from ..io.ops import Waker

log = logging.getLogger("kvstream")

Command = Callable[[float], None]
J = TypeVar("J")


class Settled(NamedTuple):
    """What a turn left behind, published for waiters on other threads."""

    taken: int  # commands posted before the turn began (all of them ran in it)
    reads_idle: bool  # no read outstanding
    repairs_idle: bool  # no repair queued or running


class CompletionLoop(Generic[J]):
    """One thread: commands, then ``turn(now, jobs) -> (reads_idle, repairs_idle)``.

    ``next_wake_ms()`` says how long the loop may sleep when nothing arrives (-1: until woken);
    ``busy()`` whether work is outstanding (the loop outlives ``stop`` until it is not).
    """

    def __init__(self, turn: Callable[[float, Iterator[J]], tuple[bool, bool]],
                 clock: Callable[[], float], next_wake_ms: Callable[[], int],
                 busy: Callable[[], bool], name: str = "kvstream-io") -> None:
        self._turn = turn
        self._clock = clock
        self._next_wake_ms = next_wake_ms
        self._busy = busy
        self.waker = Waker()
        self._cmds: collections.deque[Command] = collections.deque()
        self._done: collections.deque[J] = collections.deque()
        self._posted_lock = threading.Lock()
        self._posted = 0
        self._turned = threading.Condition()
        self._settled = Settled(0, True, True)
        self._stopping = False
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)

    def start(self) -> None:
        """Start the thread (once the owner can take calls from it: a turn may post)."""
        self._thread.start()

    # ---- any thread -----------------------------------------------------------------------
    def post(self, cmd: Command) -> None:
        with self._posted_lock:
            self._posted += 1
            self._cmds.append(cmd)
        self.waker.wake()

    def deliver(self, job: J) -> None:
        self._done.append(job)
        self.waker.wake()

    def wait(self, pred: Callable[[Settled, bool], bool], timeout: float | None) -> bool:
        """Wait until ``pred`` holds (evaluated under ``_turned``); False on timeout. The loop
        is woken once, to run a turn; each turn notifies. Waking it on every notification
        would make the two threads ping-pong on the GIL for the whole wait (it doubled the CPU
        of a flush)."""
        deadline = None if timeout is None else time.monotonic() + timeout
        self.waker.wake()
        with self._turned:
            while True:
                with self._posted_lock:
                    posted = self._posted
                if pred(self._settled, self._settled.taken == posted):
                    return True
                left = None if deadline is None else deadline - time.monotonic()
                if left is not None and left <= 0:
                    return False
                self._turned.wait(0.05 if left is None else min(left, 0.05))

    @property
    def alive(self) -> bool:
        return self._thread.is_alive()

    def stop(self) -> None:
        self._stopping = True
        self.waker.wake()

    def join(self, timeout: float | None) -> bool:
        """Wait for the thread to end; True if it did (then the waker is closed)."""
        self._thread.join(timeout)
        if self._thread.is_alive():
            return False
        self.waker.close()
        return True

    # ---- the loop's thread ----------------------------------------------------------------
    def _run(self) -> None:
        poller = select.poll()
        poller.register(self.waker.fd, select.POLLIN)
        while True:
            try:
                self._once()
                if self._stopping and not self._cmds and not self._done and not self._busy():
                    break
                wake_ms = 0 if self._cmds or self._done else self._next_wake_ms()
            except Exception:  # noqa: BLE001 - the loop must survive anything a turn throws
                log.exception("kvstream: unexpected error in the completion loop")
                wake_ms = 50  # what failed is still queued: the next turn retries it
            if wake_ms:
                poller.poll(wake_ms)
            self.waker.clear()
        with self._turned:
            self._turned.notify_all()

    def _jobs(self) -> Iterator[J]:
        while self._done:
            yield self._done.popleft()

    def _once(self) -> None:
        with self._posted_lock:
            taken = self._posted  # every command counted here is in _cmds: drained below
        now = self._clock()
        while self._cmds:
            self._cmds.popleft()(now)
        reads_idle, repairs_idle = self._turn(now, self._jobs())
        with self._turned:
            self._settled = Settled(taken, reads_idle, repairs_idle)
            self._turned.notify_all()
