"""The routing policy with fake tiers and a fake clock (the simulator of
kvstream_backend.policy.model)."""

from __future__ import annotations

import math
import random

import pytest

from kvstream_backend.policy import model
from kvstream_backend.policy.routing import INFLIGHT, UNCLAIMED, ClaimRouter


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
    assert abs(sim.tier_finish_s[0] - sim.tier_finish_s[1]) <= claim_time + 1e-9  # (float sums)


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
        r.add(h, lookup=True)
    r.demand(0)
    inflight: list[tuple[int, int]] = []
    delivered = 0
    while inflight or any(r.state(i) == UNCLAIMED for i in range(len(held))):
        for t in range(k):
            for i in r.claim(t):
                assert t in held[i]
                inflight.append((t, i))
        for t in range(k):
            if r.outstanding(t) == 0:
                assert not any(
                    r.state(i) == UNCLAIMED and t in held[i] for i in range(len(held))
                ), f"tier {t} idle with claimable work"
        t, i = inflight.pop(rng.randrange(len(inflight)))
        delivered += r.complete(t, i)
    assert delivered == 200 and len(r) == 0 and r.pools == 0


def test_meet_in_the_middle_order() -> None:
    r = ClaimRouter(2, 3)
    for _ in range(10):
        r.add({0, 1})
    assert r.claim(0) == [0, 1, 2]
    assert r.claim(1) == [9], "unmeasured, the back tier probes with one read"
    assert r.claim(0) == []  # its window (m before the first measurement) is full
    assert r.claim(1) == []


def test_hedge_first_completion_wins() -> None:
    r = ClaimRouter(2, 2, window=2)
    for _ in range(4):
        r.add({0, 1})
    a = r.claim(0, 0.0)
    for i in r.claim(1, 0.0):
        assert r.complete(1, i, 0.01)
    hedges = r.claim(1, 0.01)  # nothing unclaimed: tier 1 re-reads tier 0's in-flight chunks
    assert sorted(hedges) == sorted(a)
    for i in hedges:
        assert r.complete(1, i, 0.02)  # the hedge lands first and wins
    for i in a:
        assert not r.complete(0, i, 0.5)  # the duplicate is discarded
    assert not r.busy() and len(r) == 0


def test_a_tier_hedges_only_what_it_delivers_sooner() -> None:
    """Tier 1 reads a chunk in 0.1 s, tier 0 in 0.01 s: tier 1 never hedges tier 0's reads
    (they land first anyway); tier 0 hedges tier 1's."""
    r = ClaimRouter(2, 1, window=1)
    for t, took in ((0, 0.01), (1, 0.1)):  # measure both tiers
        i = r.add({0, 1})
        assert r.claim(t, 0.0) == [i] and r.complete(t, i, took)
    xs = [r.add({0, 1}) for _ in range(20)]
    assert r.claim(0, 1.0) == [xs[0]]
    assert r.claim(1, 1.0) == [xs[19]], "tier 0 would reach it in 0.2 s, tier 1 in 0.1 s"
    for k in range(1, 19):  # tier 0 reads the rest; tier 1's read is late (a slow moment)
        now = 1.0 + 0.01 * k
        assert r.complete(0, xs[k - 1], now) and r.claim(0, now) == [xs[k]]
    assert r.complete(0, xs[18], 1.19)
    assert r.claim(0, 1.19) == [xs[19]], "the fast tier re-reads the slow tier's chunk"
    assert r.complete(0, xs[19], 1.2)
    assert not r.complete(1, xs[19], 1.25)  # the duplicate is discarded
    c, d = r.add({0, 1}), r.add({1})  # (only tier 1 holds d: it claims it whatever the rates)
    assert r.claim(0, 2.0) == [c] and r.claim(1, 2.0) == [d]
    assert r.complete(1, d, 2.1)
    assert r.claim(1, 2.1) == [], "c lands on tier 0 long before tier 1 could read it"


