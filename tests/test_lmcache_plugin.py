"""KVStreamBackend inside the real LMCache 0.5.6 (config loader, StorageManager, LMCacheEngine)."""

from __future__ import annotations

import gc
import glob
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from lmcache.v1.cache_engine import LMCacheEngineBuilder
from lmcache.v1.config import LMCacheEngineConfig

from kvstream_backend import KVStreamBackend
from kvstream_backend.config import ConfigError

from . import lmcache_helpers as H
from .helpers import eventually as _eventually

REPO = Path(__file__).resolve().parent.parent


def _chunk_files(d: str) -> list[str]:
    return glob.glob(os.path.join(d, "kvs1", "chunks", "*", "*", "*.kvs"))


@pytest.fixture
def sms():
    made = []

    def make(yaml_path, role: str = "worker"):
        sm = H.storage_manager(yaml_path, role)
        made.append(sm)
        return sm

    yield make
    for sm in made:
        sm.close()


def _get(sm, idx: list[int], seed: int = 0) -> list[bool]:
    keys = [H.key(i) for i in idx]
    objs = sm.batched_get(keys, location="kvstream")
    ok = [o is not None and torch.equal(o.tensor, H.chunk_tensor(i, seed))
          for i, o in zip(idx, objs, strict=True)]
    for o in objs:
        if o is not None:
            o.ref_count_down()
    return ok


def test_selected_by_lmcache_yaml_put_evict_get(tmp_path, tier_dirs, sms, caplog):
    sm = sms(H.write_yaml(tmp_path / "c.yaml", tier_dirs, local_cpu=True))
    kv = sm.storage_backends["kvstream"]
    assert isinstance(kv, KVStreamBackend) and list(sm.storage_backends)[-1] == "kvstream"
    idx = list(range(12))
    H.put_chunks(sm, idx)
    assert kv.engine.flush(30)
    for d in tier_dirs:  # replicated: every tier holds every chunk
        assert len(_chunk_files(d)) == len(idx)
    lcb = sm.storage_backends["LocalCPUBackend"]
    for i in idx:  # evicted from LocalCPU: hits must now come from kvstream
        lcb.remove(H.key(i))
    hits, where = sm.batched_contains([H.key(i) for i in idx], pin=True)
    assert hits == len(idx) and list(where) == ["kvstream"]
    assert all(_get(sm, idx))
    sm.batched_unpin([H.key(i) for i in idx], ["kvstream"])
    gc.collect()
    assert "garbage collected with ref_count" not in caplog.text


def test_no_leaks_and_prefix_convention(tmp_path, tier_dirs, sms, caplog):
    sm = sms(H.write_yaml(tmp_path / "c.yaml", tier_dirs))
    kv = sm.storage_backends["kvstream"]
    H.put_chunks(sm, [0, 1, 3])  # chunk 2 is missing
    assert kv.engine.flush(30)
    assert H.active_allocations(sm) == 0, "put references not dropped"
    assert kv.batched_contains([H.key(i) for i in range(4)], pin=True) == 2
    objs = kv.batched_get_blocking([H.key(i) for i in (0, 1, 2, 3)])
    assert [o is not None for o in objs] == [True, True, False, False]
    for o in objs[:2]:
        o.ref_count_down()
    for i in (0, 1):
        assert kv.unpin(H.key(i))
    assert not kv.pin(H.key(2)) and not kv.contains(H.key(2), pin=True)  # a miss pins nothing
    assert kv.engine.pinned() == 0
    assert kv.engine.wait_idle(10)  # hedge losers release their buffers when they land
    assert H.active_allocations(sm) == 0, "a MemoryObj leaked"
    gc.collect()
    assert "garbage collected with ref_count" not in caplog.text


def test_put_callback_fires_per_key_when_first_copy_is_published(tmp_path, tier_dirs, sms):
    sm = sms(H.write_yaml(tmp_path / "c.yaml", tier_dirs))
    kv = sm.storage_backends["kvstream"]
    shape = H.metadata().get_shapes(256)[0]
    objs = [sm.allocate(shape, H.DTYPE) for _ in range(3)]
    keys = [H.key(100 + i) for i in range(3)]
    done: list = []
    assert kv.batched_submit_put_task(keys, objs, on_complete_callback=done.append) is None
    assert all(kv.exists_in_put_tasks(k) or k in done for k in keys)
    for o in objs:
        o.ref_count_down()  # what StorageManager.batched_put does on return
    assert kv.engine.flush(30)
    assert sorted(done, key=lambda k: k.chunk_hash) == keys
    assert not any(kv.exists_in_put_tasks(k) for k in keys)
    assert H.active_allocations(sm) == 0


