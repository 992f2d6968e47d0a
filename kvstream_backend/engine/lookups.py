"""Pins and lookup-time reads, held for their owners: the one place their lifetime is kept.

An *owner* is whatever names a lookup in the calling system: LMCache's lookup id in async mode,
``""`` for LMCache's sync path (whose unpins name only keys), ``"l2"`` for the multi-process
server's locks. A lookup pins each chunk it finds for its owner (one pin per lookup) and may
attach the chunk's lookup-time read; a get *takes* that read; ``release`` drops pins (one per
key, or all of an owner's) and any read not taken; anything a lookup held longer than its
time-to-live is released as if its owner had asked (LMCache never unpins plugins in async mode,
and an aborted request's lookup may never be followed by a get).

Thread-safe: every method takes the table's lock, and calls no engine method while holding it;
handles to give up are returned, for the caller to discard outside the lock.
"""

from __future__ import annotations

import collections
import math
from collections.abc import Iterable
from threading import Lock

from ..handles import ReadHandle

Owner = str


class _Held:
    """What one owner holds of one chunk."""

    __slots__ = ("pins", "handle", "deadline")

    def __init__(self, deadline: float) -> None:
        self.pins = 0
        self.handle: ReadHandle | None = None
        self.deadline = deadline


class Lookups:
    def __init__(self) -> None:
        self._lock = Lock()
        self._pins: collections.Counter[bytes] = collections.Counter()
        # (owner, digest) -> held, in deadline order (one time-to-live per owner kind, and a
        # refreshed entry moves to the end); entries that never expire sit apart
        self._held: collections.OrderedDict[tuple[Owner, bytes], _Held] = (
            collections.OrderedDict())
        self._forever: dict[tuple[Owner, bytes], _Held] = {}
        self._by_owner: dict[Owner, set[bytes]] = collections.defaultdict(set)

    def pin(self, owner: Owner, digest: bytes, deadline: float) -> None:
        """One more pin of ``digest`` for ``owner`` (``deadline`` inf: until released)."""
        k = (owner, digest)
        with self._lock:
            table = self._forever if math.isinf(deadline) else self._held
            held = table.get(k)
            if held is None:
                held = table[k] = _Held(deadline)
                self._by_owner[owner].add(digest)
            elif table is self._held:
                held.deadline = deadline
                self._held.move_to_end(k)
            held.pins += 1
            self._pins[digest] += 1

    def attach(self, owner: Owner, digest: bytes, handle: ReadHandle) -> bool:
        """Hold ``handle`` as ``owner``'s lookup-time read of ``digest`` (pinned by it); False
        (nothing held) if the owner holds a read of it already or no longer pins it."""
        with self._lock:
            held = self._entry(owner, digest)
            if held is None or held.handle is not None:
                return False
            held.handle = handle
            return True

    def holds_read(self, owner: Owner, digest: bytes) -> bool:
        with self._lock:
            held = self._entry(owner, digest)
            return held is not None and held.handle is not None

    def take(self, owner: Owner, digest: bytes) -> ReadHandle | None:
        """Hand ``owner``'s lookup-time read of ``digest`` to a get (the pin stays)."""
        with self._lock:
            held = self._entry(owner, digest)
            if held is None:
                return None
            h, held.handle = held.handle, None
            return h

    def release(self, owner: Owner,
                digests: Iterable[bytes] | None = None) -> tuple[int, list[ReadHandle]]:
        """Drop one pin per digest (all of the owner's pins if None), and with a key's last pin
        its read not taken; returns the pins dropped and those reads, for the caller to
        discard."""
        out: list[ReadHandle] = []
        n = 0
        with self._lock:
            if digests is None:
                for d in list(self._by_owner.get(owner, ())):
                    n += self._drop(owner, d, None, out)
            else:
                for d in digests:
                    n += self._drop(owner, d, 1, out)
        return n, out

    def drop_reads(self, digest: bytes) -> list[ReadHandle]:
        """Every owner's untaken read of ``digest`` (the chunk was removed); pins stay."""
        out = []
        with self._lock:
            for owner in list(self._by_owner):
                held = self._entry(owner, digest)
                if held is not None and held.handle is not None:
                    out.append(held.handle)
                    held.handle = None
        return out

    def expire(self, now: float) -> list[ReadHandle]:
        """Release everything held past its deadline; returns the reads to discard."""
        out: list[ReadHandle] = []
        with self._lock:
            while self._held:
                (owner, d), held = next(iter(self._held.items()))
                if held.deadline > now:
                    break
                self._drop(owner, d, None, out)
        return out

    def clear(self) -> list[ReadHandle]:
        """Release everything (closing); returns the reads not taken, to discard."""
        with self._lock:
            out = [h.handle for h in [*self._held.values(), *self._forever.values()]
                   if h.handle is not None]
            self._held.clear()
            self._forever.clear()
            self._by_owner.clear()
            self._pins.clear()
        return out

    def next_deadline(self) -> float | None:
        with self._lock:
            return next(iter(self._held.values())).deadline if self._held else None

    def pinned(self, digest: bytes) -> bool:
        with self._lock:
            return self._pins.get(digest, 0) > 0

    def __len__(self) -> int:
        """Chunks pinned now (for leak checks)."""
        with self._lock:
            return len(self._pins)

    def _entry(self, owner: Owner, digest: bytes) -> _Held | None:
        k = (owner, digest)
        return self._held.get(k) or self._forever.get(k)

    def _drop(self, owner: Owner, digest: bytes, n: int | None, out: list[ReadHandle]) -> int:
        k = (owner, digest)
        table = self._held if k in self._held else self._forever
        held = table.get(k)
        if held is None:
            return 0
        n = held.pins if n is None else min(n, held.pins)
        held.pins -= n
        left = self._pins[digest] - n
        if left > 0:
            self._pins[digest] = left
        else:
            del self._pins[digest]
        if held.pins:
            return n
        del table[k]
        mine = self._by_owner[owner]
        mine.discard(digest)
        if not mine:
            del self._by_owner[owner]
        if held.handle is not None:
            out.append(held.handle)
        return n