def test_an_idle_fast_tier_hedges_the_slow_tiers_late_reads() -> None:
    """The tail of a pool: tier 1 (0.6 GB/s) still has three reads queued when tier 0
    (2.5 GB/s) runs out of work. Tier 0 re-reads them: its one read lands before even the
    oldest of tier 1's. (A first cut estimated tier 1's reads from when they started plus its
    latency, found them already "due" and never hedged a late read.)"""
    size = 16 << 20
    r = ClaimRouter(2, 4, window=4)
    c = r.add({0, 1}, size)
    assert r.claim(1, 0.0) == [c] and r.complete(1, c, size / 0.6e9)
    late = [r.add({0, 1}, size) for _ in range(3)]
    # tier 0 is not measured yet (a process's first step): tier 1 has the front for now
    assert r.claim(1, 1.0) == late
    a, b = r.add({0}, size), r.add({0}, size)
    assert r.claim(0, 1.0) == [b, a]
    assert r.complete(0, a, 1.0 + size / 2.5e9) and r.complete(0, b, 1.0 + 2 * size / 2.5e9)
    assert sorted(r.claim(0, 1.5)) == late, "tier 0 hedges every late read of tier 1"
    for i in late:
        assert r.complete(0, i, 1.52)
    assert not any(r.complete(1, i, 1.6) for i in late) and not r.busy()
    assert r.window(1) == 1, "a tier whose claimed reads keep losing to hedges reads one ahead"


def test_hedging_is_bounded_per_tier_per_pool() -> None:
    """The tail: every chunk claimed, tier 0 (measured, so it keeps the front) runs dry while
    tiers 1 and 2 (unmeasured, so late) each have a read in flight: it re-reads one of them,
    the pool's budget being max(m, the other windows) = 1. Neither is a stale front read:
    tier 1 claimed from the back, tier 2 still claims from the front."""
    r = ClaimRouter(3, 1, window=1)
    for _ in range(4):
        r.add({0, 1, 2})
    assert r.claim(0, 0.0) == [0]
    assert r.claim(1, 0.0) == [3]
    assert r.claim(2, 0.0) == [1]
    assert r.complete(0, 0, 0.1)
    assert r.claim(0, 0.1) == [2]
    assert r.complete(0, 2, 0.2)
    hedge = r.claim(0, 0.2)
    assert hedge in ([1], [3])
    assert r.complete(0, hedge[0], 0.3)
    assert r.claim(0, 0.3) == [], "the other late read is not re-read: the budget is spent"
    assert r.outstanding(0) == 0 and r.hedged[0] == 1
    r.reset()
    assert r.hedged == [0, 0, 0]


def test_the_new_front_tier_first_hedges_the_old_fronts_reads() -> None:
    """A process's first step: before any rate is measured, the configuration order gives tier
    0 (the slow one) the front. Once tier 1 finishes a read it is ranked first and takes the
    front; tier 0's reads of the first chunks are then what the first gets wait for, so tier 1
    re-reads them before its own next claims (outside the pool's hedge budget). Tier 0, now at
    the back, claims from the back; those reads are never stale, so tier 1 claims in order and
    hedges them only with the room its claims leave."""
    size = 32 << 20
    r = ClaimRouter(2, 4, window=8)
    ids = [r.add({0, 1}, size, lookup=True) for _ in range(16)]
    r.demand(ids[0])
    assert r.claim(0, 0.0) == ids[:4]  # unmeasured: the configuration order
    assert r.claim(1, 0.0) == ids[::-1][:4]
    assert r.complete(1, ids[15], size / 30e9)  # tier 1 is measured: it is ranked first
    assert r.claim(1, size / 30e9) == ids[:4], "tier 0's reads at the front, re-read first"
    assert r.claim(1, size / 30e9) == [ids[4]]  # then its own claims, from the front
    assert r.hedged == [0, 4]
    for i in ids[:4]:
        assert r.complete(1, i, 0.01)
    assert not any(r.complete(0, i, 0.1) for i in ids[:4])  # tier 0's copies come too late
    assert r.window(0) == 1, "each read tier 0 claimed was beaten by a hedge"
    assert r.claim(0, 0.1) == [], "tier 1 reaches every chunk left before tier 0 reads one"
    assert r.claim(1, 0.1) == ids[5:9], "no stale read left: tier 1 claims in order"


