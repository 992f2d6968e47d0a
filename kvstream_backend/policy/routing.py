"""Completion-driven meet-in-the-middle routing over step pools (KVStream M4). Pure policy: no
I/O, no threads; time is whatever the caller passes as ``now``.

**Pools.** A pool is one serving step's chunks in the order LMCache asks for them. Chunks found
by lookups (``add(..., lookup=True)``) join the *open* pool, in lookup order; the first get that
waits for one of them (``demand``) *seals* that pool: it is now the step being served, and later
lookups open the next pool. Chunks a get asks for without a lookup join the step being served
(the newest sealed pool). Tiers work on the oldest pool first; a later pool is read only by a
tier that has nothing left to claim or hedge in the earlier ones, so the next requests' lookups
never pull a tier away from the step being served, while reads still start at lookup time.

**Ends.** Within a pool, tiers claim from opposite ends: the tier measured fastest so far takes
the front (the first requests, whose gets come first), the next the back, and so on alternately;
before any measurement (or a seed, :meth:`ClaimRouter.seed`: an earlier process's) the
configuration order decides, and the ends swap as soon as the measurements disagree with it (so
the order tiers are listed in does not matter). A tier that
finishes a read claims again, up to ``m`` chunks at a time, so tiers meet wherever their
bandwidths put the meeting point, with no split computed in advance. A tier only claims chunks
it holds.

**The guard.** A tier claiming from the back takes a chunk only if it would deliver it (its
reads in flight and this one, at its measured rate) before the tiers claiming from the front
deliver it (their reads in flight and the chunks before it, at their summed rate); from the
back, the first chunk refused means every later one is too. A device shares its bandwidth among
the reads in flight, so the new read also delays the tier's earlier ones: the guard holds for
the one of them nearest the front, too. In an open pool the back is only the back so far:
without the guard the slow tier, claiming at the first request's lookup, read that request's
last chunks, which the later lookups put first in line for the gets (on an H200, disk at 1.5
GB/s beside /dev/shm at 35 GB/s, the first request of every step waited 30 ms longer than the
second for the disk's three chunks); with it but blind to the reads in flight, the disk took one
such chunk (18 ms at its rate, the front 27 ms away) and then more, each worth reading by itself,
and the first shared the disk with them: request 0 waited 90-125 ms, request 1 60-85 ms (an
H100, ``bench --gpu``, stop 35; modelled, ``router_shared.py --fast-servers 16``: 81 ms, and
22 ms once the reads in flight count). In a sealed pool a read the front delivers first
is waste: the cold step of a process with /dev/shm listed first ended 57 ms late on the disk's
last four reads (``docs/bench/tools/router_shared.py rev``: 179 ms, bound 118). The guard lets
a claim through before the rates it compares are measured, and ignores a front tier that is
*stalled* (its oldest read ``STALL`` times older than its reads in flight should take: a hung
mount), so chunks never wait on a tier that stopped delivering; a stalled tier's reads are
hedged as if it had never finished one. A driver that claims only on events claims again at
``next_stall(now)``.

**Windows.** A tier keeps at most ``window(tier)`` reads in flight. With ``window=None``
(auto) it follows Little's law: ``ceil(rate * target_s / chunk size) + 1``, where ``rate`` is
the tier's measured throughput (in-flight bytes over read latency at each completion), so a
fast device gets the depth it needs to reach its bandwidth and a slow one no more than it can
finish in about ``target_s`` (deep queues on a slow tier only make every one of its reads
late). The window stays within ``[min_window, max_window]``; before the tier's first completion
it is ``m`` at the front and one read at the back (a probe: on GlusterFS beside a disk that reads
10x faster, the four reads a fresh process's GlusterFS tier claimed at once were all re-read by
the disk). A tier whose claimed reads were beaten by a hedge ``LOSING`` times in a row reads one
chunk at a time until one of its reads is delivered: its reads only took device time.

**Hedges.** After its own claims in a pool, a tier with room re-reads chunks of that pool in
flight on other tiers, if it would deliver them sooner: its own reads queued ahead of the
hedge, at its measured rate, against the other tier's reads started before that chunk (and
half of it), at that tier's rate; the first copy to land wins. A hedge shares the tier's
bandwidth like a claim, so a tier claiming from the back hedges only while the guard holds for
its reads in flight.
At most ``max(m, the largest other window)`` hedges per tier per pool. Before its own claims, a
tier at the front first hedges, the same way, the reads another tier claimed from the front and
still has in flight after the ends swapped: a process's first step gives the front by the
configuration order, and when that tier proves slower, its first reads are what the first gets
wait for. These are outside the pool's budget and bounded by themselves: a chunk is claimed from
the front once, and only a swap of ends (rates that differ by ``RERANK``) makes it stale.

Call protocol (one driver thread): ``add`` registers a chunk and returns its id; ``claim(tier,
now)`` whenever a tier may have room (after completions and additions); each claimed read ends
in ``complete`` (True for the copy delivered), ``fail`` (the tier lost the chunk; True if no
tier can deliver it any more) or ``abandon`` (given up before it was issued). ``cancel`` drops a
chunk nobody waits for (unread if unclaimed); ``drop_tier`` forgets a tier that went down.

Invariants: a chunk is delivered at most once; a pool is forgotten once every chunk in it is
settled; the state held is bounded by the live pools' chunks plus reads still in flight.
"""

