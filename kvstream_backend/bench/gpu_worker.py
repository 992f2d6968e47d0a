"""One phase of ``kvstream bench --gpu``, in its own process (so every retrieve starts cold, as
a restarted vLLM worker does): ``python -m kvstream_backend.bench.gpu_worker SPEC_JSON``.

The engine is built the way vLLM's ``LMCacheConnectorV1`` builds it, without vLLM:
``LMCacheEngineConfig.from_file`` -> ``LMCacheMetadata`` -> ``CreateGPUConnector(EngineType.VLLM)``
(LMCache picks ``VLLMPagedMemGPUConnectorV2``) -> ``LMCacheEngineBuilder.get_or_create`` ->
``post_init``. KV lives in vLLM's paged layout on ``cuda:0``, one ``[2, blocks, block_size,
kv_heads, head_dim]`` tensor per layer. A step is what vLLM does for a batch: ``lookup(pin=True)``
for every request (LMCache's lookup server; kvstream starts its reads here), then per request
``retrieve`` with the paged connector and ``lookup_unpin``. Every retrieved byte is compared on
the device with the KV that was stored (regenerated from the seed in a fresh process).

Instrumentation (for the timeline): when each chunk was delivered by kvstream, when each get
returned, and how long each ``batched_to_gpu`` (the host->GPU scatter) took.

``KVSTREAM_GPU_DRY=1`` (tests on a CPU machine only) replaces the CUDA connector with a torch
reference copy on the CPU, so the orchestration can be tested where no GPU exists; the bench
refuses to report such a run as a GPU measurement.
"""

from __future__ import annotations

import json
import os
import sys
import time
from typing import Any

import msgspec

DRY = os.environ.get("KVSTREAM_GPU_DRY") == "1"
MODEL = "kvstream-bench/llama-3.1-8b-shape"
SEED = 1234


class Shape(msgspec.Struct, frozen=True):
    layers: int
    kv_heads: int
    head_dim: int
    block_size: int
    requests: int
    tokens: int  # per request
    chunk: int = 256

    @property
    def blocks_per_request(self) -> int:
        return self.tokens // self.block_size

    @property
    def num_blocks(self) -> int:
        return self.requests * self.blocks_per_request + 64

    @property
    def step_bytes(self) -> int:
        return self.requests * self.tokens * self.layers * 2 * self.kv_heads * self.head_dim * 2


class Phase(msgspec.Struct, frozen=True):
    """What the orchestrator asks of one worker process."""

    kind: str  # "store", "retrieve", "same" (store then retrieve here: the LocalCPU ceiling)
    config: str  # a label for the table
    lmcache: dict[str, Any]  # the LMCache YAML, as a dict
    shape: Shape
    work: str
    iters: int = 1
    torch_threads: int = 1  # torch intra-op threads (0: torch's default, one per core)
    warmup: bool = True  # retrieve phases: make the GPU connector's first call before step 0


def device() -> Any:
    import torch

    return torch.device("cpu") if DRY else torch.device("cuda:0")


def _sync() -> None:
    import torch

    if not DRY:
        torch.cuda.synchronize()


class _RefConnector:
    """Dry run on a CPU machine only: a torch reference of the paged <-> chunk copies."""

    def __init__(self, s: Shape) -> None:
        self.s = s

    def _io(self, obj: Any, start: int, end: int, kw: dict, to_gpu: bool) -> None:
        s = self.s
        sm = kw["slot_mapping"][start:end]
        t = obj.tensor
        for layer, x in enumerate(kw["kvcaches"]):
            flat = x.view(2, -1, s.kv_heads * s.head_dim)
            if to_gpu:
                flat[:, sm] = t[:, layer, : end - start]
            else:
                t[:, layer, : end - start] = flat[:, sm]

    def batched_from_gpu(self, objs, starts, ends, **kw):  # noqa: ANN001, ANN201
        for o, a, b in zip(objs, starts, ends, strict=True):
            self._io(o, a, b, kw, False)

    def batched_to_gpu(self, objs, starts, ends, **kw):  # noqa: ANN001, ANN201
        for o, a, b in zip(objs, starts, ends, strict=True):
            self._io(o, a, b, kw, True)

    def get_shape(self, n: int):  # noqa: ANN201
        import torch

        return torch.Size([2, self.s.layers, n, self.s.kv_heads * self.s.head_dim])