def test_failure_moves_the_chunk_to_another_holder() -> None:
    r = ClaimRouter(2, 1)
    i = r.add({0, 1})
    assert r.claim(0) == [i]
    assert not r.fail(0, i)  # tier 1 still holds it: it goes back to the pool
    assert r.state(i) == UNCLAIMED
    assert r.claim(0) == []  # tier 0 lost it
    assert r.claim(1) == [i] and r.complete(1, i)
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
    from kvstream_backend.policy.routing import StaticSplitRouter

    r = StaticSplitRouter(2, 4, g)
    for _ in range(100):
        r.add({0, 1})
    taken: list[list[int]] = [[], []]
    while r.busy():
        for t in (0, 1):
            for i in r.claim(t):
                taken[t].append(i)
                assert r.complete(t, i)
    assert len(taken[0]) == round(100 * g) and len(taken[0]) + len(taken[1]) == 100
    assert r.hedged == [0, 0]


def test_the_lookups_before_the_gets_are_one_pool_claimed_from_both_ends() -> None:
    """LMCache's order: every request's lookup, then one get per request. The lookups are the
    step's pool: tier 0 reads request A from the front while tier 1 starts at request C's end
    (v0.2 read every lookup "oldest first" on every tier, so A waited on the slow tier)."""
    r = ClaimRouter(2, 2, hedge=False, window=2)  # two tiers of the same speed
    a = [r.add({0, 1}, lookup=True) for _ in range(4)]
    b = [r.add({0, 1}, lookup=True) for _ in range(4)]
    c = [r.add({0, 1}, lookup=True) for _ in range(4)]
    assert r.claim(0, 0.0) == a[0:2]
    assert r.claim(1, 0.0) == [c[3], c[2]]
    for i in a:
        r.demand(i)  # A's get: the pool is now the step served
    nxt = [r.add({0, 1}, lookup=True) for _ in range(4)]  # the next step's lookups
    for i in a[0:2]:
        assert r.complete(0, i, 1.0)
    assert r.claim(0, 1.0) == a[2:4]
    for i in (c[3], c[2]):
        assert r.complete(1, i, 1.0)
    assert r.claim(1, 1.0) == [c[1], c[0]], "tier 1 stays on the step, not on the next lookups"
    for i in a[2:4]:
        assert r.complete(0, i, 2.0)
    assert r.claim(0, 2.0) == b[0:2]
    for i in (c[1], c[0]):
        assert r.complete(1, i, 2.0)
    assert r.claim(1, 2.0) == [b[3], b[2]]
    for i in b[0:2]:
        assert r.complete(0, i, 3.0)
    assert r.claim(0, 3.0) == nxt[0:2], "only once the step is claimed does a tier read ahead"
    assert r.step_done() and r.pools == 2


def test_a_slow_tier_leaves_a_short_open_pool_to_the_front() -> None:
    """The first request's lookup is the whole open pool for a moment. The slow tier (1.5 GB/s
    against 30 GB/s, both measured) does not take its last chunks: the later lookups would put
    them first in line. Once the pool is long enough that the fast tier would reach its back
    later than the slow tier delivers it, the slow tier claims the back. A sealed pool (the
    gets have begun) is guarded the same way: a read the fast tier delivers first is waste."""
    size = 32 << 20

    def measured() -> ClaimRouter:
        r = ClaimRouter(2, 4, window=8)
        for t, gbps in ((0, 30e9), (1, 1.5e9)):  # tier 0 is the fast one: it takes the front
            i = r.add({0, 1}, size)
            assert r.claim(t, 0.0) == [i] and r.complete(t, i, size / gbps)
        return r

    r = measured()
    first = [r.add({0, 1}, size, lookup=True) for _ in range(16)]
    assert r.claim(1, 1.0) == [], "16 chunks: the fast tier reaches the back in 18 ms"
    rest = [r.add({0, 1}, size, lookup=True) for _ in range(112)]
    got = r.claim(1, 1.0)
    assert got == rest[::-1][:len(got)] and got, "128 chunks: the back is worth reading"
    assert all(r.state(i) == UNCLAIMED for i in first)
    r = measured()
    first = [r.add({0, 1}, size, lookup=True) for _ in range(16)]
    r.demand(first[0])
    assert r.claim(1, 1.0) == []