def _run(*args: str) -> dict:
    r = subprocess.run([sys.executable, "-m", "tests.lmcache_helpers", *args], cwd=REPO,
                       capture_output=True, text=True, timeout=300,
                       env={**os.environ, "PYTHONHASHSEED": "0"})
    assert r.returncode == 0, r.stderr[-3000:]
    line = [x for x in r.stdout.splitlines() if x.startswith("REPORT ")][-1]
    return json.loads(line[len("REPORT "):])


def test_restart_in_a_new_process_hits(tmp_path, tier_dirs):
    y = H.write_yaml(tmp_path / "c.yaml", tier_dirs)
    assert _run("put", str(y), "10", "7")["flushed"]
    rep = _run("get", str(y), "10", "7")
    assert rep["hits"] == 10 and rep["identical"] == [True] * 10


def test_two_processes_share_the_second_tier(tmp_path, tier_dirs):
    shared = tier_dirs[1]
    a = H.write_yaml(tmp_path / "a.yaml", [str(tmp_path / "a-local"), shared])
    b = H.write_yaml(tmp_path / "b.yaml", [str(tmp_path / "b-local"), shared])
    assert _run("put", str(a), "6", "3")["flushed"]
    rep = _run("get", str(b), "6", "3")
    assert rep["hits"] == 6 and rep["identical"] == [True] * 6
    assert rep["tier_read_bytes"]["t0"] == 0 and rep["tier_read_bytes"]["t1"] > 0


def test_lookups_of_a_step_are_pooled_and_read_once(tmp_path, tier_dirs, sms):
    slow = {"emulate": {"read_mbps": 40}}
    sm = sms(H.write_yaml(tmp_path / "c.yaml", tier_dirs, tier_opts=[{}, slow], claim_batch=2))
    kv = sm.storage_backends["kvstream"]
    reqs = [list(range(r * 6, r * 6 + 6)) for r in range(4)]  # 4 requests x 6 chunks
    H.put_chunks(sm, [i for r in reqs for i in r])
    assert kv.engine.flush(30)
    before = kv.engine.stats()
    for r in reqs:  # the scheduler's lookups for the whole step, before any retrieval
        hits, _ = sm.batched_contains([H.key(i) for i in r], pin=True)
        assert hits == len(r)
    assert kv.engine.wait_idle(30)  # the previous step's forward pass runs meanwhile
    pooled = kv.engine.stats()
    n = sum(len(r) for r in reqs)
    # one pool: every chunk of all four requests was read, by both tiers, before any get
    assert pooled.chunks_read - before.chunks_read == n
    per_tier = [a.read_bytes - b.read_bytes for a, b in zip(pooled.tiers, before.tiers,
                                                            strict=True)]
    assert all(x > 0 for x in per_tier), f"both tiers should read: {per_tier}"
    chunk = H.chunk_tensor(0).numel() * 2 + 4096
    assert sum(per_tier) <= n * chunk + 2 * 2 * 2 * chunk  # at most one hedge window per tier
    for r in reqs:  # then the per-request retrievals: served from what was read, no new reads
        assert all(_get(sm, r))
        sm.batched_unpin([H.key(i) for i in r], ["kvstream"])
    assert kv.engine.wait_idle(30)
    after = kv.engine.stats()
    assert after.prefetch_hits - before.prefetch_hits == n
    assert after.chunks_read == pooled.chunks_read, "a get read a chunk again"
    assert H.active_allocations(sm) == 0



def test_prefetch_is_bounded_and_released_on_unpin(tmp_path, tier_dirs, sms):
    chunk_mb = H.chunk_tensor(0).numel() * 2 / 2**20
    sm = sms(H.write_yaml(tmp_path / "c.yaml", tier_dirs, prefetch_max_gb=3 * chunk_mb / 1024))
    kv = sm.storage_backends["kvstream"]
    H.put_chunks(sm, list(range(8)))
    assert kv.engine.flush(30)
    keys = [H.key(i) for i in range(8)]
    assert kv.batched_contains(keys, pin=True) == 8
    # every hit is registered; buffers are allocated as tiers claim them, up to the bound
    assert _eventually(lambda: kv.engine.stats().prefetch_held_bytes == 3 * kv.engine.lookup(
        keys[0].to_string()).payload_len)
    assert kv.engine.wait_idle(10)
    time.sleep(0.2)  # nothing more is allocated while the bound is reached
    assert H.active_allocations(sm) == 3
    for k in keys:
        kv.unpin(k)
    assert kv.engine.wait_idle(10)
    assert _eventually(lambda: H.active_allocations(sm) == 0)
    assert kv.engine.stats().prefetch_dropped == 8


