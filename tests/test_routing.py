"""The routing policy with fake tiers and a fake clock (kvstream_backend.model's simulator)."""

from __future__ import annotations

import math
import random

import pytest

from kvstream_backend import model
from kvstream_backend.routing import DONE, ClaimRouter


def const(b: float):
    return lambda t: b


@pytest.mark.parametrize("b0,b1", [(3, 1), (2, 1), (1, 1), (1, 3), (5, 0.3), (0.7, 0.69)])
@pytest.mark.parametrize("m", [1, 4, 8])
def test_meets_the_bound_within_one_claim(b0: float, b1: float, m: int) -> None:
    n, s = 400, 1.0
    sim = model.simulate_routed(n, s, [const(b0), const(b1)], m)
    bound = model.bound_s(n * s, [b0, b1])
    claim_time = m * s / min(b0, b1)
    assert bound - 1e-6 <= sim.time_s <= bound + claim_time
    assert sum(sim.tier_chunks) == n
    # tiers finish together: within one claim of each other
    assert abs(sim.tier_finish_s[0] - sim.tier_finish_s[1]) <= claim_time


@pytest.mark.parametrize("seed", range(5))
def test_meets_the_bound_when_bandwidths_drift(seed: int) -> None:
    rng = random.Random(seed)
    a, b = rng.uniform(0.5, 4), rng.uniform(0.3, 2)
    p, q = rng.uniform(5, 40), rng.uniform(5, 40)
    f0 = lambda t: a * (1 + 0.6 * math.sin(t / p))  # noqa: E731
    f1 = lambda t: b if (t // q) % 2 == 0 else b * 0.3  # noqa: E731
    n, m = 300, 4
    sim = model.simulate_routed(n, 1.0, [f0, f1], m)
    bound = model.bound_time(n, [f0, f1])
    worst_claim = m / min(a * 0.4, b * 0.3)
    assert sim.time_s <= bound + worst_claim
    assert sim.time_s >= bound * 0.999


@pytest.mark.parametrize("g,b0,b1", [(0.75, 3, 1), (0.75, 2, 1), (0.5, 3, 1), (0.9, 1, 1)])
def test_static_split_pays_eq6(g: float, b0: float, b1: float) -> None:
    n = 1000
    st = model.simulate_static(n, 1.0, [const(b0), const(b1)], [g, 1 - g])
    predicted = model.penalty(g, [b0, b1]) * model.bound_s(n, [b0, b1])
    assert st.time_s == pytest.approx(predicted, rel=1e-6)
    routed = model.simulate_routed(n, 1.0, [const(b0), const(b1)], 4)
    assert routed.time_s <= st.time_s + 4 / min(b0, b1)


def test_paper_worked_example() -> None:
    assert model.penalty(0.75, [3, 1]) == pytest.approx(1.0)
    assert model.penalty(0.75, [2, 1]) == pytest.approx(1.125)
    # with the second tier at 0.5 GB/s the 75:25 split is slower than the first tier alone
    assert model.static_s(1, [0.75, 0.25], [3, 0.5]) > model.static_s(1, [1.0], [3])


def test_work_conservation_and_holders() -> None:
    """No tier is idle while an unclaimed chunk it holds remains; tiers read only what they hold."""
    rng = random.Random(7)
    k, m = 3, 2
    r = ClaimRouter(k, m, hedge=False)
    held = []
    for _ in range(200):
        h = {t for t in range(k) if rng.random() < 0.6} or {rng.randrange(k)}
        held.append(h)
        r.add(h)
    inflight: list[tuple[int, int]] = []
    while r.busy():
        for t in range(k):
            for i in r.claim(t):
                assert t in held[i]
                inflight.append((t, i))
        for t in range(k):
            if r.outstanding(t) == 0:
                assert not any(
                    r.state(i) == 0 and t in held[i] for i in range(len(held))
                ), f"tier {t} idle with claimable work"
        t, i = inflight.pop(rng.randrange(len(inflight)))
        assert r.complete(t, i)
    assert all(r.state(i) == DONE for i in range(len(held)))


def test_meet_in_the_middle_order() -> None:
    r = ClaimRouter(2, 3)
    for _ in range(10):
        r.add({0, 1})
    assert r.claim(0) == [0, 1, 2]
    assert r.claim(1) == [9, 8, 7]
    assert r.claim(0) == []  # claim outstanding


def test_hedge_first_completion_wins() -> None:
    r = ClaimRouter(2, 2)
    for _ in range(4):
        r.add({0, 1})
    a = r.claim(0)
    for i in r.claim(1):
        assert r.complete(1, i)
    hedges = r.claim(1)  # nothing unclaimed: tier 1 re-reads tier 0's in-flight chunks
    assert sorted(hedges) == sorted(a)
    for i in hedges:
        assert r.complete(1, i)  # the hedge lands first and wins
    for i in a:
        assert not r.complete(0, i)  # the duplicate is discarded
    assert not r.busy()


def test_hedging_is_bounded_per_tier_per_step() -> None:
    r = ClaimRouter(3, 1)
    for _ in range(4):
        r.add({0, 1, 2})
    assert r.claim(0) == [0]
    assert r.claim(1) == [3]
    assert r.claim(2) == [1]
    assert r.complete(1, 3)
    assert r.claim(1) == [2]
    assert r.complete(1, 2)
    assert r.claim(1) == [1]  # hedge of tier 2's chunk (budget m=1)
    assert r.complete(1, 1)
    assert r.claim(1) == []  # chunk 0 is still in flight on tier 0, but the budget is spent
    assert r.hedged[1] == 1
    r.reset()
    assert r.hedged == [0, 0, 0]


def test_failure_moves_the_chunk_to_another_holder() -> None:
    r = ClaimRouter(2, 1)
    i = r.add({0, 1})
    assert r.claim(0) == [i]
    assert r.claim(1) == [i]  # hedge
    assert not r.fail(0, i)
    assert r.complete(1, i)
    j = r.add({0})
    assert r.claim(0) == [j]
    assert r.fail(0, j)  # no holder left: dead


def test_drop_tier() -> None:
    r = ClaimRouter(2, 1)
    only0 = r.add({0})
    both = r.add({0, 1})
    assert r.drop_tier(0) == [only0]
    assert r.claim(1) == [both]


@pytest.mark.parametrize("g", [0.5, 0.7, 0.9])
def test_static_split_assigns_by_position(g: float) -> None:
    from kvstream_backend.routing import StaticSplitRouter

    r = StaticSplitRouter(2, 4, g)
    for _ in range(100):
        r.add({0, 1})
    taken = [[], []]
    while r.busy():
        for t in (0, 1):
            for i in r.claim(t):
                taken[t].append(i)
                assert r.complete(t, i)
    assert len(taken[0]) == round(100 * g) and len(taken[0]) + len(taken[1]) == 100
    assert r.hedged == [0, 0]


def test_a_lookup_arriving_mid_step_does_not_take_tier_1_away() -> None:
    """Request A (chunks 0-11) is being retrieved; B's lookup (12-23) arrives mid-step. Tier 1
    must go on with A's chunks from the back, not jump to B's (the v0.1 behaviour)."""
    r = ClaimRouter(2, 4)
    a = [r.add({0, 1}) for _ in range(12)]
    assert r.claim(0) == a[0:4]
    assert r.claim(1) == a[11:7:-1]
    b = [r.add({0, 1}, demand=False) for _ in range(12)]  # B's lookup: prefetch
    for i in a[11:7:-1]:
        assert r.complete(1, i)
    assert r.claim(1) == a[7:3:-1], "tier 1 must stay on the demanded step"
    for i in a[0:4]:
        assert r.complete(0, i)
    assert r.claim(0) == b[0:4]  # A is all claimed: tier 0 reads B ahead, oldest first
    for i in a[7:3:-1]:
        assert r.complete(1, i)
    assert r.step_done()


def test_claim_again_on_completion_keeps_a_window_in_flight() -> None:
    m, depth = 4, 2
    r = ClaimRouter(2, m, depth=depth)
    ids = [r.add({0, 1}) for _ in range(40)]
    assert r.claim(0) == ids[0:4] and r.claim(0) == ids[4:8]
    assert r.claim(0) == []  # a window of m * depth in flight
    assert r.complete(0, ids[0])
    assert r.claim(0) == []  # still more than (depth - 1) * m in flight
    for i in ids[1:4]:
        assert r.complete(0, i)
    assert r.outstanding(0) == m and r.claim(0) == ids[8:12]
    assert r.outstanding(0) == m * depth


def test_prefetch_waits_for_demand_and_promotion_joins_the_pool() -> None:
    r = ClaimRouter(2, 2, hedge=False)
    p = [r.add({0, 1}, demand=False) for _ in range(4)]
    d = [r.add({0, 1}) for _ in range(2)]
    assert r.claim(0, prefetch=True) == d  # demanded first, though added later
    assert r.claim(1, prefetch=False) == []
    r.promote(p[3])
    assert r.claim(1, prefetch=False) == [p[3]]  # the promoted prefetch is demanded work
    assert r.cancel(p[0])  # never claimed: nothing read
    for i in d:
        assert r.complete(0, i)
    assert r.claim(0) == [p[1], p[2]]  # the oldest remaining prefetches
    assert r.complete(1, p[3])
    assert r.step_done()


def test_router_state_stays_bounded_under_endless_lookups_and_steps() -> None:
    rng = random.Random(3)
    r = ClaimRouter(2, 4, depth=2)
    live: list[int] = []
    for _ in range(2000):
        live += [r.add({0, 1}, demand=False) for _ in range(8)]  # next requests' lookups
        step = [r.add({0, 1}) for _ in range(8)]  # this step's gets
        for _ in range(4):  # some lookups are promoted, some released
            r.promote(live.pop(0)) if rng.random() < 0.5 else r.cancel(live.pop(0))
        while not r.step_done():
            inflight = [(t, i) for t in (0, 1) for i in r.claim(t, prefetch=False)]
            for t, i in inflight:
                r.complete(t, i)
        r.end_step()
        while len(live) > 64:  # lookups that never turn into gets expire
            r.cancel(live.pop(0))
        assert len(step) == 8
    assert len(r) <= 64 + 8 * 3, len(r)


def test_prefetches_leave_the_last_claim_slot_to_demanded_work() -> None:
    r = ClaimRouter(1, 4, hedge=False, depth=2)
    p = [r.add({0}, demand=False) for _ in range(12)]
    assert r.claim(0) == p[0:4]
    assert r.claim(0) == []  # a second prefetch claim would fill the tier's window
    d = [r.add({0}) for _ in range(4)]  # a get arrives while the prefetches are in flight
    assert r.claim(0) == d, "the get's reads start at once"