def test_a_back_tier_does_not_slow_a_read_the_grown_pool_put_near_the_front() -> None:
    """A device shares its bandwidth among its reads in flight. The slow tier (1.84 GB/s beside
    20 GB/s, both measured: an H100 host's disk and /dev/shm) may take request 0's last chunk
    at its lookup (18 ms against the front's 27 ms); once the other requests' lookups grow the
    pool, more reads from the back would stretch that one past the moment the front gets there,
    so the slow tier waits for it before it claims the back (stop 35's GPU step: request 0 ready
    at 90-125 ms behind the disk's four reads)."""
    size = 32 << 20
    r = ClaimRouter(2, 4)  # windows sized to the tiers: 4 for the slow one
    for t, gbps in ((0, 20e9), (1, 1.84e9)):
        i = r.add({0, 1}, size)
        assert r.claim(t, 0.0) == [i] and r.complete(t, i, size / gbps)
    first = [r.add({0, 1}, size, lookup=True) for _ in range(16)]
    assert r.claim(1, 1.0) == [first[-1]], "one read: 18 ms, the front needs 27"
    rest = [r.add({0, 1}, size, lookup=True) for _ in range(112)]
    assert r.window(1) == 4
    assert r.claim(1, 1.001) == [], "a second read would make the first land in 36 ms"
    assert r.complete(1, first[-1], 1.019)
    got = r.claim(1, 1.019)
    assert got and got == rest[::-1][:len(got)], "then the back of the step"


def test_a_back_tier_does_not_hedge_at_the_cost_of_its_own_read_near_the_front() -> None:
    """A hedge is a read like any other: it shares the tier's bandwidth with the reads in
    flight. Request 1's chunks queue behind request 0's on the fast tier (21.9 GB/s, its reads
    served in claim order), so the slow tier (1.5 GB/s) would deliver one sooner, but only by
    delaying request 0's chunk it is reading, which the front would then reach first (the
    router-only model ``router_shared.py --fast-servers 16``: request 0 in at 81 ms with such
    hedges, 22 ms without)."""
    size = 32 << 20
    r = ClaimRouter(2, 4)
    for t, gbps in ((0, 21.9e9), (1, 1.5e9)):
        i = r.add({0, 1}, size)
        assert r.claim(t, 0.0) == [i] and r.complete(t, i, size / gbps)

    def fill(t: int, now: float) -> list[int]:
        got: list[int] = []
        while more := r.claim(t, now):
            got += more
        return got

    req0 = [r.add({0, 1}, size, lookup=True) for _ in range(16)]
    assert r.claim(1, 1.0) == [req0[-1]]
    assert fill(0, 1.0) == req0[:-1]
    req1 = [r.add({0, 1}, size, lookup=True) for _ in range(16)]
    assert fill(0, 1.002) == req1
    assert r.claim(1, 1.002) == [], "no claim and no hedge while request 0's chunk is in flight"


def test_reads_claimed_from_the_front_before_the_ends_swapped_do_not_hold_the_back() -> None:
    """A cold process: the slow tier, listed first, starts at the front; once the fast tier's
    probe shows it faster, the ends swap. The slow tier's front reads are the new front's to
    hedge; they do not keep the slow tier off the back of the step."""
    size = 32 << 20
    r = ClaimRouter(2, 4)
    xs = [r.add({0, 1}, size, lookup=True) for _ in range(64)]
    r.demand(xs[0])
    assert r.claim(0, 0.0) == xs[:4] and r.claim(1, 0.0) == [xs[-1]]
    assert r.complete(1, xs[-1], size / 20e9)
    assert r.complete(0, xs[0], 4 * size / 1.5e9)  # its four reads shared 1.5 GB/s
    got = r.claim(0, 4 * size / 1.5e9)
    assert got and got == xs[-2::-1][:len(got)], "now at the back, it claims the back"


