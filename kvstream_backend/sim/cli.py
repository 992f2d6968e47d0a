"""``kvstream sim``: argument parsing and the printed summary (the model is in :mod:`.replay`)."""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

from ..argtypes import floats as _floats

TRACES = Path(__file__).resolve().parent / "traces"
BUNDLED = {"conversation": "mooncake_conversation_trace.jsonl.gz",
           "synthetic": "mooncake_synthetic_trace.jsonl.gz"}  # see traces/NOTICE.md


def trace_path(name: str) -> str:
    """A bundled trace's path by name, or ``name`` itself (a file)."""
    return str(TRACES / BUNDLED[name]) if name in BUNDLED else name


def add_sim_parser(sub: Any) -> None:
    p = sub.add_parser("sim", help="replay a request trace through the performance model",
                       description="Trace-driven simulator of KVStream's performance model "
                       "(see kvstream_backend/sim/replay.py for the model).")
    p.add_argument("--trace", default="conversation",
                   help="a trace file (.jsonl or .jsonl.gz), or the name of a bundled Mooncake "
                   f"trace: {', '.join(BUNDLED)} (default: conversation)")
    p.add_argument("--format", choices=["mooncake", "simple"], default="mooncake")
    p.add_argument("--kv-bytes-per-token", type=int, required=True)
    p.add_argument("--host-mem-gb", type=_floats, required=True, help="M[,M2,...]")
    p.add_argument("--gpu-mem-gb", type=float, default=0.0)
    p.add_argument("--tier-bw", type=_floats, required=True, help="B0,B1 in GB/s")
    p.add_argument("--bw-jitter", type=float, default=0.0, help="relative per-step drift")
    p.add_argument("--rate-scale", type=float, default=1.0, help="arrival rate multiplier")
    p.add_argument("--order", choices=["trace", "round-robin", "random"], default="trace")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--block-tokens", type=int, default=512)
    p.add_argument("--max-batch", type=int, default=8)
    p.add_argument("--prefill-tokens-per-s", type=float, default=40000.0,
                   help="prefill compute throughput of the serving engine")
    p.add_argument("--claim-batch", type=int, default=4)
    p.add_argument("--limit", type=int, default=0, help="only the first N requests")
    p.add_argument("--json", metavar="OUT", help="write the full report")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    import msgspec
    from rich.console import Console

    from .replay import SimParams
    from .replay import run as replay

    err = Console(stderr=True)
    if len(args.tier_bw) != 2 or min(args.tier_bw) <= 0:
        err.print("[red]error:[/] --tier-bw needs two positive bandwidths, e.g. 3,1")
        return 2
    if not 0 <= args.bw_jitter < 1 or args.rate_scale <= 0:
        err.print("[red]error:[/] need 0 <= --bw-jitter < 1 and --rate-scale > 0")
        return 2
    p = SimParams(args.kv_bytes_per_token, args.gpu_mem_gb, tuple(args.tier_bw),
                  args.bw_jitter, args.rate_scale, args.block_tokens, args.max_batch,
                  args.prefill_tokens_per_s, claim_batch=args.claim_batch, seed=args.seed)
    try:
        rep = replay(trace_path(args.trace), args.format, args.host_mem_gb, p, args.order,
                     args.limit)
    except (OSError, ValueError) as e:
        err.print(f"[red]error:[/] {e}")
        return 2
    con = Console()
    render(rep, args.trace, con)
    if args.json:
        with open(args.json, "wb") as f:
            f.write(msgspec.json.format(msgspec.json.encode(rep)))
    return 0


def render(rep: Any, trace: str, console: Any) -> None:
    """``rep``: a :class:`~kvstream_backend.sim.replay.SimReport`."""
    from ..tables import table

    t = table(f"kvstream sim: {rep.requests} requests from {trace}", "host GB: policy",
              "sim GB", "Eq.2 GB", "retr s", "gap", "mean", "p50", "p90", "req/s")
    for m in rep.memory:
        for i, pol in enumerate(m.policies):
            demand = [f"{m.simulated_demand_bytes / 1e9:.1f}",
                      f"{m.predicted_demand_bytes / 1e9:.1f}"] if i == 0 else ["", ""]
            t.add_row(f"{m.host_mem_gb:g}: {pol.name}", *demand, f"{pol.retrieval_s_total:.1f}",
                      f"{pol.gap_to_bound_mean:+.0%}", f"{pol.ttft_mean_s:.2f}",
                      f"{pol.ttft_p50_s:.2f}", f"{pol.ttft_p90_s:.2f}",
                      f"{pol.throughput_req_s:.2f}")
    console.print(t)
    console.print("sim GB: the demand on storage simulated; Eq.2 GB: the paper's prediction; "
                  "retr s: retrieval time in all; gap: to the aggregate-bandwidth bound; mean, "
                  "p50, p90: TTFT in seconds")
    if rep.demand_correlation is not None:
        console.print(f"correlation of simulated and Eq. 2 demand: {rep.demand_correlation:.4f}")