from __future__ import annotations

import collections
import math
from collections.abc import Iterable, Iterator

UNCLAIMED, INFLIGHT, DONE, DEAD = 0, 1, 2, 3
EWMA = 0.3  # weight of a new sample in a tier's rate and chunk-size estimates
COMPACT_AT = 4096  # a pool's claimed prefix is cut once longer than this (and half the pool)
RERANK = 1.25  # a tier takes a faster end once its rate exceeds its neighbour's by this factor
STALL = 4.0  # a tier whose oldest read is this many times late no longer holds the front
LOSING = 2  # claimed reads in a row delivered first by a hedge before a tier's window is one


class _Pool:
    """One step's chunk ids in arrival order, with the unclaimed span ``[lo, hi]``."""

    __slots__ = ("ids", "base", "lo", "hi", "unclaimed", "live", "sealed", "inflight",
                 "hedged")

    def __init__(self, n_tiers: int) -> None:
        self.ids: list[int] = []
        self.base = 0  # absolute position of ids[0]
        self.lo = 0  # no unclaimed chunk before absolute position lo ...
        self.hi = -1  # ... nor after hi
        self.unclaimed = 0
        self.live = 0  # chunks neither delivered, dead nor cancelled
        self.sealed = False
        self.inflight: dict[int, None] = {}  # live chunks being read (hedge candidates)
        self.hedged = [0] * n_tiers


class _Chunk:
    __slots__ = ("holders", "state", "readers", "pool", "pos", "size", "demanded", "cancelled",
                 "front", "claimer")

    def __init__(self, holders: set[int], size: int, pool: _Pool | None) -> None:
        self.holders = holders
        self.state = UNCLAIMED if holders else DEAD
        self.readers: set[int] = set()
        self.pool = pool
        self.pos = -1
        self.size = size
        self.demanded = False
        self.cancelled = False
        self.front = False  # claimed by a tier claiming from the front
        self.claimer = -1  # the tier that claimed it (its other readers hedge)