def test_a_read_the_front_tier_hedges_does_not_hold_the_back_tier() -> None:
    """The same, but the fast tier, idle, re-reads that chunk: whichever copy lands first is
    delivered, so the slow tier's further claims cannot delay it and it claims the back."""
    size = 32 << 20
    r = ClaimRouter(2, 4)
    for t, gbps in ((0, 20e9), (1, 1.84e9)):
        i = r.add({0, 1}, size)
        assert r.claim(t, 0.0) == [i] and r.complete(t, i, size / gbps)
    first = [r.add({0, 1}, size, lookup=True) for _ in range(16)]
    assert r.claim(1, 1.0) == [first[-1]]
    now, mine = 1.0, r.claim(0, 1.0)
    while first[-1] not in mine:
        for i in mine:  # one after another at 20 GB/s
            now += size / 20e9
            assert r.complete(0, i, now)
        mine = r.claim(0, now)
    assert mine[-1] == first[-1], "its claims done, the fast tier hedges the slow one's read"
    rest = [r.add({0, 1}, size, lookup=True) for _ in range(112)]
    got = r.claim(1, now)
    assert got and got == rest[::-1][:len(got)]


def test_a_tier_whose_reads_lose_to_hedges_reads_one_ahead_until_one_wins() -> None:
    size = 32 << 20
    r = ClaimRouter(2, 4, window=8)
    xs = [r.add({0, 1}, size) for _ in range(6)]
    back = xs[:1:-1]
    assert r.claim(1, 0.0) == back  # unmeasured: the configuration order (tier 1: the back)
    assert r.claim(0, 0.0) == xs[:2]
    for k, i in enumerate(xs[:2]):
        assert r.complete(0, i, (k + 1) * size / 30e9)
    assert sorted(r.claim(0, 0.01)) == xs[2:], "idle: tier 0 hedges tier 1's reads"
    for i in xs[2:]:
        assert r.complete(0, i, 0.02)
    assert r.window(1) == 8
    assert not r.complete(1, back[0], 0.08) and r.window(1) == 8, "one loss is chance"
    assert not r.complete(1, back[1], 0.08) and r.window(1) == 1
    ys = [r.add({1}, size) for _ in range(3)]
    assert r.claim(1, 0.08) == [], "two reads still in flight, a window of one"
    for i in back[2:]:
        assert not r.complete(1, i, 0.09)
    assert r.claim(1, 0.09) == [ys[2]]
    assert r.complete(1, ys[2], 0.11) and r.window(1) == 8, "a win restores its window"
    assert r.claim(1, 0.11) == [ys[1], ys[0]]


def test_a_stalled_front_no_longer_keeps_the_back_tier_off_its_chunks() -> None:
    """The guard trusts the front tier's measured rate; a front whose oldest read is four times
    overdue (a hung mount) guards nothing, so the slower tier takes the chunks it can."""
    size = 32 << 20
    r = ClaimRouter(2, 4, window=4)
    for t, gbps in ((0, 30e9), (1, 1.5e9)):
        i = r.add({0, 1}, size)
        assert r.claim(t, 0.0) == [i] and r.complete(t, i, size / gbps)
    xs = [r.add({0, 1}, size) for _ in range(8)]
    assert r.claim(0, 1.0) == xs[:4]
    assert r.claim(1, 1.0) == [], "the fast tier reaches the rest in 5 ms"
    assert r.claim(1, 1.01) == [], "its reads are 10 ms old: not stalled (within 4 x 50 ms)"
    assert r.next_stall(1.01) == pytest.approx(1.2), "when to claim again if nothing completes"
    assert r.claim(1, 1.3) == xs[:3:-1], "300 ms and nothing: the back claims what is left"
    assert r.next_stall(1.3) > 1.3, "only deadlines still ahead (tier 1's own reads now)"
    for i in xs[4:]:
        assert r.complete(1, i, 1.4)
    assert sorted(r.claim(1, 1.4)) == xs[:4], "and hedges the stalled tier's reads"


def test_a_get_without_a_lookup_joins_the_step_served() -> None:
    r = ClaimRouter(2, 4, hedge=False, window=4)
    step = [r.add({0, 1}, lookup=True) for _ in range(4)]
    r.demand(step[0])
    nxt = [r.add({0, 1}, lookup=True) for _ in range(4)]
    late = r.add({0, 1})  # a get for a chunk no lookup registered
    assert r.unresolved == 2
    assert r.claim(1) == [late, *step[3:0:-1]]  # the back of the step served, not the next
    assert r.claim(0) == [step[0], *nxt[0:3]]
    assert r.state(nxt[3]) == UNCLAIMED


