"""``kvstream bench --gpu``: it refuses clearly without CUDA, and its orchestration (stores,
fresh-process retrieves of every configuration, byte verification, targets, JSON) runs end to
end on this CPU machine with ``KVSTREAM_GPU_DRY=1``, where a torch reference copy stands in for
LMCache's CUDA connector (the one part that cannot run without a GPU). The GPU measurement
itself is in docs/benchmarks.md."""

from __future__ import annotations

import json
import os
import signal
import subprocess

import pytest
import torch

from .conftest import BENCH_GPU as CLI


@pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has CUDA")
def test_refuses_clearly_without_cuda(tmp_path):
    env = {k: v for k, v in os.environ.items() if k != "KVSTREAM_GPU_DRY"}
    r = subprocess.run(CLI + ["--workdir", str(tmp_path)], capture_output=True, text=True,
                       timeout=120, env=env)
    assert r.returncode == 2, r.stdout + r.stderr
    text = " ".join(r.stdout.split())  # rich wraps long lines
    assert "needs a CUDA GPU" in text and "torch.cuda.is_available() is False" in text


def test_dry_run_measures_and_verifies_every_configuration(tmp_path, dry_bench):
    out = tmp_path / "gpu.json"
    r = dry_bench(["--gpu-shape", "2,2,64,16", "--requests", "3", "--gpu-tokens", "512",
                   "--gpu-rounds", "1", "--gpu-iters", "1", "--json", str(out)])
    assert r.returncode == 0, r.stdout[-4000:] + r.stderr[-4000:]
    rep = json.loads(out.read_text())
    assert rep["dry_run"] is True
    assert rep["machine"]["torch_threads"] == "1"  # as vLLM's GPU worker serves; checked per phase
    assert any("DRY RUN" in n for n in rep["notes"]), "a dry run must say it is not a GPU run"
    names = {c["name"] for c in rep["configs"]}
    assert names == {"kvstream", "kvstream-rev", "kvstream-disk", "kvstream-shm", "static-0.5",
                     "static-0.7", "kvstream-emu", "lmcache-disk", "lmcache-cpu", "limit-disk",
                     "limit-shm", "limit-disk-gpu", "limit-shm-gpu"}
    for c in rep["configs"]:
        assert not c["errors"], (c["name"], c["errors"])
        if c["name"].startswith("limit-"):  # each tier apart from the engine, 1..cores threads
            assert c["step_s"][0] > 0 and "GB/s by threads: 1:" in c["io"][0], c
            # (-gpu: copied to the device after each read; here the CPU stands in for it)
            assert ("host->GPU copy" in c["io"][0]) == c["name"].endswith("-gpu"), c
            continue
        assert c["identical"] == [True], c["name"]
        assert c["step_s"] and c["h2d_s"][0] > 0, c["name"]
        assert c["cuda_ops"], c["name"]  # whether LMCache's kernels loaded, phase by phase
        if c["name"].startswith(("kvstream", "static")):
            tl = c["timelines"][0]
            assert len(tl["get_returned"]) == 3 and len(tl["chunks_ready"]) == 3
            assert 0 < c["storage_s"][0] <= c["step_s"][0]
            # the process made the connector's first calls before step 0 (a retrieve phase)
            assert len(c["warmup_s"]) == 1 and c["warmup_s"][0] > 0, c["name"]
            if c["name"].startswith("kvstream"):  # each tier's reads, from the engine
                assert f"  {c['name']}: " in r.stdout and " reads per step, " in r.stdout
                # (only reads that ended once a get waited: with chunks this small the lookups'
                # reads may all have landed before, so a step may count none)
                tiers = [t for rep in c["kvstream_steps"][0] for t in rep["tiers"]]
                assert all(t["max_read_s"] > 0 for t in tiers if t["reads"]), c["name"]
                assert all(t["lost"] <= t["reads"] for t in tiers), c["name"]
        else:  # LMCache's backends store, then retrieve, in one process: warm already
            assert c["warmup_s"] == [], c["name"]
    assert any("before its first step" in n for n in rep["notes"])
    # on this CPU machine lmcache.cuda_ops cannot load: the run must say it is not representative
    assert any("NOT REPRESENTATIVE" in n for n in rep["notes"])
    assert [t["goal"] for t in rep["targets"]] == ["<= 0.95", "<= 0.95", ">= 0.8", ">= 0.8",
                                                   ">= 0.8", ">= 0.8", ">= 0.8", ">= 1.35",
                                                   "<= 1.1"]


