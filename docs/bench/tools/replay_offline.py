"""Re-read a recorded trace replay (``kvstream bench --gpu --trace ... --json``) and print what
docs/benchmarks.md derives from it: each configuration's achieved read rate (net of host->GPU),
kvsim fed those rates instead of the plain limits, and kvstream's TTFT composed from its own
batches' storage time and the shm-alone run's prefill time (labelled an estimate, not a
measurement), and kvsim's terms taken apart: each configuration's TTFT rebuilt from its own
batches (a check of the rebuild), then with each batch's prefill replaced by kvsim's model
(new tokens at the run's average rate).
Usage: python docs/bench/tools/replay_offline.py docs/bench/replay-h100-run2.json
"""

from __future__ import annotations

import json
import statistics
import sys

from kvstream_backend.sim.cli import trace_path
from kvstream_backend.sim.plan import Serving, plan, predict
from kvstream_backend.sim.replay import load_trace


def pct(xs: list[float], q: float) -> float:
    s = sorted(xs)
    return s[min(len(s) - 1, int(round(q / 100 * (len(s) - 1))))]


def main(path: str) -> None:
    with open(path) as f:
        r = json.load(f)
    by = {c["name"]: c for c in r["configs"] if c["ok"]}
    p = plan(r["trace"], load_trace(trace_path(r["trace"]), "mooncake", 512), r["requests"],
             r["time_scale"], r["token_budget"])
    kvb = by["kvstream"]["retrieved_gb"] * 1e9 / sum(
        q["retrieved_tokens"] for q in by["kvstream"]["requests"])
    h2d = r["h2d_gbps"]

    def rate(c: dict) -> float:  # storage read GB/s, host->GPU time taken out
        read_s = sum(b["storage_s"] for b in c["batches"])
        return 1 / (read_s / c["retrieved_gb"] - 1 / h2d)

    rates = {n: rate(by[n]) for n in ("kvstream-disk", "kvstream-shm", "lmcache-disk")}
    print("limits", r["limits_gbps"], "read in the run",
          {k: round(v, 2) for k, v in rates.items()})
    d, s = rates["kvstream-disk"], rates["kvstream-shm"]
    for name, tiers in (("kvstream", (d, s)), ("kvstream-disk", (d,)), ("kvstream-shm", (s,)),
                        ("lmcache-disk", (rates["lmcache-disk"],))):
        c = by[name]
        pr = predict(p, Serving(name, tiers, h2d, c["prefill_tokens_per_s"], int(round(kvb))))
        print(f"{name:14s} kvsim at run rates p50 {pct(pr, 50):.2f} (measured "
              f"{c['ttft_p50_s']:.2f}, {pct(pr, 50) / c['ttft_p50_s'] - 1:+.0%})")
    k, shm, ld = by["kvstream"], by["kvstream-shm"], by["lmcache-disk"]
    clock, ttft, first = 0.0, [], 0
    for bk, bs in zip(k["batches"], shm["batches"], strict=True):
        assert bk["requests"] == bs["requests"]  # the same batches (FCFS, same plan)
        clock = max(clock, k["requests"][first]["arrival_s"]) + bk["storage_s"] + bs["prefill_s"]
        ttft += [clock] * bk["requests"]
        first += bk["requests"]
    tt = [t - q["arrival_s"] for t, q in zip(ttft, k["requests"], strict=True)]
    mean, p50 = statistics.fmean(tt), pct(tt, 50)
    print(f"estimate, kvstream storage + shm-alone prefill: mean {mean:.2f} p50 {p50:.2f} "
          f"p99 {pct(tt, 99):.2f}; / lmcache-disk: mean {mean / ld['ttft_mean_s']:.2f} "
          f"p50 {p50 / ld['ttft_p50_s']:.2f}")

    for c in r["configs"]:
        if not c["ok"] or not c["batches"]:
            continue
        out = []
        for modeled in (False, True):
            clock, first, tt = 0.0, 0, []
            for b in c["batches"]:
                qs = c["requests"][first:first + b["requests"]]
                first += b["requests"]
                prefill = b["new_tokens"] / c["prefill_tokens_per_s"] if modeled \
                    else b["prefill_s"]
                clock = max(clock, qs[0]["arrival_s"]) + b["storage_s"] + prefill
                tt += [clock - q["arrival_s"] for q in qs]
            out.append(f"{pct(tt, 50) / c['ttft_p50_s'] - 1:+.0%}")
        per_k = [round(b["prefill_s"] / max(b["new_tokens"], 1) * 1e3, 3) for b in c["batches"]]
        print(f"{c['name']:14s} p50 rebuilt from its batches {out[0]}, with kvsim's prefill "
              f"model {out[1]}; prefill s per 1k new tokens by batch {per_k}")


if __name__ == "__main__":
    main(sys.argv[1])