class ClaimRouter:
    """Meet-in-the-middle claims over step pools (see the module doc)."""

    def __init__(self, n_tiers: int, m: int, *, hedge: bool = True, window: int | None = None,
                 target_s: float = 0.05, min_window: int = 2, max_window: int = 64) -> None:
        if n_tiers < 1 or m < 1 or min_window < 1 or max_window < min_window:
            raise ValueError("need at least one tier, m >= 1 and 1 <= min_window <= max_window")
        if window is not None and window < 1:
            raise ValueError("window must be >= 1 (or None: sized to each tier)")
        self.n_tiers = n_tiers
        self.m = m
        self.hedge = hedge
        self.fixed_window = window
        self.target_s = target_s
        self.min_window = min_window
        self.max_window = max_window
        self.reset()

    def reset(self) -> None:
        """Forget every chunk, pool and measurement."""
        n = self.n_tiers
        self._chunks: dict[int, _Chunk] = {}
        self._pools: collections.deque[_Pool] = collections.deque()
        self._next = 0
        self._outstanding = [0] * n
        self._started: list[dict[int, tuple[float, float]]] = [{} for _ in range(n)]
        self._area = [0.0] * n  # integral of the tier's reads in flight over time
        self._area_at = [0.0] * n
        self._rate: list[float | None] = [None] * n  # bytes/s
        self._size: list[float | None] = [None] * n  # chunk size, bytes
        self._demanded = 0  # demanded chunks neither delivered nor dead
        self._lost = [0] * n  # per tier: its claimed reads in a row that a hedge beat
        self.hedged = [0] * n  # hedges issued, per tier (cumulative)
        self._rank = list(range(n))  # tiers by measured rate, fastest first
        self._front = [t % 2 == 0 for t in range(n)]  # per tier: claims from the front

    # ---- measurements ---------------------------------------------------------------------
    def window(self, tier: int) -> int:
        """Reads ``tier`` may keep in flight now (see the module doc)."""
        if self._lost[tier] >= LOSING:
            return 1
        if self.fixed_window is not None:
            return self.fixed_window
        rate, size = self._rate[tier], self._size[tier]
        if rate is None or not size:  # unmeasured: a probe from the back, m from the front
            return min(max(self.m, self.min_window), self.max_window) if self._front[tier] else 1
        want = math.ceil(rate * self.target_s / size) + 1
        return min(max(want, self.min_window), self.max_window)

    def seed(self, tier: int, rate: float, size: float) -> None:
        """Start ``tier``'s estimates from an earlier measurement (a previous process's), as if
        it had been measured: its end and window follow from it until its own completions
        refine it. Ignored once the tier has been measured."""
        if self._rate[tier] is None and rate > 0 and size > 0:
            self._rate[tier], self._size[tier] = rate, size
            self._rerank()

    def estimate(self, tier: int) -> tuple[float, float] | None:
        """``tier``'s measured read rate (bytes/s) and chunk size (bytes), if it has one."""
        rate, size = self._rate[tier], self._size[tier]
        return None if rate is None or size is None else (rate, size)

    def _advance(self, tier: int, now: float) -> None:
        """Integrate the tier's reads in flight up to ``now`` (before it changes)."""
        if now > self._area_at[tier]:
            self._area[tier] += self._outstanding[tier] * (now - self._area_at[tier])
            self._area_at[tier] = now

    def _measure(self, tier: int, i: int, size: int, now: float) -> None:
        start = self._started[tier].pop(i, None)
        if start is None or size <= 0:
            return
        t0, area0 = start
        lat = max(now - t0, 1e-9)
        # Little's law: throughput = reads in flight (averaged over this read's life) / latency
        rate = max(self._area[tier] - area0, lat) * size / lat ** 2
        old = self._rate[tier]
        self._rate[tier] = rate if old is None else old + EWMA * (rate - old)
        s = self._size[tier]
        self._size[tier] = size if s is None else s + EWMA * (size - s)
        self._rerank()

    def _rerank(self) -> None:
        """Keep the tiers ranked by measured rate (the fastest claims the front, the next the
        back, alternating); a neighbour is passed only when it is clearly faster, so ends do
        not flap between tiers of about the same speed."""
        rank = self._rank
        for j in range(1, len(rank)):
            a, b = self._rate[rank[j - 1]] or 0.0, self._rate[rank[j]] or 0.0
            if b > RERANK * a:
                rank[j - 1], rank[j] = rank[j], rank[j - 1]
                for k, t in enumerate(rank):
                    self._front[t] = k % 2 == 0

    # ---- registration ---------------------------------------------------------------------
    def add(self, holders: Iterable[int], size: int = 1, *, lookup: bool = False) -> int:
        """Register a chunk; ``lookup``: found by a lookup (joins the open pool), else a get
        waits for it (joins the step being served). Returns its id; a chunk no tier holds is
        born dead."""
        i = self._next
        self._next += 1
        c = _Chunk(set(holders), size, None)
        self._chunks[i] = c
        if c.state == DEAD:
            return i
        pool = self._open_pool() if lookup else self._serving_pool()
        c.pool, c.pos = pool, pool.base + len(pool.ids)
        pool.ids.append(i)
        pool.unclaimed += 1
        pool.live += 1
        pool.hi = c.pos
        if not lookup:
            c.demanded = True
            self._demanded += 1
        return i

    def _new_pool(self) -> _Pool:
        pool = _Pool(self.n_tiers)
        self._pools.append(pool)
        return pool

    def _open_pool(self) -> _Pool:
        if self._pools and not self._pools[-1].sealed:
            return self._pools[-1]
        return self._new_pool()

    def _serving_pool(self) -> _Pool:
        served = next((p for p in reversed(self._pools) if p.sealed), None)
        if served is not None:
            return served
        pool = self._open_pool()
        pool.sealed = True
        return pool

    def demand(self, i: int) -> None:
        """A get now waits for chunk ``i``: its pool, if still open, becomes the step served."""
        c = self._chunks.get(i)
        if c is None or c.demanded or c.cancelled:
            return
        c.demanded = True
        if c.state in (UNCLAIMED, INFLIGHT):
            self._demanded += 1
        if c.pool is not None:
            c.pool.sealed = True

    def cancel(self, i: int) -> bool:
        """Nobody waits for chunk ``i`` any more; True if it was never claimed (nothing read)."""
        c = self._chunks.get(i)
        if c is None or c.cancelled:
            return False
        c.cancelled = True
        if c.state == UNCLAIMED:
            assert c.pool is not None
            c.pool.unclaimed -= 1
            c.state = DEAD
            self._settled(i, c)
            self._forget(i, c)
            return True
        if c.state == INFLIGHT:
            self._settled(i, c)
        else:
            self._forget(i, c)
        return False

    def _settled(self, i: int, c: _Chunk) -> None:
        """Chunk ``i`` stops being live (delivered, dead or cancelled); called once per chunk."""
        if c.demanded:
            self._demanded -= 1
        pool = c.pool
        if pool is None:
            return
        pool.live -= 1
        pool.inflight.pop(i, None)
        if pool.live == 0 and pool.unclaimed == 0:
            self._pools.remove(pool)

    def _forget(self, i: int, c: _Chunk) -> None:
        if not c.readers and c.state != UNCLAIMED and (c.state != INFLIGHT or c.cancelled):
            self._chunks.pop(i, None)

    # ---- queries ---------------------------------------------------------------------------
    def __len__(self) -> int:
        """Chunks the router holds state for (bounded: see the module doc)."""
        return len(self._chunks)

    def state(self, i: int) -> int | None:
        """The state of chunk ``i``; None once settled and forgotten."""
        c = self._chunks.get(i)
        return None if c is None else c.state

    def outstanding(self, tier: int) -> int:
        return self._outstanding[tier]

    @property
    def unresolved(self) -> int:
        """Demanded chunks neither delivered nor dead."""
        return self._demanded

    @property
    def pools(self) -> int:
        """Live pools (the step served, the lookups of the next ones)."""
        return len(self._pools)

    def busy(self) -> bool:
        """True while a demanded chunk is unresolved or any read is in flight."""
        return self._demanded > 0 or any(self._outstanding)

    def step_done(self) -> bool:
        return self._demanded == 0

    def has_room(self, tier: int) -> bool:
        return self._outstanding[tier] < self.window(tier)

    # ---- claiming -------------------------------------------------------------------------
    def claim(self, tier: int, now: float = 0.0, *, ahead: bool = True) -> list[int]:
        """Up to ``m`` chunks ``tier`` should read next (fewer if its window is nearly full).
        ``ahead=False`` (memory is short) claims only chunks a get waits for."""
        room = min(self.m, self.window(tier) - self._outstanding[tier])
        picks: list[int] = []
        for pool in self._pools:  # (claiming never adds or removes a pool)
            if room <= 0:
                break
            if self.hedge and self._front[tier] and pool.inflight:
                room -= self._hedge(pool, tier, now, room, picks, stale_front=True)
                if room <= 0:
                    break
            for i in self._unclaimed(pool, tier, ahead):
                if not self._sooner(tier, i, len(picks), now):
                    break
                c = self._chunks[i]
                c.state = INFLIGHT
                c.front = self._front[tier]
                c.claimer = tier
                pool.unclaimed -= 1
                pool.inflight[i] = None
                picks.append(i)
                room -= 1
                if not room:
                    break
            if room > 0 and self.hedge:
                room -= self._hedge(pool, tier, now, room, picks)
        self._advance(tier, now)
        for i in picks:
            self._chunks[i].readers.add(tier)
            self._started[tier][i] = (now, self._area[tier])
        self._outstanding[tier] += len(picks)
        return picks

    def _unclaimed(self, pool: _Pool, tier: int, ahead: bool) -> Iterator[int]:
        """Unclaimed chunks of ``pool`` that ``tier`` holds, from its end."""
        if not pool.unclaimed:
            return
        ids, base = pool.ids, pool.base
        while pool.lo <= pool.hi and self._state(ids[pool.lo - base]) != UNCLAIMED:
            pool.lo += 1
        while pool.hi >= pool.lo and self._state(ids[pool.hi - base]) != UNCLAIMED:
            pool.hi -= 1
        if pool.lo - base > COMPACT_AT and pool.lo - base > len(ids) // 2:
            del ids[: pool.lo - base]  # an endless pool (a server's loads) stays bounded
            pool.base = base = pool.lo
        span = range(pool.lo - base, pool.hi - base + 1)
        for j in span if self._front[tier] else reversed(span):
            i = ids[j]
            c = self._chunks.get(i)
            if (c is not None and c.state == UNCLAIMED and tier in c.holders
                    and (ahead or c.demanded)):
                yield i

    def _sooner(self, tier: int, i: int, picked: int, now: float) -> bool:
        """Whether ``tier`` would deliver chunk ``i``, and still each chunk it is reading, before
        the tiers that claim from the front reach them (see :meth:`_in_time`)."""
        c = self._chunks[i]
        return c.pool is None or self._in_time(tier, self._outstanding[tier] + picked + 1, now, c)

    def _in_time(self, tier: int, reads: int, now: float, c: _Chunk | None = None) -> bool:
        """Whether ``tier``, with ``reads`` reads in flight (those it has and those it would
        add), delivers chunk ``c`` (if given) and every chunk only it is reading before the
        tiers claiming from the front would (see the module doc). True where it claims from the
        front, its rate is not measured yet or no front tier is measured and running.

        The front delivers a chunk after its reads in flight (the chunks just before ``lo``) and
        the unclaimed ones up to it; a chunk already behind ``lo``, after those of its reads that
        come before it. The tier's reads share its bandwidth, so a new read (a claim or a hedge)
        also delays every read it has in flight: the one nearest the front binds (in an open
        pool, a chunk claimed as the back moves forward as lookups add chunks after it). A read
        another tier also has in flight (a hedge) binds nothing, nor one the tier claimed from
        the front before the ends swapped: the front hedges those when it is sooner, and holding
        the back for them starved a cold process's step (GlusterFS listed first, 2 cores: 0.33 s
        against 0.31 over eight paired runs)."""
        rate = self._rate[tier]
        if self._front[tier] or not rate:
            return True
        fronts = [t for t in (c.holders if c is not None else range(self.n_tiers))
                  if self._front[t] and t != tier and not self._stalled(t, now)]
        front_rate = sum(self._rate[t] or 0.0 for t in fronts)
        if not front_rate:
            return True
        front_out = sum(self._outstanding[t] for t in fronts)
        ahead = math.inf if c is None or c.pool is None else front_out + c.pos - c.pool.lo + 1
        for j in self._started[tier]:
            d = self._chunks.get(j)
            if (d is not None and d.claimer == tier and d.state == INFLIGHT and not d.front
                    and len(d.readers) == 1 and d.pool is not None):
                ahead = min(ahead, max(front_out + d.pos - d.pool.lo + 1, 0))
        return reads / rate < ahead / front_rate

    def _stall_at(self, tier: int) -> float | None:
        """When ``tier`` is *stalled* unless a read completes first: its oldest read in flight
        then ``STALL`` times older than its reads in flight should take at its measured rate (a
        hung mount). None while it has no read in flight or no rate."""
        started, rate, size = self._started[tier], self._rate[tier], self._size[tier]
        if not started or not rate or not size:
            return None
        t0, _ = next(iter(started.values()))  # claim order: the oldest first
        return t0 + STALL * max(len(started) * size / rate, self.target_s)

    def _stalled(self, tier: int, now: float) -> bool:
        """Whether ``tier`` is stalled: it then guards nothing and its reads are hedged."""
        at = self._stall_at(tier)
        return at is not None and now > at

    def next_stall(self, now: float) -> float | None:
        """The earliest time after ``now`` at which a tier becomes stalled if none of its reads
        completes before: a driver that claims only on events claims again then."""
        ats = [a for t in range(self.n_tiers) if (a := self._stall_at(t)) is not None and a > now]
        return min(ats, default=None)

    def _state(self, i: int) -> int:
        c = self._chunks.get(i)
        return DEAD if c is None else c.state

    def _hedge(self, pool: _Pool, tier: int, now: float, room: int, picks: list[int], *,
               stale_front: bool = False) -> int:
        """Re-read, up to ``room``, chunks of ``pool`` in flight on other tiers that ``tier``
        would deliver sooner; returns how many it picked. ``stale_front``: only chunks claimed
        from the front by tiers that now claim from the back (outside the pool's budget)."""
        if stale_front:
            budget = room
        else:
            others = [self.window(t) for t in range(self.n_tiers) if t != tier]
            budget = min(room, max([self.m, *others]) - pool.hedged[tier])
        rate = self._rate[tier]
        if budget <= 0 or not rate or not pool.inflight:
            return 0
        n = 0
        queued = self._outstanding[tier] + len(picks)  # reads of ours ahead of a hedge
        # A chunk's size cancels out of ``mine < eta``: a read of tier ``o`` can be beaten only
        # if (queued + 1) / rate < (its place in o's reads + 0.5) / o's rate. When not even o's
        # newest read can, for every other tier, nothing can: skip the scan (the slow tier's
        # claims would otherwise walk the fast tier's whole window every time).
        if all((r := self._rate[o]) and (queued + 1) * r >= (len(self._started[o]) - 0.5) * rate
               and not self._stalled(o, now) for o in range(self.n_tiers) if o != tier):
            return 0
        if not self._in_time(tier, queued + 1, now):
            return 0  # (a back tier: one more read would make one of its own late)
        for i in list(pool.inflight):
            c = self._chunks[i]
            if tier in c.readers or tier not in c.holders or i in picks:
                continue
            if stale_front and (not c.front or any(self._front[o] for o in c.readers)):
                continue
            mine = now + (queued + 1) * c.size / rate  # Little's law: our queue, our rate
            if all(mine < self._eta(o, i, c.size, now) for o in c.readers):
                picks.append(i)
                queued += 1
                n += 1
                if n == budget or not self._in_time(tier, queued + 1, now):
                    break
        if not stale_front:
            pool.hedged[tier] += n
        self.hedged[tier] += n
        return n

    def _eta(self, tier: int, i: int, size: int, now: float) -> float:
        """When ``tier`` should deliver chunk ``i``: the reads it started before it, and half of
        this one, at its measured rate (inf before it finished any, or stalled: unknown)."""
        rate = self._rate[tier]
        if not rate or self._stalled(tier, now):
            return math.inf
        ahead = list(self._started[tier]).index(i)  # claim order: oldest first
        return now + (ahead + 0.5) * size / rate

    # ---- completion -----------------------------------------------------------------------
    def complete(self, tier: int, i: int, now: float = 0.0) -> bool:
        """``tier`` finished reading chunk ``i``; True if this copy is the one delivered."""
        c = self._chunks.get(i)
        self._advance(tier, now)
        self._measure(tier, i, c.size if c is not None else 0, now)
        self._outstanding[tier] -= 1
        if c is None:
            return False
        c.readers.discard(tier)
        won = c.state == INFLIGHT and not c.cancelled
        if won:
            c.state = DONE
            self._settled(i, c)
        if c.claimer == tier:
            self._lost[tier] = 0 if won else self._lost[tier] + (c.state == DONE)
        self._forget(i, c)
        return won

    def fail(self, tier: int, i: int) -> bool:
        """``tier`` could not deliver chunk ``i``; True if the chunk is now dead (a miss)."""
        self._started[tier].pop(i, None)
        self._outstanding[tier] -= 1  # (in flight until the last time the router was told)
        c = self._chunks.get(i)
        if c is None:
            return False
        c.readers.discard(tier)
        c.holders.discard(tier)
        return self._settle(i, c)

    def abandon(self, tier: int, i: int) -> bool:
        """``tier`` gives up chunk ``i`` before reading it; True if the chunk is now dead."""
        self._started[tier].pop(i, None)
        self._outstanding[tier] -= 1
        c = self._chunks.get(i)
        if c is None:
            return False
        c.readers.discard(tier)
        return self._settle(i, c)

    def _settle(self, i: int, c: _Chunk) -> bool:
        """A read of ``c`` ended without delivering it: give it back, or it is dead."""
        if c.state != INFLIGHT or c.readers or c.cancelled:
            self._forget(i, c)
            return False
        pool = c.pool
        assert pool is not None
        pool.inflight.pop(i, None)
        if c.holders:
            c.state = UNCLAIMED
            pool.unclaimed += 1
            if c.pos < pool.base:  # its place was compacted away: it goes to the back
                c.pos = pool.base + len(pool.ids)
                pool.ids.append(i)
            pool.lo, pool.hi = min(pool.lo, c.pos), max(pool.hi, c.pos)
            return False
        c.state = DEAD
        self._settled(i, c)
        self._forget(i, c)
        return True

    def drop_tier(self, tier: int) -> list[int]:
        """Forget ``tier`` as a holder of every chunk; return the chunks that became dead.

        Reads the tier still has in flight end later through ``complete``/``fail``.
        """
        dead: list[int] = []
        for i, c in list(self._chunks.items()):
            if tier not in c.holders:
                continue
            c.holders.discard(tier)
            if c.state == UNCLAIMED and not c.holders and not c.cancelled:
                assert c.pool is not None
                c.pool.unclaimed -= 1
                c.state = DEAD
                self._settled(i, c)
                dead.append(i)
                self._forget(i, c)
        return dead


class StaticSplitRouter(ClaimRouter):
    """The baseline KVStream improves on: a fixed split ``g`` by position, no adaptation.

    The k-th chunk added goes to tier 0 while tier 0 holds less than ``g`` of the chunks added
    so far, otherwise to tier 1 (so any prefix of the pool is split g : 1-g); each tier reads
    only its own chunks and never hedges. Same protocol as :class:`ClaimRouter`; used by
    ``kvstream bench`` to measure Eq. 6's penalty.
    """

    def __init__(self, n_tiers: int, m: int, split: float, *, window: int | None = None,
                 target_s: float = 0.05, max_window: int = 64) -> None:
        if n_tiers != 2:
            raise ValueError("a static split needs exactly two tiers")
        self.split = split
        self._added = 0
        self._to_first = 0
        super().__init__(n_tiers, m, hedge=False, window=window, target_s=target_s,
                         max_window=max_window)

    def add(self, holders: Iterable[int], size: int = 1, *, lookup: bool = False) -> int:
        h = set(holders)
        self._added += 1
        first = self._to_first < self.split * self._added
        self._to_first += first
        want = 0 if first else 1
        return super().add({want} if want in h else h, size, lookup=lookup)
