"""Completion-driven meet-in-the-middle routing (KVStream M4). Pure policy: no I/O, no clock.

Call protocol (one driver thread):

1. ``add(holders)`` appends a chunk to the pool and returns its index; ``holders`` are the tiers
   that have a copy. Chunks may join at any time, also while reads are in flight.
2. Whenever a tier has no claim outstanding, the driver calls ``claim(tier)``: the tier takes
   the next ``m`` unclaimed chunks it holds from *its* end of the pool (even tiers from the
   front, odd tiers from the back). With nothing left to claim, it may hedge: re-read up to
   ``m`` chunks per step that are in flight on other tiers.
3. Each read ends in ``complete(tier, i)`` (True for the first copy of chunk ``i``: the winner),
   ``fail(tier, i)`` (the tier loses chunk ``i``; True when no tier can deliver it any more) or
   ``abandon(tier, i)`` (a hedge given up before it was issued).
4. ``drop_tier(tier)`` removes a tier that went down; ``resolved()`` says every chunk is done
   or dead and nothing is in flight; ``reset()`` starts the next step.

Invariants: a tier only reads chunks it holds; no tier is idle while an unclaimed chunk it holds
remains (work conservation); a chunk is delivered at most once; hedges per tier per step <= m.
"""

from __future__ import annotations

from collections.abc import Iterable

UNCLAIMED, INFLIGHT, DONE, DEAD = 0, 1, 2, 3


class ClaimRouter:
    def __init__(self, n_tiers: int, m: int, hedge: bool = True) -> None:
        if n_tiers < 1 or m < 1:
            raise ValueError("need at least one tier and m >= 1")
        self.n_tiers = n_tiers
        self.m = m
        self.hedge = hedge
        self.reset()

    def reset(self) -> None:
        self._holders: list[set[int]] = []
        self._state: list[int] = []
        self._readers: list[set[int]] = []
        self._outstanding = [0] * self.n_tiers
        self.hedged = [0] * self.n_tiers
        self._unresolved = 0
        self._unclaimed = 0
        self._lo = 0  # no UNCLAIMED chunk below _lo
        self._hi = -1  # no UNCLAIMED chunk above _hi

    # ---- pool -----------------------------------------------------------------------------
    def add(self, holders: Iterable[int]) -> int:
        h = set(holders)
        self._holders.append(h)
        self._readers.append(set())
        i = len(self._state)
        if h:
            self._state.append(UNCLAIMED)
            self._unresolved += 1
            self._unclaimed += 1
            self._hi = i
        else:
            self._state.append(DEAD)
        return i

    def __len__(self) -> int:
        return len(self._state)

    def state(self, i: int) -> int:
        return self._state[i]

    def outstanding(self, tier: int) -> int:
        return self._outstanding[tier]

    @property
    def unresolved(self) -> int:
        """Chunks neither delivered nor dead."""
        return self._unresolved

    def busy(self) -> bool:
        """True while any chunk is unresolved or any read is in flight."""
        return self._unresolved > 0 or any(self._outstanding)

    def resolved(self) -> bool:
        return not self.busy()

    # ---- claiming -------------------------------------------------------------------------
    def _order(self, tier: int) -> range:
        n = len(self._state)
        return range(n) if tier % 2 == 0 else range(n - 1, -1, -1)

    def _unclaimed_order(self, tier: int) -> range:
        while self._lo <= self._hi and self._state[self._lo] != UNCLAIMED:
            self._lo += 1
        while self._hi >= self._lo and self._state[self._hi] != UNCLAIMED:
            self._hi -= 1
        if tier % 2 == 0:
            return range(self._lo, self._hi + 1)
        return range(self._hi, self._lo - 1, -1)

    def claim(self, tier: int) -> list[int]:
        """The chunks ``tier`` should read next (empty if it has a claim outstanding)."""
        if self._outstanding[tier]:
            return []
        picks: list[int] = []
        if self._unclaimed:
            for i in self._unclaimed_order(tier):
                if self._state[i] == UNCLAIMED and tier in self._holders[i]:
                    picks.append(i)
                    if len(picks) == self.m:
                        break
        if picks:
            self._unclaimed -= len(picks)
        elif self.hedge and self.hedged[tier] < self.m:
            budget = self.m - self.hedged[tier]
            for i in self._order(tier):
                if (
                    self._state[i] == INFLIGHT
                    and tier in self._holders[i]
                    and tier not in self._readers[i]
                ):
                    picks.append(i)
                    if len(picks) == budget:
                        break
            self.hedged[tier] += len(picks)
        for i in picks:
            self._state[i] = INFLIGHT
            self._readers[i].add(tier)
        self._outstanding[tier] += len(picks)
        return picks

    # ---- completion -----------------------------------------------------------------------
    def complete(self, tier: int, i: int) -> bool:
        """``tier`` finished reading chunk ``i``; True if this copy is the one delivered."""
        self._outstanding[tier] -= 1
        self._readers[i].discard(tier)
        if self._state[i] == INFLIGHT:
            self._state[i] = DONE
            self._unresolved -= 1
            return True
        return False

    def fail(self, tier: int, i: int) -> bool:
        """``tier`` could not deliver chunk ``i``; True if the chunk is now dead (a miss)."""
        self._outstanding[tier] -= 1
        self._readers[i].discard(tier)
        self._holders[i].discard(tier)
        return self._settle(i)

    def abandon(self, tier: int, i: int) -> None:
        """``tier`` gives up a hedge on chunk ``i`` before reading it (e.g. no buffer)."""
        self._outstanding[tier] -= 1
        self._readers[i].discard(tier)
        self._settle(i)

    def _settle(self, i: int) -> bool:
        if self._state[i] != INFLIGHT or self._readers[i]:
            return False
        if self._holders[i]:
            self._state[i] = UNCLAIMED
            self._unclaimed += 1
            self._lo, self._hi = min(self._lo, i), max(self._hi, i)
            return False
        self._state[i] = DEAD
        self._unresolved -= 1
        return True

    def drop_tier(self, tier: int) -> list[int]:
        """Forget ``tier`` as a holder of every chunk; return the chunks that became dead.

        Reads the tier still has in flight end later through ``complete``/``fail``.
        """
        dead: list[int] = []
        for i, h in enumerate(self._holders):
            if tier in h:
                h.discard(tier)
                if self._state[i] == UNCLAIMED and not h:
                    self._state[i] = DEAD
                    self._unclaimed -= 1
                    self._unresolved -= 1
                    dead.append(i)
        return dead


class StaticSplitRouter(ClaimRouter):
    """The baseline KVStream improves on: a fixed split ``g`` by position, no adaptation.

    The k-th chunk added in a step goes to tier 0 while tier 0 holds less than ``g`` of the
    chunks added so far, otherwise to tier 1 (so any prefix of the pool is split g : 1-g);
    each tier reads only its own chunks, ``m`` at a time, and never hedges. Same protocol as
    :class:`ClaimRouter`; used by ``kvstream bench`` to measure Eq. 6's penalty.
    """

    def __init__(self, n_tiers: int, m: int, split: float) -> None:
        if n_tiers != 2:
            raise ValueError("a static split needs exactly two tiers")
        self.split = split
        super().__init__(n_tiers, m, hedge=False)

    def reset(self) -> None:
        super().reset()
        self._to_first = 0

    def add(self, holders: Iterable[int]) -> int:
        h = set(holders)
        first = self._to_first < self.split * (len(self._state) + 1)
        self._to_first += first
        want = 0 if first else 1
        return super().add({want} if want in h else h)
