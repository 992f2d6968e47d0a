"""kvsim: replay a request trace through the KVStream performance model. Pure: no I/O but the
trace file, deterministic for a seed.

Model (README "kvstream sim" repeats it):

* **Blocks.** A request is its list of prefix blocks (Mooncake ``hash_ids``: 512 tokens each;
  equal ids are the same reusable prefix). A block's KV is ``block_tokens * kv_bytes_per_token``.
* **Where KV lives.** GPU memory (``--gpu-mem-gb``) and host memory (``--host-mem-gb``, LMCache's
  CPU tier) are LRU caches of blocks; storage (the tiers) holds every block ever computed
  (replicated on every tier). Host memory is inclusive: every block a request touches is
  (re)inserted there, so a block is in memory iff host LRU has it (GPU only adds when larger).
  Retrieval is by prefix, as in LMCache: at a request's first never-seen block the rest is
  recomputed. A block found in storage but not in memory is **storage demand**.
* **Eq. 2.** ``predicted_demand_bytes = V * Pr[d > M]``: V is the volume of reuses (accesses to
  blocks seen before) and d a reuse's stack distance in bytes (distinct bytes touched since that
  block's previous use), computed exactly with a Fenwick tree; for an LRU memory of M bytes a
  reuse misses iff d >= M, so prediction and simulation differ only through prefix cuts, batching
  and the GPU level.
* **Steps and time.** Requests queue FCFS on one serving engine; a step takes up to
  ``max_batch`` queued requests. Its retrieval time is that of the step's storage demand D over
  the tiers (bandwidths b_k drift per step by ``bw_jitter``, seeded), computed with the real
  :class:`~kvstream_backend.policy.routing.ClaimRouter` (kvstream), a static split g, or the
  first tier alone, at 256-token chunk granularity; the step cannot start computing before its
  KV is in.
  Compute time is ``step_overhead_s + new_tokens / prefill_tokens_per_s``. A request's TTFT is
  its step's end minus its arrival; arrivals are trace timestamps divided by ``rate_scale``.
"""

from __future__ import annotations

import collections
import gzip
import json
import random
import statistics
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field

import msgspec

from ..policy.model import simulate_routed, simulate_static

GB = 1e9
CHUNK_TOKENS = 256


class Request(msgspec.Struct, frozen=True):
    """One trace record: arrival (s), prompt length, and its prefix block ids."""

    arrival_s: float
    input_tokens: int
    blocks: tuple[int, ...]


class SimpleRecord(msgspec.Struct, forbid_unknown_fields=True):
    """The ``simple`` JSONL format: ``{"t": seconds, "blocks": [ids...], "tokens": N}``."""

    t: float
    blocks: list[int]
    tokens: int | None = None


class MooncakeRecord(msgspec.Struct):
    timestamp: float
    input_length: int
    hash_ids: list[int]
    output_length: int = 0


def load_trace(path: str, fmt: str, block_tokens: int) -> list[Request]:
    """Parse a trace; errors name the file and line."""
    out: list[Request] = []
    dec_m = msgspec.json.Decoder(MooncakeRecord)
    dec_s = msgspec.json.Decoder(SimpleRecord)
    with (gzip.open(path, "rb") if path.endswith(".gz") else open(path, "rb")) as f:
        for n, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                if fmt == "mooncake":
                    m = dec_m.decode(line)
                    out.append(Request(m.timestamp / 1000.0, m.input_length, tuple(m.hash_ids)))
                else:
                    s = dec_s.decode(line)
                    tokens = s.tokens if s.tokens is not None else len(s.blocks) * block_tokens
                    out.append(Request(s.t, tokens, tuple(s.blocks)))
            except msgspec.DecodeError as e:
                raise ValueError(f"{path}:{n}: not a {fmt} record: {e}") from None
    if not out:
        raise ValueError(f"{path}: no requests")
    return out


