"""What a trace replay serves, decided before anything runs: pure, no I/O but the trace file.

* **The segment.** The ``n`` consecutive requests that arrive within the shortest time (the
  trace's burstiest stretch); arrivals are relative to the segment's first and divided by
  ``time_scale`` (the README states the scale of each recorded run).
* **Hits.** A request's cached prefix is the leading run of its blocks (Mooncake ``hash_ids``,
  512 tokens each, prefix-chained: equal ids mean an equal prefix) that some earlier request of
  the trace, inside or before the segment, already had. That prefix is retrieved; the rest of
  the prompt is prefilled. LMCache stores 256-token chunks, so hits are whole blocks.
* **Serving.** First come, first served, with a token budget per batch like vLLM's
  ``max_num_batched_tokens``: a batch takes queued requests in arrival order while the tokens to
  prefill fit (the first always goes, however long). All requests of a batch get their first
  token when the batch's forward ends.
"""

from __future__ import annotations

from collections.abc import Sequence

import msgspec

from .replay import Request

BLOCK_TOKENS = 512


class PlannedRequest(msgspec.Struct, frozen=True):
    """One request of the segment: when it arrives (s, scaled), its prefix blocks, how many of
    them are cached (a leading run), and its prompt length."""

    index: int  # in the trace
    arrival_s: float
    blocks: tuple[int, ...]
    hit_blocks: int
    input_tokens: int

    @property
    def hit_tokens(self) -> int:
        return min(self.hit_blocks * BLOCK_TOKENS, self.input_tokens // 256 * 256)

    @property
    def new_tokens(self) -> int:
        return self.input_tokens - self.hit_tokens


class TracePlan(msgspec.Struct, frozen=True):
    trace: str
    start: int  # the segment's first request in the trace
    time_scale: float
    token_budget: int
    requests: list[PlannedRequest]

    @property
    def cached_blocks(self) -> list[tuple[int, ...]]:
        """The distinct cached prefixes to store before the replay, longest first, without
        one that is a prefix of another (storing the longer stores both)."""
        out: list[tuple[int, ...]] = []
        for p in sorted({r.blocks[:r.hit_blocks] for r in self.requests if r.hit_blocks},
                        key=len, reverse=True):
            if not any(q[:len(p)] == p for q in out):
                out.append(p)
        return out


def burstiest(arrivals: Sequence[float], n: int) -> int:
    """The first index of the ``n`` consecutive arrivals that span the least time."""
    if n >= len(arrivals):
        return 0
    return min(range(len(arrivals) - n + 1), key=lambda i: arrivals[i + n - 1] - arrivals[i])


def leading_hits(reqs: Sequence[Request]) -> list[int]:
    """For each request, how many of its leading blocks an earlier request had."""
    seen: set[int] = set()
    out = []
    for r in reqs:
        h = 0
        for b in r.blocks:
            if b not in seen:
                break
            h += 1
        out.append(h)
        seen.update(r.blocks)
    return out


def plan(trace: str, reqs: Sequence[Request], n: int, time_scale: float,
         token_budget: int) -> TracePlan:
    """The burstiest ``n`` requests of ``reqs`` (a whole trace, in order)."""
    if n <= 0 or time_scale <= 0 or token_budget <= 0:
        raise ValueError("n, time_scale and token_budget must be positive")
    start = burstiest([r.arrival_s for r in reqs], n)
    hits = leading_hits(reqs)
    t0 = reqs[start].arrival_s
    out = [PlannedRequest(i, (reqs[i].arrival_s - t0) / time_scale, reqs[i].blocks, hits[i],
                          reqs[i].input_tokens)
           for i in range(start, min(start + n, len(reqs)))]
    return TracePlan(trace, start, time_scale, token_budget, out)


def next_batch(queue: Sequence[PlannedRequest], budget: int, recompute: bool = False) -> int:
    """How many of the queued requests (in arrival order) the next batch takes: while the
    tokens to prefill fit in ``budget``, and at least one. ``recompute``: no cache, so every
    prompt token is prefilled."""
    used, k = 0, 0
    for r in queue:
        need = r.input_tokens if recompute else r.new_tokens
        if k and used + need > budget:
            break
        used += need
        k += 1
    return k


class PrefillModel(msgspec.Struct, frozen=True):
    """The serving engine's prefill of one request: ``new`` tokens attending over ``prefix``
    cached tokens and over themselves (causally) takes::

        per_request_s + per_token_s * new + per_pair_s * new**2 / 2
                      + per_prefix_pair_s * new * prefix + per_prefix_token_s * prefix
                      + per_prefixed_pair_s * new**2 / 2   (only where prefix > 0)

    a forward's fixed cost, the projections and MLP per token, attention among the new tokens,
    attention of the new tokens over the prefix, bringing the prefix's KV into the forward, and
    what attention among the new tokens costs extra once there is a prefix at all (the stand-in's
    attention then takes a masked kernel: on an H200, 34182 new tokens took 1.85 s over a
    512-token prefix and 34694 took 1.49 s over none, a gap the ``new * prefix`` term cannot
    make).
    A batch prefills its requests one after another (the stand-in does), so it takes their sum.
    """

    per_request_s: float = 0.0
    per_token_s: float = 0.0
    per_pair_s: float = 0.0
    per_prefix_pair_s: float = 0.0
    per_prefix_token_s: float = 0.0
    per_prefixed_pair_s: float = 0.0

    @classmethod
    def at_rate(cls, tokens_per_s: float) -> PrefillModel:
        """The one-term model: every new token at the same rate."""
        return cls(per_token_s=1.0 / tokens_per_s)

    @staticmethod
    def terms(new: int, prefix: int) -> tuple[float, ...]:
        pairs = new * new / 2.0
        return (1.0, float(new), pairs, float(new * prefix), float(prefix),
                pairs if prefix else 0.0)

    def seconds(self, new: int, prefix: int) -> float:
        return sum(c * t for c, t in zip(msgspec.structs.astuple(self),
                                         self.terms(new, prefix), strict=True))

    @classmethod
    def fit(cls, samples: Sequence[tuple[int, int, float]]) -> PrefillModel:
        """Least squares over timed ``(new, prefix, seconds)`` prefills, every coefficient
        non-negative: a term whose coefficient comes out negative is dropped and the rest are
        fitted again (a time cannot shrink as a shape grows)."""
        import numpy as np

        x = np.array([cls.terms(n, p) for n, p, _ in samples])
        y = np.array([t for _, _, t in samples])
        scale = np.maximum(np.abs(x).max(axis=0), 1e-30)  # columns span 1 .. 1e9: condition
        keep = [i for i in range(x.shape[1]) if x[:, i].any()]
        while True:
            coef, *_ = np.linalg.lstsq(x[:, keep] / scale[keep], y, rcond=None)
            coef = coef / scale[keep]
            if not keep or coef.min() >= 0:
                break
            del keep[int(coef.argmin())]
        full = [0.0] * x.shape[1]
        for i, c in zip(keep, coef, strict=True):
            full[i] = float(c)
        return cls(*full)


class Serving(msgspec.Struct, frozen=True):
    """kvsim's model of one configuration serving a plan.

    A batch's retrieval takes its storage read (``tiers_gbps``: one tier, or two tiers routed by
    kvstream's claims, or split statically by ``split``; empty: nothing read from storage)
    plus its host->GPU copy at ``h2d_gbps`` (LMCache copies each request after reading it);
    its prefill is ``prefill``'s, request by request. ``recompute``: no cache at all.
    """

    name: str
    tiers_gbps: tuple[float, ...]
    h2d_gbps: float
    prefill: PrefillModel
    kv_bytes_per_token: int
    split: float | None = None
    recompute: bool = False
    claim_batch: int = 4


def predict(p: TracePlan, s: Serving) -> list[float]:
    """Each request's TTFT (s), in plan order, under the same FCFS batching as the replay."""
    from ..policy.model import simulate_routed, simulate_static

    reqs = p.requests
    ttft: list[float] = []
    queue: list[PlannedRequest] = []
    nxt, clock = 0, 0.0
    chunk = 256 * s.kv_bytes_per_token
    while nxt < len(reqs) or queue:
        while nxt < len(reqs) and reqs[nxt].arrival_s <= clock:
            queue.append(reqs[nxt])
            nxt += 1
        if not queue:
            clock = reqs[nxt].arrival_s
            continue
        k = next_batch(queue, p.token_budget, s.recompute)
        batch, queue = queue[:k], queue[k:]
        retrieval = 0.0
        if not s.recompute:
            demand = sum(r.hit_tokens for r in batch) * s.kv_bytes_per_token
            n = demand // chunk
            bws = [b * 1e9 for b in s.tiers_gbps]
            if n and len(bws) == 1:
                retrieval = demand / bws[0]
            elif n and s.split is not None:
                retrieval = simulate_static(n, chunk, bws, [s.split, 1 - s.split]).time_s
            elif n and bws:
                retrieval = simulate_routed(n, chunk, bws, s.claim_batch).time_s
            retrieval += demand / (s.h2d_gbps * 1e9)
        clock += retrieval + sum(
            s.prefill.seconds(r.input_tokens, 0) if s.recompute
            else s.prefill.seconds(r.new_tokens, r.hit_tokens) for r in batch)
        ttft.extend(clock - r.arrival_s for r in batch)
    return ttft
