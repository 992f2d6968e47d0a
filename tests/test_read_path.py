"""The read path's scheduling, deterministically: real files and real I/O, with the moment each
op reaches its queue steered by tests/fakes.py (a held gate, a submit that blocks)."""

from __future__ import annotations

import pytest

from kvstream_backend.engine import Engine
from kvstream_backend.io.memory import AlignedBuffer

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
        reqs.append((k, info, None if lazy else AlignedBuffer(SIZE), AlignedBuffer))
    return reqs


def _key_of(op) -> str:
    return op.ctx.handle.key


def test_a_blocked_submit_on_one_tier_does_not_stall_the_other(controlled):
    """Tier 1's first read submit blocks (as an inline-issuing FUSE submit does); tier 0 still
    claims, reads and reaps, and hedges tier 1's claims: the whole pool is delivered while
    tier 1 is still stuck in that one submit call."""
    ctl = Control()
    release = ctl.block_submit("t1-r")
    e = controlled(ctl, claim_batch=2, claim_depth=2)
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


def test_demand_first_promotion_and_cancelled_prefetches_are_never_read(controlled):
    ctl = Control()
    e = controlled(ctl, claim_batch=2, claim_depth=2)
    demanded = [f"d{i}" for i in range(12)]
    prefetch = [f"p{i}" for i in range(6)]
    write_all(e, demanded + prefetch, SIZE)
    ctl.open.clear()  # from here on, submissions are held until release()
    dh = e.read(_requests(e, demanded))
    ph = e.read(_requests(e, prefetch, lazy=True), prefetch=True)
    ph[0].discard()
    ph[1].discard()
    e.demand([ph[5]])  # a get now waits for p5: it joins the pool ahead of every prefetch
    ctl.release()
    for h in dh + [ph[5]]:
        buf = h.wait(10)
        assert buf is not None and bytes(buf.view[:SIZE]) == payload(h.key, SIZE)
        buf.release()
    for h in ph[2:5]:  # prefetches are read once no tier has demanded work
        assert h.wait(10) is not None
        h.discard()
    assert e.wait_idle(10)
    order = [_key_of(op) for op in ctl.reads()]
    assert "p0" not in order and "p1" not in order, "a released prefetch was read"
    assert set(demanded + ["p5"]) <= set(order)
    for tier in ("t0", "t1"):  # a tier turns to prefetches only once all demand is claimed
        mine = [_key_of(op) for op in ctl.reads(tier) if op.ctx.primary]  # hedges aside
        kinds = [k.startswith("d") or k == "p5" for k in mine]
        assert kinds == sorted(kinds, reverse=True), f"{tier} read a prefetch early: {mine}"
    st = e.stats()
    assert st.prefetch_dropped >= 2 and st.prefetch_held_bytes == 0


def test_prefetch_reads_do_not_open_steps_and_each_demanded_pool_is_one_step(controlled):
    ctl = Control()
    e = controlled(ctl)
    keys = [f"s{i}" for i in range(8)]
    write_all(e, keys, SIZE)
    ph = e.read(_requests(e, keys, lazy=True), prefetch=True)
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
