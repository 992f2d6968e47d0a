"""The read path's scheduling, deterministically: real files and real I/O, with the moment each
op reaches its queue steered by tests/fakes.py (a held gate, a submit that blocks)."""

from __future__ import annotations

import pytest

from kvstream_backend.engine import Engine, ReadRequest
from kvstream_backend.io.memory import AlignedBuffer
from kvstream_backend.tiers import copies

from .conftest import engine_config
from .fakes import Control
from .helpers import payload, write_all

KB = 1024
SIZE = 8 * KB


@pytest.fixture
def controlled(tier_dirs):
    made: list[Engine] = []

    def make(ctl: Control, **kw) -> Engine:
        kw.setdefault("tier_opts", [{"io": "threads"}] * 2)
        e = Engine(engine_config(tier_dirs, **kw), queue_factory=ctl.factory)
        made.append(e)
        return e

    yield make
    for e in made:
        e.close()


def _requests(e: Engine, keys: list[str], lazy: bool = False):
    reqs = []
    for k in keys:
        info = e.lookup(k)
        assert info is not None
        reqs.append(ReadRequest(info, None if lazy else AlignedBuffer(SIZE), AlignedBuffer))
    return reqs


def _looked_up(e: Engine, keys: list[str], owner: str = "t"):
    """The lookup-time reads of ``keys`` (what LMCache's lookup starts), taken as a get does."""
    assert all(e.lookup_and_pin(owner, keys, read=lambda _info: AlignedBuffer))
    return [e.take(owner, k) for k in keys]


def _key_of(op) -> str:
    return op.ctx.handle.key


def test_a_blocked_submit_on_one_tier_does_not_stall_the_other(controlled, monkeypatch):
    """Tier 1's first read submit blocks (as an inline-issuing FUSE submit does); tier 0 still
    claims, reads and reaps, and hedges tier 1's claims: the whole pool is delivered while
    tier 1 is still stuck in that one submit call. Tier 1's copies, landing after that, are
    not verified: they can no longer be served."""
    checked: list[int] = []
    check_read = copies.check_read

    def counting(job, *a):
        checked.append(job.tier)
        check_read(job, *a)

    monkeypatch.setattr(copies, "check_read", counting)
    ctl = Control()
    release = ctl.block_submit("t1-r")
    e = controlled(ctl, claim_batch=2, read_window=4)
    keys = [f"k{i}" for i in range(16)]
    write_all(e, keys, SIZE)
    handles = e.read(_requests(e, keys))
    try:
        for h in handles:
            buf = h.wait(10)
            assert buf is not None, f"{h.key}: {h.reason}"
            assert bytes(buf.view[:SIZE]) == payload(h.key, SIZE)
            buf.release()
        assert ctl.blocked["t1-r"].is_set() and not release.is_set(), \
            "tier 1 should still be blocked in its first submit"
        assert e.wait_idle(0.2) is False  # tier 1's claim is still outstanding
    finally:
        release.set()
    assert e.wait_idle(10)
    rep = e.steps[-1]
    assert rep.chunks == 16 and rep.misses == 0
    assert rep.tiers[0].chunks == 16 and rep.tiers[1].chunks == 0
    assert rep.tiers[0].hedged_bytes > 0  # tier 1's claims were re-read by tier 0
    assert e.stats().tiers[1].read_bytes > 0  # tier 1's claims were read once released ...
    assert checked.count(0) == 16 and 1 not in checked  # ... and dropped unverified
    t0, t1 = e.stats().tiers  # every read ends delivered, beaten or failed
    assert t1.reads > 0 and t1.lost_reads == t1.reads and t1.errors == {}
    assert t0.reads == 16 + t0.lost_reads and t0.read_s > 0
    assert rep.tiers[0].reads >= 16 and rep.tiers[0].max_read_s > 0
    assert rep.tiers[0].max_read_s * rep.tiers[0].reads >= rep.tiers[0].read_s