def test_memory_short_claims_only_what_a_get_waits_for() -> None:
    r = ClaimRouter(1, 4, hedge=False)
    ahead = [r.add({0}, lookup=True) for _ in range(3)]
    waited = r.add({0}, lookup=True)
    r.demand(waited)
    assert r.claim(0, ahead=False) == [waited]
    assert r.claim(0) == ahead


def test_claim_again_on_completion_keeps_the_window_full() -> None:
    r = ClaimRouter(2, 4, window=8)
    ids = [r.add({0, 1}) for _ in range(40)]
    assert r.claim(0) == ids[0:4] and r.claim(0) == ids[4:8]
    assert r.claim(0) == []  # a window of 8 in flight
    assert r.complete(0, ids[0])
    assert r.claim(0) == [ids[8]]  # a read ended: one more starts at once
    assert r.outstanding(0) == 8


def _run_step(r: ClaimRouter, n: int, size: float, speed: list[tuple[float, float]],
              lookups: bool = True) -> tuple[float, list[int]]:
    """Serve ``n`` chunks on tiers that are processor-sharing servers: tier t moves
    ``min(stream, total / in_flight)`` bytes/s per read (``speed[t] = (stream, total)``).
    Returns (time of the last delivery, chunks delivered per tier)."""
    ids = [r.add(range(len(speed)), int(size), lookup=lookups) for _ in range(n)]
    for i in ids:  # the gets
        r.demand(i)
    left: dict[tuple[int, int], float] = {}
    now, dt, last, won = 0.0, 1e-4, 0.0, [0] * len(speed)
    while r.unresolved or left:  # hedge losers finish too
        for t in range(len(speed)):
            while r.has_room(t) and (picks := r.claim(t, now)):
                for i in picks:
                    left[(t, i)] = size
        now += dt
        for t, (stream, total) in enumerate(speed):
            mine = [k for k in left if k[0] == t]
            for k in mine:
                left[k] -= dt * min(stream, total / len(mine))
        for (t, i), rest in list(left.items()):
            if rest <= 0:
                del left[(t, i)]
                if r.complete(t, i, now):
                    won[t] += 1
                    last = now
    return last, won


def test_windows_follow_littles_law() -> None:
    """A fast tier (4.5 GB/s per read, 20 GB/s in all) grows its window until it reads near
    its limit; a slow one (1.2 GB/s) stays at a couple of reads (deep queues only make every
    one of its reads late)."""
    mib32 = 32 << 20
    fast, slow = ClaimRouter(1, 4), ClaimRouter(1, 4)
    t_fast, _ = _run_step(fast, 256, mib32, [(4.5e9, 20e9)])
    t_slow, _ = _run_step(slow, 16, mib32, [(1.2e9, 1.2e9)])
    assert 20 <= fast.window(0) <= 40, fast.window(0)  # ~ 20 GB/s x 50 ms / 32 MiB + 1
    assert 2 <= slow.window(0) <= 3, slow.window(0)
    assert 256 * mib32 / t_fast >= 0.8 * 20e9, "the fast tier reads at >= 0.8x its limit"
    assert 16 * mib32 / t_slow >= 0.95 * 1.2e9


