"""The trace replay (``kvstream bench --gpu --trace``): its plan and kvsim's model of it are pure
and checked by hand here; its orchestration (stores, every configuration in a fresh process,
FCFS batches on the wall clock, per-request checksums of the retrieved KV, kvsim beside it, JSON)
runs end to end on this CPU machine with ``KVSTREAM_GPU_DRY=1`` (a torch reference copy for
LMCache's CUDA connector and a tiny stand-in model: what cannot run without a GPU). The GPU
measurement is in docs/benchmarks.md."""

from __future__ import annotations

import json
import os
import subprocess

import msgspec
import pytest

from kvstream_backend.sim.plan import (
    PlannedRequest,
    PrefillModel,
    Serving,
    TracePlan,
    burstiest,
    leading_hits,
    next_batch,
    plan,
    predict,
)
from kvstream_backend.sim.replay import Request

from .conftest import BENCH_GPU as CLI


def test_burstiest_window_and_leading_hits():
    assert burstiest([0, 10, 11, 12, 30], 3) == 1
    reqs = [Request(0, 1024, (1, 2)), Request(1, 1536, (1, 2, 3)), Request(2, 1024, (1, 9)),
            Request(3, 1024, (7, 2))]
    assert leading_hits(reqs) == [0, 2, 1, 0]  # a hit is a leading run: (7, 2) misses at 7
    p = plan("t", reqs, 2, 2.0, 4096)
    assert [r.index for r in p.requests] == [0, 1] and p.requests[1].arrival_s == 0.5
    assert p.requests[1].hit_tokens == 1024 and p.requests[1].new_tokens == 512


def test_cached_prefixes_are_stored_once():
    rs = [PlannedRequest(0, 0, (1, 2, 3), 3, 1536), PlannedRequest(1, 0, (1, 2), 2, 1024),
          PlannedRequest(2, 0, (1, 5), 1, 1024), PlannedRequest(3, 0, (4,), 0, 512)]
    assert TracePlan("t", 0, 1, 4096, rs).cached_blocks == [(1, 2, 3)]  # (1,) is inside it


def test_fcfs_batches_fill_the_token_budget_and_always_take_one():
    rs = [PlannedRequest(i, 0, (i,), 0, n) for i, n in enumerate([3000, 3000, 5000, 9000])]
    assert next_batch(rs, 8192) == 2
    assert next_batch(rs[3:], 8192) == 1  # longer than the budget: alone
    assert next_batch(rs, 20000) == 4


def test_kvsim_predicts_a_two_batch_queue_by_hand():
    kvb = 1000  # bytes per token
    rs = [PlannedRequest(0, 0.0, (1, 2), 2, 2048), PlannedRequest(1, 0.0, (1, 2), 2, 2048)]
    p = TracePlan("t", 0, 1, 1024, rs)  # each request prefills 1024 tokens: one per batch
    rate = PrefillModel.at_rate(1024.0)
    s = Serving("one-tier", (1e-6,), 2e-6, rate, kvb)  # 1 kB/s storage, 2 kB/s host->GPU
    # batch 1: 1,024 tokens * 1 kB = 1,024 kB: 1,024 s storage + 512 s copy + 1 s prefill
    first = 1024 + 512 + 1
    assert predict(p, s) == pytest.approx([first, 2 * first])
    nocache = Serving("nocache", (), 2e-6, rate, kvb, recompute=True)
    assert predict(p, nocache) == pytest.approx([2.0, 4.0])
    # a prefill that also pays per (new token, prefix token) pair: 1024 * 1024 * 1e-6 s more
    pairs = Serving("one-tier", (1e-6,), 2e-6, PrefillModel(per_token_s=1 / 1024,
                                                            per_prefix_pair_s=1e-6), kvb)
    extra = 1024 * 1024 * 1e-6
    assert predict(p, pairs) == pytest.approx([first + extra, 2 * (first + extra)])