def test_a_front_tier_that_stops_delivering_leaves_its_chunks_to_the_other(controlled):
    """Both tiers measured by a first step; then the front tier's next read submit blocks (a
    hung mount). Its reads would keep the other tier off the chunks it is about to reach (the
    back tier's guard trusts the front's measured rate), and no read completes to wake the
    loop. Once the front's oldest read is 4x overdue the loop wakes on its own, and the other
    tier claims what is left and re-reads the stuck reads: the step is delivered while the
    front tier is still blocked."""
    ctl = Control()
    e = controlled(ctl, claim_batch=2, read_window=4)
    warm, keys = [f"w{i}" for i in range(8)], [f"k{i:02d}" for i in range(24)]
    write_all(e, warm + keys, SIZE)
    for h in e.read(_requests(e, warm)):
        buf = h.wait(10)
        assert buf is not None, f"{h.key}: {h.reason}"
        buf.release()
    assert e.wait_idle(10)
    front = e._reads.router._rank[0]  # (the router's ranking: the tier claiming the front)
    other = 1 - front
    release = ctl.block_submit(f"t{front}-r")
    try:
        for h in e.read(_requests(e, keys)):
            buf = h.wait(10)
            assert buf is not None, f"{h.key}: {h.reason}"
            assert bytes(buf.view[:SIZE]) == payload(h.key, SIZE)
            buf.release()
        assert ctl.blocked[f"t{front}-r"].is_set() and not release.is_set(), \
            "the front tier should still be blocked in its submit"
    finally:
        release.set()
    assert e.wait_idle(10)
    rep = e.steps[-1]
    assert rep.chunks == 24 and rep.misses == 0
    assert rep.tiers[other].chunks == 24 and rep.tiers[other].hedged_bytes > 0


def test_lookups_are_the_steps_pool_and_released_ones_are_never_read(controlled):
    """A step's lookups are its pool, read from both ends in lookup order as soon as they are
    registered; the first get seals it, so the next requests' lookups wait behind it, and a
    lookup released before any tier claimed it is never read."""
    ctl = Control()
    e = controlled(ctl, claim_batch=2, read_window=2, hedge=False)
    step = [f"s{i:02d}" for i in range(12)]
    nxt = [f"n{i}" for i in range(6)]
    write_all(e, step + nxt, SIZE)
    ctl.open.clear()  # from here on, submissions are held until release()
    sh = _looked_up(e, step)  # the step's lookups
    e.demand(sh[:3])  # the first request's get
    assert e.lookup_and_pin("next", nxt, read=lambda _info: AlignedBuffer)  # next requests'
    assert e.release("next", ["n0", "n1"]) == 2  # released before any tier claimed them
    nh = [None, None] + [e.take("next", k) for k in nxt[2:]]
    ctl.release()
    for h in sh + nh[2:]:
        assert h is not None
        buf = h.wait(10)
        assert buf is not None and bytes(buf.view[:SIZE]) == payload(h.key, SIZE)
        h.discard()
    assert e.wait_idle(10)
    order = [_key_of(op) for op in ctl.reads()]
    assert "n0" not in order and "n1" not in order, "a released lookup was read"
    t0 = [_key_of(op) for op in ctl.reads("t0")]
    t1 = [_key_of(op) for op in ctl.reads("t1")]
    # the first claims come from the two ends (later the faster tier measured takes the front)
    assert t0[:2] == ["s00", "s01"] and t1[:2] == ["s11", "s10"], (t0, t1)
    for mine in (t0, t1):  # the next pool only once the step is all claimed
        kinds = [k[0] == "s" for k in mine]
        assert kinds == sorted(kinds, reverse=True), mine
    st = e.stats()
    assert st.prefetch_dropped >= 2 and st.prefetch_held_bytes == 0


def test_prefetch_reads_do_not_open_steps_and_each_demanded_pool_is_one_step(controlled):
    ctl = Control()
    e = controlled(ctl)
    keys = [f"s{i}" for i in range(8)]
    write_all(e, keys, SIZE)
    ph = _looked_up(e, keys)
    for h in ph:
        assert h.wait(10) is not None
    assert e.wait_idle(10)
    assert e.stats().steps == 0, "prefetch-only reads are not a step"
    e.demand(ph[:4])
    dh = e.read(_requests(e, [f"s{i}" for i in range(4, 8)]))
    for h in dh:
        h.wait(10).release()
    assert e.wait_idle(10)
    st = e.stats()
    assert st.steps == 1 and st.prefetch_hits == 4
    for h in ph:
        h.discard()
    assert e.wait_idle(10)
    assert e.stats().prefetch_held_bytes == 0