def build_engine(config_name: str, lmcache: dict[str, Any], s: Shape,
                 work: str) -> tuple[Any, Any]:
    """An LMCache engine as vLLM's ``LMCacheConnectorV1`` builds it, and its GPU connector."""
    import torch
    import yaml
    from lmcache.utils import EngineType
    from lmcache.v1.cache_engine import LMCacheEngineBuilder
    from lmcache.v1.config import LMCacheEngineConfig
    from lmcache.v1.metadata import LMCacheMetadata

    path = os.path.join(work, f"lmcache-{config_name}.yaml")
    with open(path, "w") as f:
        yaml.safe_dump(lmcache, f)
    config = LMCacheEngineConfig.from_file(path)
    meta = LMCacheMetadata(model_name=MODEL, world_size=1, local_world_size=1, worker_id=0,
                           local_worker_id=0, kv_dtype=torch.bfloat16,
                           kv_shape=(s.layers, 2, s.chunk, s.kv_heads, s.head_dim),
                           use_mla=False, role="worker", chunk_size=s.chunk)
    if DRY:
        conn: Any = _RefConnector(s)
    else:
        from lmcache.v1.gpu_connector import CreateGPUConnector

        conn = CreateGPUConnector(config, meta, EngineType.VLLM, layout_hints={"kv_layout": "NHD"})
    eng = LMCacheEngineBuilder.get_or_create("kvstream-bench", config, meta, conn,
                                             lambda tensor, src: tensor, lambda obj, src: obj)
    eng.post_init()
    return eng, conn


def kvstream_backend_of(eng: Any) -> Any:
    return eng.storage_manager.storage_backends.get("kvstream")


def _workload(s: Shape) -> tuple[list, Any, Any]:
    import torch

    g = torch.Generator().manual_seed(SEED)
    tokens = [torch.randint(0, 128000, (s.tokens,), generator=g, dtype=torch.long)
              for _ in range(s.requests)]
    n = s.requests * s.blocks_per_request
    blocks_s = torch.randperm(s.num_blocks, generator=g)[:n].view(s.requests, -1)
    blocks_r = torch.randperm(s.num_blocks, generator=g)[:n].view(s.requests, -1)
    return tokens, blocks_s, blocks_r


def _slots(blocks: Any, bs: int) -> Any:
    import torch

    return (blocks[:, None] * bs + torch.arange(bs)[None, :]).reshape(-1)


def _kv(s: Shape, zero: bool) -> list:
    import torch

    shape = (2, s.num_blocks, s.block_size, s.kv_heads, s.head_dim)
    dev = device()
    if zero:
        return [torch.zeros(shape, dtype=torch.bfloat16, device=dev) for _ in range(s.layers)]
    g = torch.Generator(device=dev).manual_seed(SEED)
    return [torch.randn(shape, generator=g, dtype=torch.bfloat16, device=dev)
            for _ in range(s.layers)]


class _Timeline:
    """Per-request: when its chunks were delivered, when its get returned, its scatter."""

    def __init__(self, eng: Any, conn: Any) -> None:
        self.ready: dict[str, float] = {}
        self.handles: list[Any] = []
        self.gets: list[tuple[float, float, list[str]]] = []
        self.scatters: list[tuple[float, float]] = []
        kb = kvstream_backend_of(eng)
        if kb is not None:
            e = kb.engine
            take, read = e.take, e.read

            def timed_take(owner: str, key: str) -> Any:
                h = take(owner, key)
                if h is not None:
                    self.handles.append(h)
                return h

            def timed_read(reqs: Any) -> Any:
                hs = read(reqs)
                self.handles.extend(hs)
                return hs

            e.take, e.read = timed_take, timed_read
            get = kb.batched_get_blocking

            def timed_get(keys: Any) -> Any:
                t = time.perf_counter()
                out = get(keys)
                self.gets.append((t, time.perf_counter(), [k.to_string() for k in keys]))
                return out

            kb.batched_get_blocking = timed_get
        to_gpu = conn.batched_to_gpu

        def timed_to_gpu(*a: Any, **kw: Any) -> Any:
            t = time.perf_counter()
            out = to_gpu(*a, **kw)
            _sync()
            self.scatters.append((t, time.perf_counter()))
            return out

        conn.batched_to_gpu = timed_to_gpu

    def reset(self) -> None:
        self.handles = []
        self.ready.clear()
        self.gets.clear()
        self.scatters.clear()

    def report(self, t0: float) -> dict:
        def r(x: float) -> float:
            return round(x - t0, 4)

        for h in self.handles:  # when kvstream delivered each chunk
            if h.delivered_at:
                self.ready.setdefault(h.key, h.delivered_at)

        out: dict = {"scatter_start": [r(a) for a, _ in self.scatters],
                     "scatter_s": [round(b - a, 4) for a, b in self.scatters]}
        if self.gets:
            out["get_returned"] = [r(b) for _, b, _ in self.gets]
            out["chunks_ready"] = [r(max(self.ready.get(k, b) for k in keys))
                                   for _, b, keys in self.gets]
        return out


