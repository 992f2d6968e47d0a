"""Completion-driven meet-in-the-middle routing (KVStream M4), demand first. Pure policy: no
I/O, no clock, no threads.

Chunks are of two kinds:

* **demanded**: a get waits for it. The demanded chunks of a step form the *pool*, an ordered
  list that tiers claim from opposite ends (even tiers from the front, odd tiers from the back);
* **prefetch**: a lookup expects a get to follow. A tier reads prefetches only when it has
  nothing demanded to claim or hedge, oldest first. :meth:`promote` moves a prefetch into the
  pool (at the back) the moment a get asks for it; :meth:`cancel` drops it, unread if no tier
  had claimed it.

Call protocol (one driver thread):

1. ``add(holders, demand)`` registers a chunk and returns its id; ``holders`` are the tiers
   that have a copy. Chunks may join at any time, also while reads are in flight.
2. Whenever a read of a tier ends, and when chunks join, the driver calls ``claim(tier,
   prefetch)``: with at most ``depth - 1`` claims' worth of reads still in flight, the tier
   takes up to ``m`` chunks: unclaimed demanded chunks it holds from *its* end of the pool;
   else, if ``prefetch`` allows, the oldest unclaimed prefetches it holds, leaving the last
   claim slot free for demanded work; else, with nothing in flight, hedges (demanded chunks in
   flight on other tiers: at most one in-flight window, ``m * depth``, per tier per step).
   Reading ahead comes before hedging: a duplicate read only pays at the end of known work.
3. Each read ends in ``complete(tier, i)`` (True for the first copy of chunk ``i``: the winner),
   ``fail(tier, i)`` (the tier loses chunk ``i``; True when no tier can deliver it any more) or
   ``abandon(tier, i)`` (a claim given up before it was issued, e.g. no buffer).
4. ``drop_tier(tier)`` removes a tier that went down.
5. When :meth:`step_done` (no demanded chunk unresolved), ``end_step()`` forgets the step's
   chunks and resets the hedge budgets; the next demanded chunk opens the next step.

Invariants: a tier only reads chunks it holds; no tier has room while an unclaimed demanded
chunk it holds remains (work conservation); a chunk is delivered at most once; hedges per
tier per step <= m * depth; a prefetch never delays a demanded chunk's claim; the state held
is bounded by the open step's chunks plus the prefetches not yet promoted or cancelled.
"""

from __future__ import annotations

import collections
from collections.abc import Iterable

UNCLAIMED, INFLIGHT, DONE, DEAD = 0, 1, 2, 3


class _Chunk:
    __slots__ = ("holders", "state", "readers", "demand", "pos", "step", "cancelled")

    def __init__(self, holders: set[int], demand: bool, step: int) -> None:
        self.holders = holders
        self.state = UNCLAIMED if holders else DEAD
        self.readers: set[int] = set()
        self.demand = demand
        self.pos = -1  # absolute position in the step's pool (demanded chunks only)
        self.step = step
        self.cancelled = False


