"""The router alone (no I/O): three steps of one process, two tiers reading serially at fixed
rates, chunks added as LMCache's lookups add them (one request's chunks at a time, a few ms
apart), then the gets. Prints per step which chunk positions the slow tier read (``*``: a
hedge, or a chunk the fast tier then re-read), when the first request's chunks were all in,
when every chunk was, and the hedges so far per tier. Reads are served one after another per
tier, so a tier's parallel reads do not finish together as the H200's virtio disk's did: the
first request's delay seen there does not show here, only where each tier reads.

Usage: ``python router_order.py [SLOW_GBPS FAST_GBPS]`` (default 1.5 35: the H200's virtio disk
and /dev/shm). The slow tier is listed first, as in ``kvstream bench --gpu``'s ``kvstream``
configuration. ``python router_order.py --time``: 200 such steps, printing only the CPU time
per chunk (the router and this driver together).
"""

from __future__ import annotations

import contextlib
import heapq
import io
import sys
import time
from collections.abc import Callable

from kvstream_backend.policy.routing import ClaimRouter

SIZE = 32 << 20
REQUESTS, CHUNKS, LOOKUP_GAP_S = 8, 16, 0.002


def step(r: ClaimRouter, rates: list[float], t0: float) -> float:
    busy = [t0, t0]
    events: list[tuple[float, int, int]] = []
    slow: list[int] = []
    issued: set[int] = set()  # read by some tier already: another read of it is a hedge
    hedged: set[int] = set()
    ids: list[int] = []
    ready: dict[int, float] = {}

    def fill(now: float) -> None:
        for t in (0, 1):
            while r.has_room(t):
                got = r.claim(t, now)
                if not got:
                    break
                for i in got:
                    busy[t] = max(busy[t], now) + SIZE / rates[t]
                    heapq.heappush(events, (busy[t], t, i))
                    if i in issued:
                        hedged.add(i)
                    issued.add(i)
                    if t == 0:
                        slow.append(i)

    def drain(until: float) -> float:
        now = t0
        while events and events[0][0] <= until:
            now, t, i = heapq.heappop(events)
            if r.complete(t, i, now):
                ready[i] = now
            fill(now)
        return now

    for q in range(REQUESTS):  # the lookups: reads start as each request's chunks arrive
        now = t0 + q * LOOKUP_GAP_S
        drain(now)
        ids += [r.add({0, 1}, SIZE, lookup=True) for _ in range(CHUNKS)]
        fill(now)
    r.demand(ids[0])  # the first get seals the pool
    end = drain(float("inf"))
    pos = {i: p for p, i in enumerate(ids)}
    first = max(ready[i] for i in ids[:CHUNKS]) - t0
    last = max(ready[i] for i in ids) - t0
    reads = ", ".join(f"{pos[i]}{'*' if i in hedged else ''}" for i in sorted(slow, key=pos.get)
                      if i in pos)
    print(f"  slow tier read {reads}; request 0 in at "
          f"{first * 1e3:.1f} ms, every chunk in at {last * 1e3:.1f} ms; hedges {r.hedged}")
    return end


def main() -> None:
    if sys.argv[1:] == ["--time"]:
        r, t, c0 = ClaimRouter(2, 4), 0.0, time.process_time()
        with contextlib.redirect_stdout(io.StringIO()):
            for _ in range(200):
                t = step(r, [1.5e9, 35e9], t) + 0.05
        per = (time.process_time() - c0) / (200 * REQUESTS * CHUNKS)
        print(f"{per * 1e6:.1f} us of CPU per chunk")
        return
    slow, fast = (float(x) * 1e9 for x in sys.argv[1:3]) if len(sys.argv) > 2 else (1.5e9, 35e9)
    three_steps(step, [slow, fast])


def three_steps(step_fn: Callable[[ClaimRouter, list[float], float], float],
                rates: list[float]) -> None:
    """Three steps of one process (one router), 50 ms apart; the first is cold."""
    r = ClaimRouter(2, 4)
    t = 0.0
    for s in range(3):
        print(f"step {s + 1}{' (cold: no rates yet)' if s == 0 else ''}")
        t = step_fn(r, rates, t) + 0.05


if __name__ == "__main__":
    main()