def _step(eng: Any, kv: list, tokens: list, slots: list, it: int, tl: _Timeline) -> dict:
    import torch

    for t in kv:
        t.zero_()
    dev = device()
    slots_dev = [x.to(dev) for x in slots]
    _sync()
    kb = kvstream_backend_of(eng)
    steps0 = len(kb.engine.steps) if kb is not None else 0
    tl.reset()
    t0 = time.perf_counter()
    hits = [eng.lookup(tokens=t, lookup_id=f"r{r}-{it}", pin=True) for r, t in enumerate(tokens)]
    got = []
    for r, n in enumerate(hits):
        if n > 0:
            m = eng.retrieve(tokens[r][:n], torch.ones(n, dtype=torch.bool), kvcaches=kv,
                             slot_mapping=slots_dev[r][:n], vllm_cached_tokens=0,
                             request_configs=None, req_id=f"r{r}-{it}")
            got.append(int(m.sum().item()))
        else:
            got.append(0)
        eng.lookup_unpin(f"r{r}-{it}")
    _sync()
    step_s = time.perf_counter() - t0
    timeline = tl.report(t0)
    rec: dict = {"iter": it, "step_s": round(step_s, 4), "retrieved": got,
                 "h2d_s": round(sum(timeline["scatter_s"]), 4), "timeline": timeline}
    if "chunks_ready" in timeline:
        rec["storage_s"] = max(timeline["chunks_ready"])
    if kb is not None:
        time.sleep(0.05)
        rec["kvstream_steps"] = [msgspec.to_builtins(s) for s in list(kb.engine.steps)[steps0:]]
    return rec