class ClaimRouter:
    """Meet-in-the-middle claims over a demand pool, prefetches behind it (see module doc)."""

    def __init__(self, n_tiers: int, m: int, hedge: bool = True, depth: int = 1) -> None:
        if n_tiers < 1 or m < 1 or depth < 1:
            raise ValueError("need at least one tier, m >= 1 and depth >= 1")
        self.n_tiers = n_tiers
        self.m = m
        self.hedge = hedge
        self.depth = depth
        self._step = 0
        self.reset()

    def reset(self) -> None:
        """Forget everything (chunks, claims, budgets)."""
        self._chunks: dict[int, _Chunk] = {}
        self._next = 0
        self._outstanding = [0] * self.n_tiers
        # unclaimed prefetches, oldest first
        self._prefetch: collections.OrderedDict[int, None] = collections.OrderedDict()
        self._new_pool()

    def _new_pool(self) -> None:
        self._pool: list[int] = []  # the step's demanded chunk ids, in order
        self._base = 0  # absolute position of _pool[0]
        self._lo = 0  # no unclaimed demanded chunk before absolute position _lo
        self._hi = -1  # ... nor after _hi
        self._unclaimed = 0  # demanded, unclaimed
        self._unresolved = 0  # demanded, neither delivered nor dead
        self._inflight: dict[int, None] = {}  # demanded chunks in flight (hedge candidates)
        self.hedged = [0] * self.n_tiers

    # ---- registration ---------------------------------------------------------------------
    def add(self, holders: Iterable[int], demand: bool = True) -> int:
        i = self._next
        self._next += 1
        c = _Chunk(set(holders), demand, self._step)
        self._chunks[i] = c
        if c.state == UNCLAIMED:
            if demand:
                self._unresolved += 1
                self._enqueue(i, c)
            else:
                self._prefetch[i] = None
        return i

    def _enqueue(self, i: int, c: _Chunk) -> None:
        c.pos = self._base + len(self._pool)
        self._pool.append(i)
        self._unclaimed += 1
        self._hi = c.pos

    def promote(self, i: int) -> None:
        """A get now waits for prefetch ``i``: it joins the step's pool (at the back)."""
        c = self._chunks.get(i)
        if c is None or c.demand:
            return
        c.demand, c.step = True, self._step
        if c.state == UNCLAIMED:
            del self._prefetch[i]
            self._unresolved += 1
            self._enqueue(i, c)
        elif c.state == INFLIGHT:
            self._unresolved += 1
            self._inflight[i] = None
        else:
            del self._chunks[i]  # already delivered or dead: the driver has its outcome

    def cancel(self, i: int) -> bool:
        """Nobody waits for chunk ``i`` any more; True if it was never claimed (nothing read)."""
        c = self._chunks.get(i)
        if c is None or c.cancelled:
            return False
        c.cancelled = True
        if c.state == UNCLAIMED:
            if c.demand:
                self._unclaimed -= 1
                self._unresolved -= 1
            else:
                del self._prefetch[i]
            c.state = DEAD
            self._forget(i, c)
            return True
        if c.state != INFLIGHT:
            self._forget(i, c)
        return False

    def __len__(self) -> int:
        """Chunks the router holds state for (bounded: see the module doc)."""
        return len(self._chunks)

    def state(self, i: int) -> int:
        """The state of a chunk the router still holds (KeyError once forgotten)."""
        return self._chunks[i].state

    def outstanding(self, tier: int) -> int:
        return self._outstanding[tier]

    @property
    def unresolved(self) -> int:
        """Demanded chunks neither delivered nor dead."""
        return self._unresolved

    @property
    def prefetch_pending(self) -> int:
        """Prefetches registered and not claimed yet."""
        return len(self._prefetch)

    def busy(self) -> bool:
        """True while a demanded chunk is unresolved or any read is in flight."""
        return self._unresolved > 0 or any(self._outstanding)

    def step_done(self) -> bool:
        return self._unresolved == 0

    def has_room(self, tier: int) -> bool:
        return self._outstanding[tier] <= (self.depth - 1) * self.m

    def _prefetch_room(self, tier: int) -> bool:
        """Prefetches never take a tier's last claim slot: a get arriving while they are in
        flight can start its reads on every tier at once."""
        return self._outstanding[tier] + self.m <= max(1, self.depth - 1) * self.m

    # ---- claiming -------------------------------------------------------------------------
    def _unclaimed_order(self, tier: int) -> Iterable[int]:
        pool, base = self._pool, self._base
        while self._lo <= self._hi and self._state_at(pool[self._lo - base]) != UNCLAIMED:
            self._lo += 1
        while self._hi >= self._lo and self._state_at(pool[self._hi - base]) != UNCLAIMED:
            self._hi -= 1
        if self._lo - base > 4096 and self._lo - base > len(pool) // 2:
            self._compact()
        lo, hi = self._lo - self._base, self._hi - self._base
        return (pool[j] for j in (range(lo, hi + 1) if tier % 2 == 0 else range(hi, lo - 1, -1)))

    def _state_at(self, i: int) -> int:
        c = self._chunks.get(i)
        return DEAD if c is None else c.state

    def _compact(self) -> None:
        """Drop the pool's claimed prefix (an endless step stays bounded)."""
        cut = self._lo - self._base
        for i in self._pool[:cut]:
            c = self._chunks.get(i)
            if c is not None and c.state in (DONE, DEAD) and not c.readers:
                del self._chunks[i]
        del self._pool[:cut]
        self._base = self._lo

    def claim(self, tier: int, prefetch: bool = True) -> list[int]:
        """The chunks ``tier`` should read next (empty if it has no room or nothing to read)."""
        if not self.has_room(tier):
            return []
        picks: list[int] = []
        if self._unclaimed:
            for i in self._unclaimed_order(tier):
                c = self._chunks.get(i)
                if c is not None and c.state == UNCLAIMED and tier in c.holders:
                    picks.append(i)
                    if len(picks) == self.m:
                        break
            self._unclaimed -= len(picks)
        if not picks and prefetch and self._prefetch and self._prefetch_room(tier):
            for i in self._prefetch:
                if tier in self._chunks[i].holders:
                    picks.append(i)
                    if len(picks) == self.m:
                        break
            for i in picks:
                del self._prefetch[i]
        if not picks and self.hedge and not self._outstanding[tier] and self._inflight:
            budget = self.m * self.depth - self.hedged[tier]
            order = list(self._inflight) if tier % 2 == 0 else reversed(list(self._inflight))
            for i in order if budget > 0 else ():
                c = self._chunks[i]
                if tier in c.holders and tier not in c.readers:
                    picks.append(i)
                    if len(picks) == budget:
                        break
            self.hedged[tier] += len(picks)
        for i in picks:
            c = self._chunks[i]
            c.state = INFLIGHT
            c.readers.add(tier)
            if c.demand:
                self._inflight[i] = None
        self._outstanding[tier] += len(picks)
        return picks

    # ---- completion -----------------------------------------------------------------------
    def complete(self, tier: int, i: int) -> bool:
        """``tier`` finished reading chunk ``i``; True if this copy is the one delivered."""
        self._outstanding[tier] -= 1
        c = self._chunks.get(i)
        if c is None:
            return False
        c.readers.discard(tier)
        won = c.state == INFLIGHT and not c.cancelled
        if c.state == INFLIGHT:
            c.state = DONE
            self._inflight.pop(i, None)
            if c.demand:
                self._unresolved -= 1
        self._forget(i, c)
        return won

    def fail(self, tier: int, i: int) -> bool:
        """``tier`` could not deliver chunk ``i``; True if the chunk is now dead (a miss)."""
        self._outstanding[tier] -= 1
        c = self._chunks.get(i)
        if c is None:
            return False
        c.readers.discard(tier)
        c.holders.discard(tier)
        return self._settle(i, c)

    def abandon(self, tier: int, i: int) -> bool:
        """``tier`` gives up chunk ``i`` before reading it; True if the chunk is now dead."""
        self._outstanding[tier] -= 1
        c = self._chunks.get(i)
        if c is None:
            return False
        c.readers.discard(tier)
        return self._settle(i, c)

    def _settle(self, i: int, c: _Chunk) -> bool:
        if c.state != INFLIGHT or c.readers:
            self._forget(i, c)
            return False
        self._inflight.pop(i, None)
        if c.holders and not c.cancelled:
            c.state = UNCLAIMED
            if not c.demand:
                self._prefetch[i] = None
                self._prefetch.move_to_end(i, last=False)  # given back: keep its turn
            elif c.step == self._step:
                self._unclaimed += 1
                self._lo, self._hi = min(self._lo, c.pos), max(self._hi, c.pos)
            else:  # a demanded chunk of a closed step cannot be unresolved; defensive
                self._enqueue(i, c)
            return False
        c.state = DEAD
        if c.demand:
            self._unresolved -= 1
        self._forget(i, c)
        return not c.cancelled

    def drop_tier(self, tier: int) -> list[int]:
        """Forget ``tier`` as a holder of every chunk; return the chunks that became dead.

        Reads the tier still has in flight end later through ``complete``/``fail``.
        """
        dead: list[int] = []
        for i, c in list(self._chunks.items()):
            if tier not in c.holders:
                continue
            c.holders.discard(tier)
            if c.state == UNCLAIMED and not c.holders:
                c.state = DEAD
                if c.demand:
                    self._unclaimed -= 1
                    self._unresolved -= 1
                else:
                    del self._prefetch[i]
                dead.append(i)
                self._forget(i, c)
        return dead

    # ---- steps ----------------------------------------------------------------------------
    def end_step(self) -> None:
        """Close the step (precondition: :meth:`step_done`): forget its settled chunks."""
        for i in self._pool:
            c = self._chunks.get(i)
            if c is not None and c.demand and c.state in (DONE, DEAD) and not c.readers:
                del self._chunks[i]
        self._step += 1  # hedge losers still reading are forgotten when their reads end
        self._new_pool()

    def _forget(self, i: int, c: _Chunk) -> None:
        """Drop a settled chunk nobody will ask about: of a closed step, or cancelled."""
        if c.readers or c.state in (UNCLAIMED, INFLIGHT):
            return
        if c.cancelled or (c.demand and c.step < self._step):
            self._chunks.pop(i, None)


class StaticSplitRouter(ClaimRouter):
    """The baseline KVStream improves on: a fixed split ``g`` by position, no adaptation.

    The k-th chunk added goes to tier 0 while tier 0 holds less than ``g`` of the chunks added
    so far, otherwise to tier 1 (so any prefix of the pool is split g : 1-g); each tier reads
    only its own chunks, ``m`` at a time, and never hedges. Same protocol as
    :class:`ClaimRouter`; used by ``kvstream bench`` to measure Eq. 6's penalty.
    """

    def __init__(self, n_tiers: int, m: int, split: float, depth: int = 1) -> None:
        if n_tiers != 2:
            raise ValueError("a static split needs exactly two tiers")
        self.split = split
        self._added = 0
        self._to_first = 0
        super().__init__(n_tiers, m, hedge=False, depth=depth)

    def add(self, holders: Iterable[int], demand: bool = True) -> int:
        h = set(holders)
        self._added += 1
        first = self._to_first < self.split * self._added
        self._to_first += first
        want = 0 if first else 1
        return super().add({want} if want in h else h, demand)