def test_prefill_model_fit_recovers_its_terms_and_keeps_them_non_negative():
    true = PrefillModel(per_request_s=0.03, per_token_s=3e-5, per_pair_s=1e-9,
                        per_prefix_pair_s=2e-9, per_prefix_token_s=1e-6,
                        per_prefixed_pair_s=6e-10)
    shapes = [(n, p) for n in (512, 3000, 9000, 24000) for p in (0, 4096, 16384, 40000)]
    fit = PrefillModel.fit([(n, p, true.seconds(n, p)) for n, p in shapes])
    for got, want in zip(msgspec.structs.astuple(fit), msgspec.structs.astuple(true),
                         strict=True):
        assert got == pytest.approx(want, rel=1e-6)
    # a time that falls as the prefix grows cannot be a cost: that term is dropped, not negative
    falling = [(n, p, 0.01 + 1e-5 * n - 1e-7 * p) for n, p in shapes]
    fit = PrefillModel.fit(falling)
    assert min(msgspec.structs.astuple(fit)) >= 0 and fit.per_prefix_token_s == 0
    # without a prefix in the samples, the prefix terms stay zero rather than being guessed
    fit = PrefillModel.fit([(n, 0, 0.02 + 4e-5 * n) for n in (100, 1000, 5000, 20000)])
    assert fit.per_prefix_pair_s == fit.per_prefix_token_s == fit.per_prefixed_pair_s == 0
    assert fit.seconds(1000, 0) == pytest.approx(0.06, rel=1e-6)
    # the extra cost of attention among new tokens is paid only over a prefix
    masked = PrefillModel(per_prefixed_pair_s=1e-9)
    assert masked.seconds(1000, 0) == 0
    assert masked.seconds(1000, 1) == pytest.approx(1000 * 1000 / 2 * 1e-9)


def test_dry_run_replays_every_configuration_and_verifies_the_kv(tmp_path, dry_bench):
    out = tmp_path / "replay.json"
    r = dry_bench(["--trace", "conversation", "--trace-requests", "3", "--json", str(out),
                   "--plot", str(tmp_path / "r.png")], timeout=900)
    assert r.returncode == 0, r.stdout[-4000:] + r.stderr[-4000:]
    assert "DRY RUN" in r.stdout
    rep = json.loads(out.read_text())
    assert rep["dry_run"] is True
    names = [c["name"] for c in rep["configs"]]
    assert names == ["kvstream", "kvstream-disk", "kvstream-shm", "static-best", "lmcache-disk",
                     "lmcache-cpu", "nocache", "kvstream-last"]
    for c in rep["configs"]:
        assert c["ok"], (c["name"], c["error"])
        assert len(c["requests"]) == 3
        hits = sum(q["hit_tokens"] for q in c["requests"])
        got = sum(q["retrieved_tokens"] for q in c["requests"])
        assert got == (0 if c["name"] == "nocache" else hits), c["name"]
        assert c["predicted_p50_s"] is not None, c["name"]
        if c["name"] not in ("lmcache-cpu", "nocache"):
            # kvsim also fed the rates this run read at (the single tiers', net of host->GPU)
            assert c["predicted_run_p50_s"] is not None, c["name"]
        if c["name"] in ("kvstream-disk", "kvstream-shm", "lmcache-disk"):
            assert c["run_gbps"] > 0, c["name"]
        # kvstream's own account of the run (what each tier read, what was hedged) is kept
        assert bool(c["engine"]) == c["name"].startswith(("kvstream", "static")), c["name"]
    # the tiers are filled by a process of its own, so no replayed configuration stores
    assert not rep["configs"][0]["store"]
    assert any(n.startswith("kvstream's tiers filled in") for n in rep["notes"])
    assert hits > 0  # the segment has cached prefixes: retrieval (and its checksums) happened
    assert set(rep["limits_gbps"]) == {"disk", "shm"} and rep["h2d_gbps"] > 0
    # the limits are sampled after the fill and after the last phase; kvsim gets the best
    samples = rep["limit_samples_gbps"]
    assert {k: len(v) for k, v in samples.items()} == {"disk": 2, "shm": 2}
    assert rep["limits_gbps"] == {k: max(v) for k, v in samples.items()}
    # and again into device memory (here the CPU stands in for the GPU)
    assert set(rep["to_gpu_gbps"]) == {"disk", "shm"} and min(rep["to_gpu_gbps"].values()) > 0
    # kvsim's prefill is fitted on the stand-in timed at every request's shapes in the fill
    # process: with and without each request's cached prefix
    shapes = {(n, p) for n, p, _ in rep["prefill_samples"]}
    assert {p for _, p in shapes} != {0} and len(shapes) >= 3
    assert all(t > 0 for *_, t in rep["prefill_samples"])
    assert rep["prefill_model"] is not None and min(rep["prefill_model"].values()) >= 0
    # both kvstream rows get the targets (measured first, and again last)
    targets = {t["name"] for t in rep["targets"]}
    assert {"kvstream p99 / best single tier's p99",
            "kvstream-last p99 / best single tier's p99"} <= targets
    assert (tmp_path / "r.png").stat().st_size > 0
    # a stored report rescored (no replay, no device) gives back the run's own predictions
    again = tmp_path / "rescored.json"
    r = subprocess.run(CLI + ["--rescore", str(out), "--json", str(again)],
                       capture_output=True, text=True, timeout=300,
                       env={**os.environ, "KVSTREAM_GPU_DRY": "1"})
    assert r.returncode == 0, r.stdout[-4000:] + r.stderr[-4000:]
    rescored = json.loads(again.read_text())
    for a, b in zip(rep["configs"], rescored["configs"], strict=True):
        for f in ("predicted_p50_s", "predicted_p90_s", "predicted_run_p50_s", "run_gbps"):
            assert a[f] == pytest.approx(b[f]), (a["name"], f)
    assert rescored["targets"] == rep["targets"]
    # and names the report when it does not fit the plan it asks for
    rep["segment_start"] += 1
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps(rep))
    r = subprocess.run(CLI + ["--rescore", str(bad)], capture_output=True, text=True,
                       timeout=300, env={**os.environ, "KVSTREAM_GPU_DRY": "1"})
    assert r.returncode == 2 and "bad.json" in r.stdout, r.stdout[-2000:]
    (tmp_path / "torn.json").write_text(out.read_text()[:1000])  # a report cut short
    r = subprocess.run(CLI + ["--rescore", str(tmp_path / "torn.json")], capture_output=True,
                       text=True, timeout=300, env={**os.environ, "KVSTREAM_GPU_DRY": "1"})
    assert r.returncode == 2 and "torn.json" in r.stdout and "not a replay report" in r.stdout