def test_prefetch_expires(tmp_path, tier_dirs, sms):
    sm = sms(H.write_yaml(tmp_path / "c.yaml", tier_dirs, prefetch_timeout_s=0.5))
    kv = sm.storage_backends["kvstream"]
    H.put_chunks(sm, [0, 1])
    assert kv.engine.flush(30)
    kv.batched_contains([H.key(0), H.key(1)], pin=True)
    # prefetches are never hedged (only demanded chunks are): one buffer per chunk
    assert _eventually(lambda: kv.engine.stats().prefetch_held_bytes > 0)
    assert kv.engine.wait_idle(10)
    assert H.active_allocations(sm) == 2
    # the engine drops expired prefetches by itself: no later call is needed to free them
    assert _eventually(lambda: H.active_allocations(sm) == 0, timeout=5)
    assert kv.engine.stats().prefetch_expired == 2
    assert all(_get(sm, [1]))  # a later get reads afresh
    assert kv.engine.wait_idle(10)
    assert H.active_allocations(sm) == 0


def test_isolation_by_model_dtype_rank_and_world_size(tmp_path, tier_dirs, sms):
    sm = sms(H.write_yaml(tmp_path / "c.yaml", tier_dirs))
    kv = sm.storage_backends["kvstream"]
    H.put_chunks(sm, [0])
    assert kv.engine.flush(30)
    assert kv.contains(H.key(0))
    for other in (H.key(0, model="other"), H.key(0, worker_id=1), H.key(0, world_size=2),
                  H.key(0, dtype=torch.float16)):
        assert not kv.contains(other)


def test_scheduler_role_without_local_cpu_backend(tmp_path, tier_dirs, sms):
    y = H.write_yaml(tmp_path / "c.yaml", tier_dirs)
    sm = sms(y)
    H.put_chunks(sm, [0])
    assert sm.storage_backends["kvstream"].engine.flush(30)
    cfg = LMCacheEngineConfig.from_file(str(y))
    kv = KVStreamBackend(dst_device="cpu", config=cfg, metadata=H.metadata("scheduler"),
                         local_cpu_backend=None, loop=None)
    try:
        assert kv.batched_contains([H.key(0)], pin=True) == 1  # lookups work
        assert kv.get_blocking(H.key(0)) is None  # gets are refused (logged), not crashed
        assert kv.get_allocator_backend() is None
    finally:
        kv.close()


def test_invalid_config_logs_one_clear_error(tmp_path, tier_dirs, sms, caplog):
    y = H.write_yaml(tmp_path / "bad.yaml", tier_dirs, claim_batch=0)
    sm = sms(y)
    assert "kvstream" not in sm.storage_backends  # LMCache swallowed the exception...
    ours = [r for r in caplog.records if "KVSTREAM PLUGIN DISABLED" in r.getMessage()]
    assert len(ours) == 1 and ours[0].levelname == "ERROR"  # ...we did not
    assert "kvstream.claim_batch" in ours[0].getMessage()
    with pytest.raises(ConfigError, match="kvstream.claim_batch"):
        KVStreamBackend(config=LMCacheEngineConfig.from_file(str(y)), metadata=H.metadata())


def test_env_var_form(tmp_path, tier_dirs, monkeypatch):
    extra = {
        "storage_plugin.kvstream.module_path": "kvstream_backend",
        "storage_plugin.kvstream.class_name": "KVStreamBackend",
        "kvstream.tiers": json.dumps([{"name": "a", "path": tier_dirs[0], "max_size_gb": 1}]),
        "kvstream.claim_batch": "2",
    }
    monkeypatch.setenv("LMCACHE_STORAGE_PLUGINS", "kvstream")
    monkeypatch.setenv("LMCACHE_EXTRA_CONFIG", json.dumps(extra))
    monkeypatch.setenv("LMCACHE_LOCAL_CPU", "false")
    cfg = LMCacheEngineConfig.from_env()
    kv = KVStreamBackend(config=cfg, metadata=H.metadata(), local_cpu_backend=None)
    try:
        assert kv.cfg.claim_batch == 2 and kv.cfg.tiers[0].path == tier_dirs[0]
    finally:
        kv.close()


# ---- LMCacheEngine in its three retrieval modes -----------------------------------------

def _engine(tmp_path, tier_dirs, name: str, **lmcache_keys):
    y = H.write_yaml(tmp_path / f"{name}.yaml", tier_dirs, lmcache=lmcache_keys)
    cfg = LMCacheEngineConfig.from_file(str(y))
    layerwise = bool(lmcache_keys.get("use_layerwise"))
    conn = H.CPULayerwiseConnector() if layerwise else H.CPUConnector()
    eng = LMCacheEngineBuilder.get_or_create(name, cfg, H.metadata(), conn,
                                             lambda t, r: None, lambda o, r: o)
    stub = H.LookupServerStub()
    eng.post_init(async_lookup_server=stub)
    return eng, stub