@pytest.mark.parametrize("order", ["fast-first", "slow-first"])
@pytest.mark.parametrize("fast_total,goal", [(20e9, 0.99), (5e9, 0.90)])
def test_two_tiers_beat_the_faster_alone_in_either_order(order: str, fast_total: float,
                                                         goal: float) -> None:
    """A 1.2 GB/s disk plus a fast tier, 4 GiB steps of 32 MiB chunks: after a first step has
    measured them, the pair beats the fast tier alone whatever the tier order, and the fast
    tier serves the front (the first requests). With a 20 GB/s tier the disk can add at most
    6% (the bound is 0.94x); with a 5 GB/s one, 19%."""
    mib32 = 32 << 20
    disk, fast = (1.2e9, 1.2e9), (4.5e9, fast_total)
    speed = [fast, disk] if order == "fast-first" else [disk, fast]
    alone = ClaimRouter(1, 4)
    _run_step(alone, 128, mib32, [fast])
    t_alone, _ = _run_step(alone, 128, mib32, [fast])
    pair = ClaimRouter(2, 4)
    _run_step(pair, 128, mib32, speed)
    t_pair, won = _run_step(pair, 128, mib32, speed)
    bound = 128 * mib32 / (fast_total + 1.2e9)
    assert t_pair <= goal * t_alone, (t_pair, t_alone, won)
    assert t_pair <= 1.1 * bound, (t_pair, bound)
    f = speed.index(fast)
    first = pair.add({0, 1}, mib32, lookup=True)
    assert pair.claim(f)[0] == first, "the faster tier takes the front of the next pool"


@pytest.mark.parametrize("fast_total", [20e9, 5e9])
def test_a_router_seeded_with_an_earlier_process_s_rates_serves_its_first_step_warm(
        fast_total: float) -> None:
    """The slow tier listed first: a fresh router gives it the front until its reads complete,
    so its first step is late; one seeded with what an earlier router measured (the engine's
    rate memo) serves that step as a measured one does, the fast tier at the front."""
    mib32 = 32 << 20
    speed = [(1.2e9, 1.2e9), (4.5e9, fast_total)]  # the disk first
    before = ClaimRouter(2, 4)
    t_cold, _ = _run_step(before, 128, mib32, speed)
    t_warm, _ = _run_step(before, 128, mib32, speed)
    memo = [before.estimate(t) for t in range(2)]
    assert all(est is not None and est[1] == mib32 for est in memo), memo

    def fresh() -> ClaimRouter:
        r = ClaimRouter(2, 4)
        for t, est in enumerate(memo):
            assert est is not None
            r.seed(t, *est)
        return r

    probe = fresh()
    ids = [probe.add({0, 1}, mib32, lookup=True) for _ in range(8)]
    assert probe.claim(1)[0] == ids[0], "the fast tier takes the front from the first claim"
    t_seeded, won = _run_step(fresh(), 128, mib32, speed)
    assert t_seeded <= 1.01 * t_warm, (t_seeded, t_warm, won)
    assert t_seeded < 0.98 * t_cold, (t_seeded, t_cold)


def test_a_seed_never_overrides_a_measurement() -> None:
    r = ClaimRouter(2, 4)
    i = r.add({0}, 100)
    r.claim(0, 0.0)
    r.complete(0, i, 1.0)
    measured = r.estimate(0)
    r.seed(0, 1e12, 7.0)
    r.seed(1, -1.0, 100.0)  # nonsense is ignored
    assert r.estimate(0) == measured and r.estimate(1) is None


def test_router_state_stays_bounded_under_endless_lookups_and_steps() -> None:
    rng = random.Random(3)
    r = ClaimRouter(2, 4)
    for _ in range(2000):
        step = [r.add({0, 1}, lookup=True) for _ in range(8)]
        for i in step:  # one get per request
            r.demand(i)
        nxt = [r.add({0, 1}, lookup=True) for _ in range(8)]  # the next requests' lookups
        for i in nxt:  # some are read ahead, the others released or expired
            if rng.random() < 0.5:
                r.cancel(i)
        while not r.step_done():
            for t in (0, 1):
                for i in r.claim(t, ahead=False):
                    r.complete(t, i)
        for i in nxt:
            r.cancel(i)
    assert len(r) == 0 and r.pools == 0, (len(r), r.pools)


def test_an_endless_pool_is_compacted() -> None:
    """A server whose loads never pause keeps one pool alive: its claimed prefix is cut."""
    r = ClaimRouter(2, 4, hedge=False)
    stuck = r.add({0, 1})
    assert r.claim(1) == [stuck]  # a read that never ends keeps the pool alive
    for _ in range(10000):
        r.add({0, 1})
        for i in r.claim(0):
            assert r.complete(0, i)
    assert r.pools == 1 and len(r._pools[0].ids) < 6000
    assert r.state(1) is None  # delivered long ago
    assert [r.state(i) for i in range(10001)].count(INFLIGHT) == 1
