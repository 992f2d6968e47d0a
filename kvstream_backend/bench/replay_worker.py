"""One configuration of the trace replay (``kvstream bench --gpu --trace``), in its own process:
``python -m kvstream_backend.bench.replay_worker SPEC.json``.

* **Store** (``store``): every cached prefix of the plan is written through LMCache's engine
  with the paged GPU connector, its KV generated on the GPU from the block ids (so a later
  process regenerates the same bytes), then flushed to every tier.
  ``replay: false`` stops there (the orchestrator fills kvstream's tiers in a process of its
  own, so that every replay process starts from the same state).
* **Replay**: requests arrive on the wall clock at the plan's (scaled) times; batches are formed
  FCFS under the token budget (:func:`~kvstream_backend.sim.plan.next_batch`). A batch is what
  vLLM does with LMCache: a lookup with pins for each request (kvstream starts its pooled reads
  there), then per request ``retrieve`` into the paged KV pool, then the stand-in prefill of
  each request's new tokens attending over its retrieved prefix. A request's TTFT is its
  batch's end minus its arrival; ``storage_s`` is the batch's lookups-to-last-retrieve.
* **Bytes verified**: after each batch every retrieved request's KV is checked on the GPU
  against a per-block checksum of what was stored (the int64 sum of the bf16 bit patterns,
  layers and K/V together, over the request's slots); a mismatch fails the run.
* **The prefill stand-in** is a real forward pass of a model of the stated shape (transformers'
  ``LlamaModel``, random bf16 weights, SDPA's flash kernel with a lower-right causal bias:
  :func:`lower_right_attention`) over the new tokens with the retrieved KV
  as its cache, one request after another, and the LM head on the last position only. It is not
  vLLM's prefill (no paged attention kernels, no batching across requests, no CUDA graphs):
  docs/benchmarks.md says how that differs.

``KVSTREAM_GPU_DRY=1`` (CPU tests only): the connector is the torch reference and the model is
tiny; the orchestrator labels such a run as not a measurement.
"""

from __future__ import annotations

import collections
import json
import os
import sys
import time
from typing import Any

import msgspec

from ..sim.plan import BLOCK_TOKENS, PlannedRequest, TracePlan, next_batch
from .gpu_worker import DRY, Shape, build_engine, cuda_ops, kvstream_backend_of, wait_local_disk


class ModelShape(msgspec.Struct, frozen=True):
    """The stand-in model (Llama-3.1-8B by default) and vLLM's KV block size."""

    layers: int = 32
    hidden: int = 4096
    heads: int = 32
    kv_heads: int = 8
    head_dim: int = 128
    intermediate: int = 14336
    vocab: int = 128256
    block_size: int = 16

    @property
    def kv_bytes_per_token(self) -> int:
        return self.layers * 2 * self.kv_heads * self.head_dim * 2


class ReplaySpec(msgspec.Struct, frozen=True):
    config: str
    lmcache: dict[str, Any]  # {} for "nocache"
    plan: TracePlan
    model: ModelShape
    work: str
    store: bool  # store the plan's cached prefixes first (in this process)
    recompute: bool = False  # "nocache": prefill every prompt token
    replay: bool = True  # False: store only (the phase that fills kvstream's tiers)
    calibrate: bool = False  # time the stand-in at every request's shapes (kvsim's prefill)
    pool_tokens: int = 393216  # the paged KV pool (vLLM's GPU KV cache)


class RequestResult(msgspec.Struct):
    index: int
    arrival_s: float
    batch: int
    hit_tokens: int
    retrieved_tokens: int
    new_tokens: int
    ttft_s: float
    storage_s: float  # its batch's retrieval (the storage wait), shared by the batch
    prefill_s: float  # its batch's stand-in prefill


def _dev() -> Any:
    import torch

    return torch.device("cpu") if DRY else torch.device("cuda:0")


def _sync() -> None:
    import torch

    if not DRY:
        torch.cuda.synchronize()


def _block_tokens(b: int, vocab: int) -> Any:
    import torch

    g = torch.Generator().manual_seed(1_000_003 + b)
    return torch.randint(0, vocab, (BLOCK_TOKENS,), generator=g, dtype=torch.long)


