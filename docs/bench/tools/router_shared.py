"""The router alone (no I/O), with tiers that share their bandwidth among their reads in flight
(processor sharing: a window of reads finishes together, as on the device) where
``router_order.py`` serves each tier's reads one after another. LMCache's order: 8 lookups 2 ms
apart, then the gets one after another, each followed by an 11 ms scatter. Three steps of one
process; prints when request 0's chunks were all in, when every chunk was, how many chunks the
slow tier delivered, and the hedges so far per tier.

Usage: ``python router_shared.py [rev] [--fast-servers K] [--warm-up]`` (default: the 1.5 GB/s
tier listed first, as ``kvstream bench --gpu``'s ``kvstream``; ``rev``: the 35 GB/s tier first,
as ``kvstream-rev``; ``--fast-servers K``: the fast tier serves its reads K at a time in claim
order, as threads copying from /dev/shm do, instead of sharing among all of them;
``--warm-up``: a step of one chunk first, as ``bench --gpu``'s retrieve process reads before
its first step; ``--gbps SLOW,FAST``: the tiers' bandwidths, GB/s, default 1.5,35;
``--fast-read-gbps G``: each of the fast tier's reads at most G GB/s, as one thread copies).
"""

from __future__ import annotations

import math
import sys

from router_order import CHUNKS, LOOKUP_GAP_S, REQUESTS, SIZE, three_steps

from kvstream_backend.policy.routing import ClaimRouter

SCATTER_S, DT = 0.011, 1e-4  # the lookups and chunks are router_order.py's


def step(r: ClaimRouter, bw: list[float], t0: float, servers: list[int | None],
         requests: int = REQUESTS, chunks: int = CHUNKS,
         cap: list[float] | None = None) -> float:
    inflight: list[dict[int, float]] = [{}, {}]  # per tier: chunk -> bytes left
    ready: dict[int, float] = {}
    ids: list[int] = []
    slow = bw.index(min(bw))
    slow_delivered = 0
    now = t0

    def fill() -> None:
        for t in (0, 1):
            while r.has_room(t):
                got = r.claim(t, now)
                if not got:
                    break
                inflight[t].update((i, float(SIZE)) for i in got)

    def advance(until: float) -> None:
        nonlocal now, slow_delivered
        while now < until - 1e-12:
            now += DT
            for t in (0, 1):
                if not inflight[t]:
                    continue
                active = list(inflight[t])[:servers[t]]  # claim order; None: all of them
                share = min(bw[t] / len(active), cap[t] if cap else math.inf) * DT
                for i in active:
                    inflight[t][i] -= share
                    if inflight[t][i] <= 0:
                        del inflight[t][i]
                        if r.complete(t, i, now):
                            ready[i] = now
                            slow_delivered += t == slow
            fill()  # every tick, as a driver that claims whenever it may have room

    for q in range(requests):  # the lookups: reads start as each request's chunks arrive
        advance(t0 + q * LOOKUP_GAP_S)
        ids += [r.add({0, 1}, SIZE, lookup=True) for _ in range(chunks)]
        fill()
    first = 0.0
    for q in range(requests):  # the gets, in order, each followed by its scatter
        mine = ids[q * chunks:(q + 1) * chunks]
        for i in mine:
            r.demand(i)
        fill()
        while not all(i in ready for i in mine):
            advance(now + DT)
        if q == 0:
            first = now - t0
        advance(now + SCATTER_S)
    last = max(ready[i] for i in ids) - t0
    while inflight[0] or inflight[1]:
        advance(now + DT)
    print(f"  request 0 in at {first * 1e3:.1f} ms, every chunk in at {last * 1e3:.1f} ms; "
          f"the slow tier delivered {slow_delivered}; hedges {r.hedged}")
    return now


def main() -> None:
    args = sys.argv[1:]
    def opt(name: str) -> str | None:
        return args[args.index(name) + 1] if name in args else None

    k = int(opt("--fast-servers") or 0) or None
    slow, fast = (float(g) * 1e9 for g in (opt("--gbps") or "1.5,35").split(","))
    bw = [fast, slow] if "rev" in args else [slow, fast]
    servers = [k if b == max(bw) else None for b in bw]
    g = opt("--fast-read-gbps")
    cap = [float(g) * 1e9 if g and b == max(bw) else math.inf for b in bw]
    if "--warm-up" in args:
        r = ClaimRouter(2, 4)
        print("warm-up (one chunk)")
        t = step(r, bw, 0.0, servers, requests=1, chunks=1, cap=cap) + 0.05
        for s in range(3):
            print(f"step {s + 1}")
            t = step(r, bw, t, servers, cap=cap) + 0.05
        return
    three_steps(lambda r, rates, t0: step(r, rates, t0, servers, cap=cap), bw)


if __name__ == "__main__":
    main()