def test_gpu_only_runs_the_named_configurations_and_refuses_unknown_ones(tmp_path):
    out = tmp_path / "gpu.json"
    shm = f"/dev/shm/kvs-gpu-only-{os.getpid()}"
    os.makedirs(shm)
    args = ["--gpu-shape", "2,2,64,16", "--requests", "3", "--gpu-tokens", "512",
            "--gpu-rounds", "1", "--gpu-iters", "1", "--workdir", str(tmp_path),
            "--gpu-shm", shm]
    env = {**os.environ, "KVSTREAM_GPU_DRY": "1"}
    try:
        bad = subprocess.run(CLI + args + ["--gpu-only", "kvstream,kvstream-hdd"],
                             capture_output=True, text=True, timeout=120, env=env)
        r = subprocess.run(CLI + args + ["--gpu-only", "kvstream-shm,kvstream", "--gpu-cold",
                                         "--json", str(out)],
                           capture_output=True, text=True, timeout=600, env=env)
    finally:
        subprocess.run(["rm", "-rf", shm], check=False)
    assert bad.returncode == 2 and "--gpu-only" in bad.stdout and "kvstream-hdd" in bad.stdout
    assert r.returncode == 0, r.stdout[-4000:] + r.stderr[-4000:]
    rep = json.loads(out.read_text())
    assert {c["name"] for c in rep["configs"]} == {"kvstream", "kvstream-shm"}
    assert all(c["identical"] == [True] for c in rep["configs"])
    assert all(c["warmup_s"] == [] for c in rep["configs"]), "--gpu-cold: no warm-up"
    assert any(n.startswith("--gpu-cold") for n in rep["notes"])
    # only targets whose rows ran
    assert [t["name"] for t in rep["targets"]] == [
        "kvstream step / best single tier's step", "kvstream step / max(storage read, host->GPU)"]


def test_a_run_cut_short_keeps_every_row_it_finished(tmp_path):
    """A device call has a hard limit. A run killed in LMCache's CPU backend's phase leaves the
    JSON with the disk backend's row, measured just before (on an H200 a run cut at 520 s lost
    that row: the report was written only after both)."""
    out = tmp_path / "gpu.json"
    shm = f"/dev/shm/kvs-gpu-test-cut-{os.getpid()}"
    os.makedirs(shm)
    p = subprocess.Popen(CLI + ["--gpu-shape", "2,2,64,16", "--requests", "2",
                                "--gpu-tokens", "256", "--gpu-rounds", "1", "--gpu-iters", "1",
                                "--gpu-only", "lmcache-disk,lmcache-cpu",
                                "--workdir", str(tmp_path), "--gpu-shm", shm,
                                "--json", str(out)],
                         stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                         env={**os.environ, "KVSTREAM_GPU_DRY": "1", "PYTHONUNBUFFERED": "1"},
                         start_new_session=True)
    printed = b""
    try:
        while b"lmcache-cpu" not in printed:  # (a phase's line is printed as it starts)
            got = os.read(p.stdout.fileno(), 4096)
            assert got, f"the run ended before LMCache's CPU phase: {printed.decode()[-3000:]}"
            printed += got
        os.killpg(p.pid, signal.SIGKILL)  # the command limit: no cleanup, no last report
        p.wait(timeout=60)
    finally:
        if p.poll() is None:
            os.killpg(p.pid, signal.SIGKILL)
        p.stdout.close()
        subprocess.run(["rm", "-rf", shm], check=False)
    assert out.exists(), "nothing was written before the kill"
    rows = {c["name"]: c for c in json.loads(out.read_text())["configs"]}
    assert set(rows) == {"lmcache-disk"}, printed.decode()[-3000:]
    assert rows["lmcache-disk"]["step_s"] and rows["lmcache-disk"]["identical"] == [True]