def test_gpu_only_replays_the_named_configurations_and_refuses_unknown_ones(tmp_path,
                                                                           dry_bench):
    """A replay too long for one device call is measured in two: ``--gpu-only`` runs the named
    configurations after the same fill; a name it does not know is refused before anything
    runs, GPU or not."""
    bad = subprocess.run(CLI + ["--trace", "conversation", "--gpu-only", "kvstream,lmcache-ssd",
                                "--workdir", str(tmp_path)],
                         capture_output=True, text=True, timeout=120,
                         env={k: v for k, v in os.environ.items() if k != "KVSTREAM_GPU_DRY"})
    text = " ".join(bad.stdout.split())  # rich wraps long lines
    assert bad.returncode == 2 and "--gpu-only" in text and "lmcache-ssd" in text, text
    out = tmp_path / "replay.json"
    r = dry_bench(["--trace", "conversation", "--trace-requests", "3",
                   "--gpu-only", "kvstream,lmcache-cpu", "--json", str(out)])
    assert r.returncode == 0, r.stdout[-4000:] + r.stderr[-4000:]
    rep = json.loads(out.read_text())
    assert [c["name"] for c in rep["configs"]] == ["kvstream", "lmcache-cpu"]
    assert all(c["ok"] for c in rep["configs"]), rep["configs"]
    assert any(n.startswith("--gpu-only: kvstream, lmcache-cpu") for n in rep["notes"])
    # lmcache-cpu gives kvsim its host->GPU rate: kvstream is predicted as in a whole run
    assert rep["h2d_gbps"] > 0 and rep["configs"][0]["predicted_p50_s"] is not None


def test_stand_in_attention_matches_transformers_over_a_cached_prefix(monkeypatch):
    """The stand-in's lower-right causal attention gives what transformers' own SDPA path (with
    its explicit mask) gives for new tokens over a cached prefix, and what one uncached forward
    of prefix + new tokens gives at those positions; on the CPU, a tiny model."""
    import torch
    from transformers import DynamicCache

    from kvstream_backend.bench import replay_worker as rw

    monkeypatch.setattr(rw, "_dev", lambda: torch.device("cpu"))
    m = rw.ModelShape(layers=2, hidden=64, heads=4, kv_heads=2, head_dim=16, intermediate=128,
                      vocab=256)
    ours, theirs = rw._model(m), rw._model(m, attention="sdpa")  # same seed, same weights
    ids = torch.randint(0, m.vocab, (1, 48), generator=torch.Generator().manual_seed(1))
    p = 40

    def hidden(model, cached: bool):
        with torch.inference_mode():
            if not cached:
                return model.model(input_ids=ids).last_hidden_state[:, p:]
            cache = DynamicCache()
            model.model(input_ids=ids[:, :p], past_key_values=cache, use_cache=True)
            pos = torch.arange(p, ids.shape[1]).unsqueeze(0)
            return model.model(input_ids=ids[:, p:], past_key_values=cache, position_ids=pos,
                               use_cache=True).last_hidden_state

    ref = hidden(theirs, cached=True).float()
    for got in (hidden(ours, cached=True), hidden(ours, cached=False), hidden(theirs, False)):
        assert torch.allclose(got.float(), ref, atol=3e-2, rtol=3e-2), (got - ref).abs().max()