def _tokens(r: PlannedRequest, vocab: int, n: int | None = None) -> Any:
    import torch

    n = r.input_tokens if n is None else n
    need = -(-n // BLOCK_TOKENS)
    blocks = list(r.blocks[:need])
    while len(blocks) < need:  # a prompt longer than its listed blocks: unique filler
        blocks.append(-1 - r.index * 1000 - len(blocks))
    return torch.cat([_block_tokens(b, vocab) for b in blocks])[:n]


def _block_kv(b: int, m: ModelShape) -> Any:
    """The KV of block ``b``: [layers, 2, 512, kv_heads, head_dim] bf16, from a seed."""
    import torch

    g = torch.Generator(device=_dev()).manual_seed(7 + b)
    return torch.randn((m.layers, 2, BLOCK_TOKENS, m.kv_heads, m.head_dim), generator=g,
                       dtype=torch.bfloat16, device=_dev())


CHUNK_TOKENS = 256  # LMCache's chunk: a block of the trace is two


def _chunk_sums(b: int, m: ModelShape) -> tuple[int, int]:
    """The checksums of block ``b``'s two 256-token chunks (LMCache's unit)."""
    import torch

    kv, n = _block_kv(b, m), CHUNK_TOKENS
    return tuple(int(kv[:, :, h * n:(h + 1) * n].contiguous().view(torch.int16)  # type: ignore[return-value]
                     .sum(dtype=torch.int64).item()) for h in (0, 1))


class _Pool:
    """vLLM's paged KV cache: per layer [2, blocks, block_size, kv_heads, head_dim]."""

    def __init__(self, m: ModelShape, tokens: int) -> None:
        import torch

        self.m = m
        nb = tokens // m.block_size
        self.kv = [torch.zeros((2, nb, m.block_size, m.kv_heads, m.head_dim),
                               dtype=torch.bfloat16, device=_dev()) for _ in range(m.layers)]
        self.tokens = nb * m.block_size

    def flat(self, layer: int) -> Any:
        return self.kv[layer].view(2, -1, self.m.kv_heads, self.m.head_dim)

    def write(self, slots: Any, kv: Any) -> None:
        """kv: [layers, 2, n, kv_heads, head_dim] into ``slots``."""
        for li in range(self.m.layers):
            self.flat(li)[:, slots] = kv[li]

    def checksum(self, slots: Any) -> int:
        import torch

        total = torch.zeros((), dtype=torch.int64, device=_dev())
        for li in range(self.m.layers):
            total += self.flat(li)[:, slots].view(torch.int16).sum(dtype=torch.int64)
        return int(total.item())


def _store(eng: Any, spec: ReplaySpec, pool: _Pool) -> dict[str, Any]:
    import torch

    m = spec.model
    t = time.perf_counter()
    nbytes = 0
    for prefix in spec.plan.cached_blocks:
        n = len(prefix) * BLOCK_TOKENS
        slots = torch.arange(n, device=_dev())
        for j, b in enumerate(prefix):
            pool.write(slots[j * BLOCK_TOKENS:(j + 1) * BLOCK_TOKENS], _block_kv(b, m))
        tokens = torch.cat([_block_tokens(b, m.vocab) for b in prefix])
        eng.store(tokens, mask=torch.ones(n, dtype=torch.bool), kvcaches=pool.kv,
                  slot_mapping=slots, offset=0, req_id=f"store-{prefix[0]}-{len(prefix)}")
        nbytes += n * m.kv_bytes_per_token
    _sync()
    kb = kvstream_backend_of(eng)
    flushed = kb.engine.flush(1800) if kb is not None else None
    if kb is None:
        wait_local_disk(eng, [torch.cat([_block_tokens(b, m.vocab) for b in p])
                              for p in spec.plan.cached_blocks])
    store_s = time.perf_counter() - t
    missing = 0  # every stored prefix must be found whole, or the replay's hits would be short
    for prefix in spec.plan.cached_blocks:
        tokens = torch.cat([_block_tokens(b, m.vocab) for b in prefix])
        missing += len(tokens) - eng.lookup(tokens=tokens, lookup_id=f"check-{prefix[0]}",
                                            pin=False)
    if missing:
        raise RuntimeError(f"store: {missing} of the cached prefixes' tokens are not found "
                           "after the store")
    return {"store_s": round(store_s, 2), "stored_bytes": nbytes,
            "prefixes": len(spec.plan.cached_blocks), "flushed": flushed}


ATTENTION = "kvstream_lower_right"  # the stand-in's attention, registered with transformers


def lower_right_attention(module: Any, query: Any, key: Any, value: Any, attention_mask: Any,
                          dropout: float = 0.0, scaling: float | None = None,
                          **_: Any) -> tuple[Any, None]:
    """Causal attention of the new tokens over prefix + new tokens, aligned to the lower right
    (query ``i`` of ``Lq`` sees keys ``0 .. Lk - Lq + i``), through SDPA's ``CausalBias``: the
    flash kernel, with no mask materialized, with or without a cached prefix. (transformers'
    ``sdpa`` builds an explicit mask as soon as there is a prefix, which leaves the fast path:
    on an H100 that made a prefill over a cached prefix cost 1.5-2.3x what a two-term fit on
    the uncached run predicts.) ``attention_mask`` is None: no mask function is registered
    under :data:`ATTENTION`. query [B, H, Lq, D], key/value [B, H_kv, Lk, D] ->
    [B, Lq, H, D]."""
    import torch
    from torch.nn.attention.bias import causal_lower_right

    b, kvh, lk, d = key.shape
    rep = query.shape[1] // kvh
    if rep > 1:  # grouped-query: each KV head serves ``rep`` query heads (transformers' repeat_kv)
        key = key[:, :, None].expand(b, kvh, rep, lk, d).reshape(b, kvh * rep, lk, d)
        value = value[:, :, None].expand(b, kvh, rep, lk, d).reshape(b, kvh * rep, lk, d)
    lq = query.shape[2]
    out = torch.nn.functional.scaled_dot_product_attention(
        query, key, value, attn_mask=causal_lower_right(lq, lk) if lq > 1 else None,
        dropout_p=dropout, scale=scaling)
    return out.transpose(1, 2).contiguous(), None


def _model(m: ModelShape, attention: str = ATTENTION) -> Any:
    import torch
    from transformers import AttentionInterface, LlamaConfig, LlamaForCausalLM

    AttentionInterface.register(ATTENTION, lower_right_attention)
    kw: dict[str, Any] = {  # (rope_theta, attn_implementation: passed through **kwargs)
        "hidden_size": m.hidden, "intermediate_size": m.intermediate,
        "num_hidden_layers": m.layers, "num_attention_heads": m.heads,
        "num_key_value_heads": m.kv_heads, "head_dim": m.head_dim, "vocab_size": m.vocab,
        "max_position_embeddings": 262144, "rope_theta": 500000.0,
        "attn_implementation": attention}
    cfg = LlamaConfig(**kw)
    dtype = torch.get_default_dtype()
    torch.set_default_dtype(torch.bfloat16)  # random init straight in bf16, on the device
    try:
        with torch.device(_dev()):
            torch.manual_seed(0)
            model = LlamaForCausalLM(cfg).eval()
    finally:
        torch.set_default_dtype(dtype)
    return model


def _prefill(model: Any, m: ModelShape, pool: _Pool, tokens: Any, slots: Any) -> None:
    """The stand-in forward of ``tokens`` over the prefix KV at ``slots`` (none: no prefix)."""
    import torch
    from transformers import DynamicCache

    cache = DynamicCache()
    if slots is not None and len(slots):
        for li in range(m.layers):
            kv = pool.flat(li)[:, slots]  # [2, P, kv_heads, head_dim]
            cache.update(kv[0].transpose(0, 1).unsqueeze(0),
                         kv[1].transpose(0, 1).unsqueeze(0), li)
    p = 0 if slots is None else len(slots)
    with torch.inference_mode():
        ids = tokens[p:].to(_dev()).unsqueeze(0)
        pos = torch.arange(p, p + ids.shape[1], device=_dev()).unsqueeze(0)
        h = model.model(input_ids=ids, past_key_values=cache, position_ids=pos,
                        use_cache=True).last_hidden_state
        model.lm_head(h[:, -1:])


def _shapes(spec: ReplaySpec, pool: _Pool, recompute: bool) -> list[tuple[int, int]]:
    """Every request's prefill as ``(new, prefix)`` tokens: over its cached prefix, or (for
    ``recompute``) its whole prompt without one."""
    out = []
    for r in spec.plan.requests:
        p = 0 if recompute else min(r.hit_tokens // CHUNK_TOKENS * CHUNK_TOKENS, pool.tokens)
        out.append((max(r.input_tokens - p, 1), p))
    return out


def _prefill_shape(model: Any, m: ModelShape, pool: _Pool, new: int, prefix: int) -> None:
    import torch

    tokens = torch.randint(0, m.vocab, (prefix + new,))
    _prefill(model, m, pool, tokens, torch.arange(prefix, device=_dev()) if prefix else None)


def _warm_up(model: Any, spec: ReplaySpec, pool: _Pool) -> None:
    """Off the clock: the stand-in prefill at every request's own shape, then at the plan's
    largest (the most new tokens, and the longest prefix with a budget's worth of new tokens),
    so that its kernels are loaded and the allocator holds its largest blocks before the first
    batch. (Warmed at the largest shapes only, the first process on an H100 took 4.6 s for its
    first batch's prefill against 1.3-1.5 s in later processes, and in run 4 the no-cache
    process, the last, still took 1.45 s for a first batch that a fit of its others puts at
    0.5 s: a shape a process has not run before costs it extra once.)"""
    m, reqs = spec.model, spec.plan.requests
    for new, prefix in _shapes(spec, pool, spec.recompute):
        _prefill_shape(model, m, pool, new, prefix)
    new = min(max(r.input_tokens if spec.recompute else r.new_tokens for r in reqs),
              spec.plan.token_budget)
    prefix = 0 if spec.recompute else min(max(r.hit_tokens for r in reqs),
                                          pool.tokens - spec.plan.token_budget)
    for p, n in ((0, max(new, 1)), (prefix, min(new, 4096) or 1)):
        _prefill_shape(model, m, pool, n, p)
    _sync()


def _calibrate(model: Any, spec: ReplaySpec, pool: _Pool) -> list[tuple[int, int, float]]:
    """The stand-in's prefill timed at every request's shapes, with and without its cached
    prefix, apart from any configuration's replay: the samples kvsim's
    :class:`~kvstream_backend.sim.plan.PrefillModel` is fitted on. Each shape runs once
    untimed (warm) and once timed."""
    shapes = sorted(set(_shapes(spec, pool, False)) | set(_shapes(spec, pool, True)))
    m = spec.model
    for new, prefix in shapes:
        _prefill_shape(model, m, pool, new, prefix)
    out = []
    for new, prefix in shapes:
        _sync()
        t = time.perf_counter()
        _prefill_shape(model, m, pool, new, prefix)
        _sync()
        out.append((new, prefix, round(time.perf_counter() - t, 5)))
    return out


def _replay(eng: Any, spec: ReplaySpec, pool: _Pool, model: Any,
            sums: dict[int, tuple[int, int]]) -> tuple[list[RequestResult], list[dict]]:
    import torch

    m = spec.model
    reqs = spec.plan.requests
    queue: collections.deque[PlannedRequest] = collections.deque()
    results: list[RequestResult] = []
    batches: list[dict] = []
    nxt = 0
    t0 = time.perf_counter()
    while nxt < len(reqs) or queue:
        now = time.perf_counter() - t0
        while nxt < len(reqs) and reqs[nxt].arrival_s <= now:
            queue.append(reqs[nxt])
            nxt += 1
        if not queue:
            time.sleep(max(0.0, reqs[nxt].arrival_s - now))
            continue
        k = next_batch(list(queue), spec.plan.token_budget, spec.recompute)
        batch = [queue.popleft() for _ in range(k)]
        bi = len(batches)
        tb = time.perf_counter()
        toks = [_tokens(r, m.vocab) for r in batch]
        got = [0] * k
        slot_of: list[Any] = [None] * k
        if eng is not None:
            ids = [f"b{bi}-r{r.index}" for r in batch]
            hits = [eng.lookup(tokens=t[:r.hit_tokens], lookup_id=i, pin=True) if r.hit_tokens
                    else 0 for r, t, i in zip(batch, toks, ids, strict=True)]
            at = 0
            for j, n in enumerate(hits):
                if n > 0:
                    if at + n > pool.tokens:
                        raise RuntimeError(f"batch {bi}: {at + n} retrieved tokens exceed the "
                                           f"KV pool of {pool.tokens}")
                    slots = torch.arange(at, at + n, device=_dev())
                    mask = eng.retrieve(toks[j][:n], torch.ones(n, dtype=torch.bool),
                                        kvcaches=pool.kv, slot_mapping=slots,
                                        vllm_cached_tokens=0, request_configs=None,
                                        req_id=ids[j])
                    got[j] = int(mask.sum().item())
                    slot_of[j] = slots[:got[j]]
                    at += n
                eng.lookup_unpin(ids[j])
            _sync()
        storage_s = time.perf_counter() - tb
        tp = time.perf_counter()
        for j in range(k):
            _prefill(model, m, pool, toks[j], None if spec.recompute else slot_of[j])
        _sync()
        end = time.perf_counter()
        prefill_s = end - tp
        for j, r in enumerate(batch):  # verified outside the TTFT, before the pool is reused
            if got[j]:
                chunks = got[j] // CHUNK_TOKENS
                want = sum(sums[r.blocks[c // 2]][c % 2] for c in range(chunks))
                if got[j] % CHUNK_TOKENS or pool.checksum(slot_of[j]) != want:
                    raise RuntimeError(f"request {r.index}: retrieved KV differs from what "
                                       "was stored")
            results.append(RequestResult(
                r.index, r.arrival_s, bi, r.hit_tokens, got[j],
                r.input_tokens - (0 if spec.recompute else got[j]),
                round(end - t0 - r.arrival_s, 4), round(storage_s, 4), round(prefill_s, 4)))
        batches.append({"start_s": round(tb - t0, 4), "requests": k,
                        "storage_s": round(storage_s, 4), "prefill_s": round(prefill_s, 4),
                        "retrieved_bytes": sum(got) * m.kv_bytes_per_token,
                        "new_tokens": sum(r.input_tokens - (0 if spec.recompute else g)
                                          for r, g in zip(batch, got, strict=True))})
    return results, batches


def run(spec: ReplaySpec) -> dict:
    import torch

    torch.set_num_threads(1)  # as vLLM's GPU worker serves
    rec: dict[str, Any] = {"config": spec.config, "ok": False, "dry_run": DRY,
                           "cuda_ops": cuda_ops()}
    m = spec.model
    pool = _Pool(m, spec.pool_tokens)
    sums = {b: _chunk_sums(b, m) for p in spec.plan.cached_blocks for b in p}
    eng = None
    if spec.lmcache:
        shape = Shape(m.layers, m.kv_heads, m.head_dim, m.block_size, 1, BLOCK_TOKENS)
        eng, _ = build_engine(spec.config, spec.lmcache, shape, spec.work)
    try:
        kb = kvstream_backend_of(eng) if eng is not None else None
        if kb is not None:
            kb.engine.wait_warm(300)
        if spec.store and eng is not None:
            rec["store"] = _store(eng, spec, pool)
        if spec.calibrate:
            rec["prefill_samples"] = _calibrate(_model(m), spec, pool)
        if not spec.replay:
            rec["ok"] = True
            return rec
        model = _model(m)
        _warm_up(model, spec, pool)
        results, batches = _replay(eng, spec, pool, model, sums)
        rec["requests"] = msgspec.to_builtins(results)
        rec["batches"] = batches
        if kb is not None:
            rec["kvstream"] = msgspec.to_builtins(kb.engine.stats())
        rec["ok"] = True
    finally:
        if eng is not None:
            from lmcache.v1.cache_engine import LMCacheEngineBuilder

            eng.close()
            LMCacheEngineBuilder.destroy("kvstream-bench")
    return rec


def main() -> None:
    for k, v in (("LMCACHE_TRACK_USAGE", "false"), ("DO_NOT_TRACK", "1"),
                 ("PYTHONHASHSEED", "0")):
        os.environ.setdefault(k, v)
    with open(sys.argv[1], "rb") as f:
        spec = msgspec.json.decode(f.read(), type=ReplaySpec)
    try:
        rec = run(spec)
    except Exception as e:  # noqa: BLE001 - reported to the orchestrator verbatim
        import traceback

        rec = {"config": spec.config, "ok": False, "error": f"{type(e).__name__}: {e}",
               "traceback": traceback.format_exc()[-3000:]}
    print("RESULT " + json.dumps(rec), flush=True)


if __name__ == "__main__":
    main()