@pytest.mark.parametrize("mode", ["sync", "async", "layerwise"])
def test_lmcache_engine_store_lookup_retrieve(tmp_path, tier_dirs, mode):
    keys = {"async": {"enable_async_loading": True}, "layerwise": {"use_layerwise": True}}
    name = f"kvs-{mode}-{os.getpid()}-{time.monotonic_ns()}"
    eng, stub = _engine(tmp_path, tier_dirs, name, **keys.get(mode, {}))
    try:
        tokens = list(range(1000, 1000 + 1024))  # 4 chunks
        src = torch.randn(2, H.LAYERS, len(tokens), H.HIDDEN).to(H.DTYPE)
        if mode == "layerwise":
            for _ in eng.store_layer(tokens, kv=src):
                pass
        else:
            eng.store(tokens, kv=src)
        kv = eng.storage_manager.storage_backends["kvstream"]
        assert kv.engine.flush(30)
        out = torch.zeros_like(src)
        if mode == "async":
            eng.async_lookup_and_prefetch("req", tokens, pin=True)
            deadline = time.monotonic() + 30
            while "req" not in stub.responses and time.monotonic() < deadline:
                time.sleep(0.01)
            assert stub.responses.get("req") == len(tokens)
            mask = eng.retrieve(tokens, kv=out, req_id="req")
        elif mode == "layerwise":
            assert eng.lookup(tokens, lookup_id="req", pin=True) == len(tokens)
            *_, mask = eng.retrieve_layer(tokens, kv=out)  # the last yield is the mask
        else:
            assert eng.lookup(tokens, lookup_id="req", pin=True) == len(tokens)
            mask = eng.retrieve(tokens, kv=out, req_id="req")
        eng.lookup_unpin("req")
        assert mask is not None and int(mask.sum()) == len(tokens)
        assert torch.equal(out, src), "retrieved KV differs from what was stored"
        # no pin outlives the retrieve (in async mode LMCache never unpins plugins itself)
        assert kv.engine.wait_idle(10) and kv.engine.pinned() == 0
        assert kv.engine.stats().chunks_read >= 4
    finally:
        LMCacheEngineBuilder.destroy(name)


def test_retrieve_pass_keeps_reading_ahead_past_an_exhausted_prefetch_budget(tmp_path, tier_dirs):
    """vLLM's sync path: lookups for every request of the step, then one retrieve per request.
    The prefetch budget holds only two chunks (half a request), yet every request after the
    first finds part of its chunks already read: prefetches are registered without memory and
    read as buffers free up (v0.1 read two chunks ahead once, then request by request)."""
    chunk = 2 * H.LAYERS * 256 * H.HIDDEN * H.DTYPE.itemsize
    name = f"kvs-pass-{os.getpid()}-{time.monotonic_ns()}"
    y = H.write_yaml(tmp_path / "pass.yaml", tier_dirs, prefetch_max_gb=2 * chunk / 2**30)
    cfg = LMCacheEngineConfig.from_file(str(y))
    eng = LMCacheEngineBuilder.get_or_create(name, cfg, H.metadata(), H.CPUConnector(),
                                             lambda t, r: None, lambda o, r: o)
    eng.post_init(async_lookup_server=H.LookupServerStub())
    try:
        reqs = [list(range(10_000 * (r + 1), 10_000 * (r + 1) + 1024)) for r in range(4)]
        srcs = [torch.randn(2, H.LAYERS, 1024, H.HIDDEN).to(H.DTYPE) for _ in reqs]
        for tokens, src in zip(reqs, srcs, strict=True):
            eng.store(tokens, kv=src)
        kv = eng.storage_manager.storage_backends["kvstream"]
        assert kv.engine.flush(30)
        for r, tokens in enumerate(reqs):  # the scheduler's lookups, all before the pass
            assert eng.lookup(tokens, lookup_id=f"r{r}", pin=True) == 1024
        assert kv.engine.wait_idle(10)  # the previous step's forward pass runs meanwhile
        for r, (tokens, src) in enumerate(zip(reqs, srcs, strict=True)):
            out = torch.zeros_like(src)
            mask = eng.retrieve(tokens, kv=out, req_id=f"r{r}")
            eng.lookup_unpin(f"r{r}")
            assert int(mask.sum()) == 1024 and torch.equal(out, src)
            assert kv.engine.wait_idle(10)  # the scatter to the GPU would take this long
        st = kv.engine.stats()
        assert st.prefetch_hits >= 2 * len(reqs), st
        assert st.chunks_read == 16 and not st.misses
        assert kv.engine.pinned() == 0 and st.prefetch_held_bytes == 0
    finally:
        LMCacheEngineBuilder.destroy(name)
