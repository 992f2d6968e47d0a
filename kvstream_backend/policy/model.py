"""The KVStream performance model (paper Eq. 3-6) and a fake-clock simulator of one step.

Pure functions and a discrete-event simulation: no I/O, no threads. Bandwidths are bytes per
second (or any consistent unit); a *bandwidth function* maps simulated time to bandwidth, which
is how tests and ``kvstream sim`` express drifting tiers.
"""

from __future__ import annotations

import heapq
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from .routing import ClaimRouter

BandwidthFn = Callable[[float], float]
Bandwidth = BandwidthFn | float  # a constant, or a function of simulated time


def phi(bws: Sequence[float]) -> float:
    """The first tier's share of the aggregate bandwidth."""
    return bws[0] / sum(bws)


def bound_s(demand: float, bws: Sequence[float]) -> float:
    """Eq. 3: the aggregate-bandwidth bound T = D / sum(b_k)."""
    return demand / sum(bws)


def static_s(demand: float, split: Sequence[float], bws: Sequence[float]) -> float:
    """Eq. 5: a static split (fraction ``split[k]`` read from tier k) ends with its slowest tier."""
    return max(g * demand / b for g, b in zip(split, bws, strict=True) if g > 0)


def penalty(g: float, bws: Sequence[float]) -> float:
    """Eq. 6 for two tiers: static time over the bound = max(g/phi, (1-g)/(1-phi))."""
    p = phi(bws)
    return max(g / p if g else 0.0, (1 - g) / (1 - p) if g < 1 else 0.0)


def bound_time(demand: float, bw_fns: Sequence[BandwidthFn], dt: float = 1e-4) -> float:
    """The bound for time-varying bandwidths: the T with integral_0^T sum_k b_k(t) dt = D."""
    t, moved = 0.0, 0.0
    while moved < demand:
        rate = sum(f(t) for f in bw_fns)
        step = min(dt, (demand - moved) / rate)
        moved += rate * step
        t += step
    return t


def _read_time(start: float, nbytes: float, bw: Bandwidth) -> float:
    """Time to read ``nbytes`` starting at ``start`` with bandwidth evaluated along the way."""
    if not callable(bw):
        return nbytes / bw
    t, left = start, nbytes
    while left > 0:
        b = bw(t)
        slice_t = min(1e-3, left / b)
        left -= b * slice_t
        t += slice_t
    return t - start


@dataclass
class StepSim:
    """What one simulated step did: its time, when each tier went idle, what each tier read."""

    time_s: float
    tier_finish_s: list[float]
    tier_chunks: list[int]
    hedged_chunks: list[int] = field(default_factory=list)


def simulate_routed(
    n_chunks: int,
    chunk_bytes: float,
    bw_fns: Sequence[Bandwidth],
    m: int,
    *,
    hedge: bool = True,
    holders: Sequence[Sequence[int]] | None = None,
) -> StepSim:
    """Drive a real :class:`ClaimRouter`; tiers read their claims serially at ``bw_fns``."""
    k = len(bw_fns)
    router = ClaimRouter(k, m, hedge=hedge, window=m)  # a claim is read before the next
    for i in range(n_chunks):
        router.add(holders[i] if holders is not None else range(k))
    queue: list[list[int]] = [[] for _ in range(k)]  # chunks of the current claim, in order
    events: list[tuple[float, int, int]] = []  # (finish time, tier, chunk)
    reading = [False] * k
    finish = [0.0] * k
    won = [0] * k
    step_time = 0.0

    def start_next(tier: int, now: float) -> None:
        if not queue[tier]:
            queue[tier] = router.claim(tier, now)
        reading[tier] = bool(queue[tier])
        if queue[tier]:
            i = queue[tier].pop(0)
            heapq.heappush(events, (now + _read_time(now, chunk_bytes, bw_fns[tier]), tier, i))

    for tier in range(k):
        start_next(tier, 0.0)
    while events:
        now, tier, i = heapq.heappop(events)
        reading[tier] = False
        if router.complete(tier, i, now):
            won[tier] += 1
            finish[tier] = now
            if not router.unresolved:
                step_time = now
        for t in range(k):
            if not reading[t]:
                start_next(t, now)
    return StepSim(step_time, finish, won, list(router.hedged))


def simulate_static(
    n_chunks: int, chunk_bytes: float, bw_fns: Sequence[Bandwidth], split: Sequence[float]
) -> StepSim:
    """A static split by position: the first ``round(split[0]*n)`` chunks from tier 0, etc."""
    counts = [round(g * n_chunks) for g in split[:-1]]
    counts.append(n_chunks - sum(counts))
    finish = []
    for tier, c in enumerate(counts):
        t = 0.0
        for _ in range(c):
            t += _read_time(t, chunk_bytes, bw_fns[tier])
        finish.append(t)
    return StepSim(max(finish), finish, counts)