def _warm_connector(eng: Any, kv: list, s: Shape, blocks_r: Any) -> float:
    """Store and retrieve one chunk of other tokens into blocks no step uses, then flush: the
    process's first ``batched_from_gpu``/``batched_to_gpu`` (CUDA context, LMCache's kernels
    loading) happens here, as a serving process has made it before its first request, not in
    step 0. No chunk of the steps is read. Returns the seconds it took."""
    import torch

    g = torch.Generator().manual_seed(SEED + 1)
    tokens = torch.randint(0, 128000, (s.chunk,), generator=g, dtype=torch.long)
    used = set(blocks_r.reshape(-1).tolist())
    spare = torch.tensor([b for b in range(s.num_blocks) if b not in used][
        : s.chunk // s.block_size])
    slots = _slots(spare, s.block_size).to(device())
    t = time.perf_counter()
    ones = torch.ones(s.chunk, dtype=torch.bool)
    eng.store(tokens, mask=ones, kvcaches=kv, slot_mapping=slots, offset=0, req_id="warmup")
    eng.retrieve(tokens, ones, kvcaches=kv, slot_mapping=slots, vllm_cached_tokens=0,
                 request_configs=None, req_id="warmup")
    _sync()
    kb = kvstream_backend_of(eng)
    if kb is not None:
        kb.engine.flush(60)
    return round(time.perf_counter() - t, 4)


def _verify(kv: list, orig: list, s: Shape, blocks_s: Any, blocks_r: Any, got: list) -> bool:
    import torch

    for r in range(s.requests):
        nb = got[r] // s.block_size
        if nb != s.blocks_per_request:
            return False
        bs, br = blocks_s[r][:nb].to(kv[0].device), blocks_r[r][:nb].to(kv[0].device)
        if not all(torch.equal(kv[li][:, br], orig[li][:, bs]) for li in range(s.layers)):
            return False
    return True


def run(p: Phase) -> dict:
    import torch

    s = p.shape
    rec: dict = {"kind": p.kind, "config": p.config, "ok": False, "dry_run": DRY,
                 "torch_threads": torch.get_num_threads(), "cuda_ops": cuda_ops()}
    tokens, blocks_s, blocks_r = _workload(s)
    eng, conn = build_engine(p.config, p.lmcache, s, p.work)
    try:
        kb = kvstream_backend_of(eng)
        if kb is not None:
            kb.engine.wait_warm(120)
        if p.kind in ("store", "same"):
            kv = _kv(s, zero=False)
            slots = [_slots(b, s.block_size).to(device()) for b in blocks_s]
            t = time.perf_counter()
            for r in range(s.requests):
                eng.store(tokens[r], mask=torch.ones(s.tokens, dtype=torch.bool), kvcaches=kv,
                          slot_mapping=slots[r], offset=0, req_id=f"store-{r}")
            _sync()
            if kb is not None:
                rec["flushed"] = kb.engine.flush(600)
            else:
                wait_local_disk(eng, tokens)
            rec["store_s"] = round(time.perf_counter() - t, 3)
        if p.kind in ("retrieve", "same"):
            if p.kind == "same":
                # LMCache's paged connector keeps the KV pointers of its first call (vLLM's KV
                # tensors never move): retrieve into the tensors stored from, against a copy
                orig, buf = [t.clone() for t in kv], kv
            else:
                orig, buf = _kv(s, zero=False), _kv(s, zero=True)
            if p.kind == "retrieve" and p.warmup:
                rec["warmup_s"] = _warm_connector(eng, buf, s, blocks_r)
            tl = _Timeline(eng, conn)
            slots = [_slots(b, s.block_size) for b in blocks_r]
            rec["steps"] = []
            for it in range(p.iters):
                st = _step(eng, buf, tokens, slots, it, tl)
                st["identical"] = _verify(buf, orig, s, blocks_s, blocks_r, st["retrieved"])
                rec["steps"].append(st)
        if kb is not None:
            rec["kvstream"] = msgspec.to_builtins(kb.engine.stats())
        rec["ok"] = True
    finally:
        from lmcache.v1.cache_engine import LMCacheEngineBuilder

        eng.close()
        LMCacheEngineBuilder.destroy("kvstream-bench")
    return rec


def cuda_ops() -> str:
    """"loaded" if LMCache's compiled CUDA kernels load here, else why not (LMCache then
    scatters with plain torch, which bounds every step and hides storage)."""
    try:
        import lmcache.cuda_ops  # noqa: F401
    except Exception as e:  # noqa: BLE001 - any failure means the torch fallback
        return f"not loaded: {type(e).__name__}: {e}"[:300]
    return "loaded"


def wait_local_disk(eng: Any, tokens: list, timeout: float = 600) -> None:
    """LocalDiskBackend writes asynchronously: wait until it holds every chunk."""
    b = eng.storage_manager.storage_backends.get("LocalDiskBackend")
    if b is None:
        return
    keys = [k for t in tokens for _, _, k in eng.token_database.process_tokens(tokens=t)]
    end = time.monotonic() + timeout
    while time.monotonic() < end and not all(b.contains(k) for k in keys):
        time.sleep(0.05)


def main() -> None:
    for k, v in (("LMCACHE_TRACK_USAGE", "false"), ("DO_NOT_TRACK", "1"),
                 ("PYTHONHASHSEED", "0")):
        os.environ.setdefault(k, v)
    phase = msgspec.json.decode(sys.argv[1], type=Phase)
    if phase.torch_threads:
        # vLLM's GPU worker serves with one torch thread (vllm.utils.torch_utils.
        # set_torch_threads_for_runtime, unless OMP_NUM_THREADS is set): torch's default, a
        # thread per core, makes LMCache's torch-fallback scatter an OpenMP region across
        # every core, which any other thread (kvstream's reads among them) then stalls
        import torch

        torch.set_num_threads(phase.torch_threads)
    try:
        rec = run(phase)
    except Exception as e:  # noqa: BLE001 - reported to the orchestrator verbatim
        import traceback

        rec = {"kind": phase.kind, "config": phase.config, "ok": False,
               "error": f"{type(e).__name__}: {e}", "traceback": traceback.format_exc()[-3000:]}
    print("RESULT " + json.dumps(rec), flush=True)


if __name__ == "__main__":
    main()
