"""Reads into a caller's memory, settled only when the engine is finished with that memory.

Both the L2 adapter (LMCache's L1 buffers) and the HiCache adapter (SGLang's host pool) hand the
engine the caller's own memory. A key's read is *settled* when its chunk was delivered, or, on a
miss, once the engine has handed the buffer back (a miss can be delivered while a failed copy's
retry on another tier still writes into it; only the release says no read touches the memory).
Only then may the caller reuse the memory, so only then does the batch complete.
"""

from __future__ import annotations

import threading
from collections.abc import Callable

from ..handles import ReadHandle


class Settlement:
    """Settles ``n`` keys; calls ``done(hits)`` once, when every key is settled (at once if
    ``n`` is 0). ``hits[i]`` is True if key ``i``'s chunk was delivered.

    Invariant: ``done`` runs only after the engine stopped writing into every buffer of the
    batch. Thread-safe (the engine's loop and the caller's thread both settle).
    """

    def __init__(self, n: int, done: Callable[[list[bool]], None]) -> None:
        self._lock = threading.Lock()
        self._left = n
        self._hits = [False] * n
        self._delivered: dict[int, bool] = {}
        self._released: set[int] = set()
        self._done = done
        if n == 0:
            done(self._hits)

    def miss(self, i: int) -> None:
        """Key ``i`` was never handed to the engine."""
        self._settle(i, False)

    def delivered(self, i: int, h: ReadHandle) -> None:
        """Done callback of key ``i``'s handle."""
        ok = h.result is not None
        with self._lock:
            if not ok and i not in self._released:
                self._delivered[i] = False  # settled when the engine hands the buffer back
                return
        self._settle(i, ok)

    def released(self, i: int) -> None:
        """The engine handed key ``i``'s buffer back (``Buffer.release``)."""
        with self._lock:
            if self._delivered.get(i) is None:
                self._released.add(i)  # a miss being delivered, or a read still retrying
                return
        self._settle(i, False)

    def _settle(self, i: int, ok: bool) -> None:
        with self._lock:
            self._hits[i] = ok
            self._left -= 1
            finished = self._left == 0
        if finished:
            self._done(self._hits)