def reorder(reqs: list[Request], order: str, seed: int) -> list[Request]:
    """``trace`` keeps the order; ``random`` shuffles requests over the same arrival times;
    ``round-robin`` interleaves sessions (requests sharing a first block) one at a time."""
    if order == "trace":
        return reqs
    times = sorted(r.arrival_s for r in reqs)
    if order == "random":
        shuffled = list(reqs)
        random.Random(seed).shuffle(shuffled)
    else:
        sessions: dict[int, collections.deque[Request]] = collections.OrderedDict()
        for r in reqs:
            sessions.setdefault(r.blocks[0] if r.blocks else -1, collections.deque()).append(r)
        shuffled = []
        while sessions:
            for k in list(sessions):
                shuffled.append(sessions[k].popleft())
                if not sessions[k]:
                    del sessions[k]
    return [Request(t, r.input_tokens, r.blocks) for t, r in zip(times, shuffled, strict=True)]


class _Fenwick:
    def __init__(self, n: int) -> None:
        self.t = [0] * (n + 1)

    def add(self, i: int, v: int) -> None:
        i += 1
        while i < len(self.t):
            self.t[i] += v
            i += i & -i

    def prefix(self, i: int) -> int:  # sum of [0, i)
        s = 0
        while i > 0:
            s += self.t[i]
            i -= i & -i
        return s


def reuse_distances(reqs: Sequence[Request]) -> list[int]:
    """Stack distance (distinct blocks since the previous use) of every reuse, in order."""
    accesses = [b for r in reqs for b in r.blocks]
    bit = _Fenwick(len(accesses))
    last: dict[int, int] = {}
    out: list[int] = []
    for t, b in enumerate(accesses):
        p = last.get(b)
        if p is not None:
            out.append(bit.prefix(t) - bit.prefix(p + 1))
            bit.add(p, -1)
        bit.add(t, 1)
        last[b] = t
    return out


class _LRU:
    def __init__(self, capacity_blocks: int) -> None:
        self.cap = capacity_blocks
        self.d: collections.OrderedDict[int, None] = collections.OrderedDict()

    def __contains__(self, b: int) -> bool:
        return b in self.d

    def touch(self, b: int) -> None:
        if self.cap <= 0:
            return
        self.d[b] = None
        self.d.move_to_end(b)
        while len(self.d) > self.cap:
            self.d.popitem(last=False)


@dataclass
class Policy:
    name: str
    split: float | None = None  # None: kvstream routing; 1.0: first tier alone
    step_s: list[float] = field(default_factory=list)
    ttft_s: list[float] = field(default_factory=list)
    makespan_s: float = 0.0


class PolicyResult(msgspec.Struct):
    name: str
    retrieval_s_total: float
    retrieval_s_mean: float
    gap_to_bound_mean: float
    ttft_mean_s: float
    ttft_p50_s: float
    ttft_p90_s: float
    throughput_req_s: float


class MemoryResult(msgspec.Struct):
    host_mem_gb: float
    simulated_demand_bytes: int
    predicted_demand_bytes: int
    reuse_volume_bytes: int
    steps: int
    policies: list[PolicyResult]


class SimReport(msgspec.Struct):
    trace: str
    requests: int
    params: dict[str, float | int | str]
    memory: list[MemoryResult]
    demand_correlation: float | None


@dataclass(frozen=True)
class SimParams:
    kv_bytes_per_token: int
    gpu_mem_gb: float
    tier_bw_gbps: tuple[float, float]
    bw_jitter: float = 0.0
    rate_scale: float = 1.0
    block_tokens: int = 512
    max_batch: int = 8
    prefill_tokens_per_s: float = 40000.0
    step_overhead_s: float = 0.005
    claim_batch: int = 4
    static_splits: tuple[float, ...] = (0.5, 0.7, 0.9)
    seed: int = 0

    @property
    def block_bytes(self) -> int:
        return self.block_tokens * self.kv_bytes_per_token


def simulate(reqs: Sequence[Request], host_mem_gb: float, p: SimParams) -> MemoryResult:
    bb = p.block_bytes
    host = _LRU(int(host_mem_gb * GB // bb))
    gpu = _LRU(int(p.gpu_mem_gb * GB // bb))
    seen: set[int] = set()
    reqs = sorted(reqs, key=lambda r: r.arrival_s / p.rate_scale)
    rng = random.Random(p.seed)
    policies = [Policy("kvstream"), Policy("first-tier", 1.0)] + [
        Policy(f"static-{g}", g) for g in p.static_splits
    ]
    bound_sum = 0.0
    gaps: dict[str, list[float]] = {pol.name: [] for pol in policies}
    clocks = {pol.name: 0.0 for pol in policies}
    demand_total = 0
    i, steps = 0, 0
    chunk_bytes = CHUNK_TOKENS * p.kv_bytes_per_token
    while i < len(reqs):
        # The step's batch is formed from what the kvstream server has queued (same batches
        # for every policy, so they are compared on identical demand).
        now = max(clocks["kvstream"], reqs[i].arrival_s / p.rate_scale)
        batch = [reqs[i]]
        i += 1
        while (i < len(reqs) and len(batch) < p.max_batch
               and reqs[i].arrival_s / p.rate_scale <= now):
            batch.append(reqs[i])
            i += 1
        demand, new_tokens = 0, 0
        for r in batch:
            cut = False
            for b in r.blocks:
                if cut or b not in seen:
                    cut = True
                    new_tokens += p.block_tokens
                elif b not in host and b not in gpu:
                    demand += bb
                gpu.touch(b)
                host.touch(b)
                seen.add(b)
        new_tokens = min(new_tokens, sum(r.input_tokens for r in batch))
        demand_total += demand
        steps += 1
        b0, b1 = (bw * GB * (1 + p.bw_jitter * rng.uniform(-1, 1)) for bw in p.tier_bw_gbps)
        n_chunks = -(-demand // chunk_bytes)
        bound = demand / (b0 + b1)
        bound_sum += bound
        compute = p.step_overhead_s + new_tokens / p.prefill_tokens_per_s
        for pol in policies:
            if demand == 0:
                t_ret = 0.0
            elif pol.split is None:
                t_ret = simulate_routed(n_chunks, chunk_bytes, [b0, b1], p.claim_batch).time_s
            elif pol.split == 1.0:
                t_ret = n_chunks * chunk_bytes / b0
            else:
                t_ret = simulate_static(n_chunks, chunk_bytes, [b0, b1],
                                        [pol.split, 1 - pol.split]).time_s
            if bound > 0:
                gaps[pol.name].append(t_ret / bound - 1)
            start = max(clocks[pol.name], batch[-1].arrival_s / p.rate_scale)
            end = start + t_ret + compute
            clocks[pol.name] = end
            pol.step_s.append(t_ret)
            pol.ttft_s.extend(end - r.arrival_s / p.rate_scale for r in batch)
            pol.makespan_s = end
    dists = reuse_distances(reqs)
    m_blocks = host.cap
    v = len(dists) * bb
    pred = sum(1 for d in dists if d >= m_blocks) * bb
    first = reqs[0].arrival_s / p.rate_scale
    return MemoryResult(
        host_mem_gb, demand_total, pred, v, steps,
        [PolicyResult(
            pol.name, sum(pol.step_s), statistics.fmean(pol.step_s),
            statistics.fmean(gaps[pol.name]) if gaps[pol.name] else 0.0,
            statistics.fmean(pol.ttft_s), _pct(pol.ttft_s, 50), _pct(pol.ttft_s, 90),
            len(reqs) / max(pol.makespan_s - first, 1e-9),
        ) for pol in policies],
    )


def _pct(xs: list[float], q: float) -> float:
    s = sorted(xs)
    return s[min(len(s) - 1, int(round(q / 100 * (len(s) - 1))))]


def correlation(xs: Iterable[float], ys: Iterable[float]) -> float | None:
    a, b = list(xs), list(ys)
    if len(a) < 2 or statistics.pstdev(a) == 0 or statistics.pstdev(b) == 0:
        return None
    return statistics.correlation(a, b)


def run(trace: str, fmt: str, host_mem_gb: Sequence[float], p: SimParams, order: str,
        limit: int = 0) -> SimReport:
    reqs = load_trace(trace, fmt, p.block_tokens)
    reqs = reorder(reqs[:limit] if limit else reqs, order, p.seed)
    mems = [simulate(reqs, m, p) for m in host_mem_gb]
    params: dict[str, float | int | str] = {
        k: (v if isinstance(v, int | float | str) else json.dumps(v))
        for k, v in vars(p).items()
    }
    params["order"] = order
    return SimReport(trace, len(reqs), params, mems,
                     correlation([m.simulated_demand_bytes for m in mems],
                                 [m.predicted_demand_bytes for m in mems]))
