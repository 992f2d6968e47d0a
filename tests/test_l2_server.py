"""A real ``lmcache server`` on CPU with kvstream as its one L2 adapter, driven by LMCache's own
multi-process client code in another process (tests/l2_client.py): store, SIGTERM the server
while kvstream's writes are still deferred, start a new server over the same tiers, retrieve,
compare bytes. This is the path SGLang 0.5.23 and vLLM's LMCacheMPConnector take."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time

import pytest

from .helpers import chunk_files, free_port, wait_serving

CLIENT = os.path.join(os.path.dirname(__file__), "l2_client.py")
LMCACHE = os.path.join(os.path.dirname(sys.executable), "lmcache")
CHUNKS = 8  # tests/l2_client.py stores 2,048 tokens


class Server:
    def __init__(self, spec: dict, log_path: str) -> None:
        self.port, self.http = free_port(), free_port()
        self.log_path = log_path
        self._log = open(log_path, "wb")  # noqa: SIM115 - closed by stop()
        self.proc = subprocess.Popen(
            [LMCACHE, "server", "--host", "127.0.0.1", "--port", str(self.port),
             "--http-port", str(self.http), "--l1-size-gb", "0.25", "--eviction-policy", "LRU",
             "--supported-transfer-mode", "engine_driven", "--l2-adapter", json.dumps(spec)],
            stdout=self._log, stderr=subprocess.STDOUT,
            env={**os.environ, "LMCACHE_DISABLE_BANNER": "1", "LMCACHE_LOG_LEVEL": "INFO"})
        why = wait_serving(self.proc, f"http://127.0.0.1:{self.http}/config", 120)
        assert not why, f"lmcache server {why}:\n{self.log()}"

    def log(self) -> str:
        if not self._log.closed:
            self._log.flush()
        with open(self.log_path, errors="replace") as f:
            return f.read()[-6000:]

    def client(self, mode: str) -> dict:
        r = subprocess.run([sys.executable, CLIENT, str(self.port), str(self.http), mode],
                           capture_output=True, text=True, timeout=180)
        lines = [ln for ln in r.stdout.splitlines() if ln.startswith("{")]
        assert r.returncode == 0 and lines, f"client failed:\n{r.stdout}\n{r.stderr[-4000:]}"
        return json.loads(lines[-1])

    def stop(self, timeout: float = 60) -> tuple[int, float]:
        """SIGTERM, as a supervisor stops it; (exit code, seconds to exit)."""
        t0 = time.monotonic()
        self.proc.send_signal(signal.SIGTERM)
        try:
            rc = self.proc.wait(timeout)
        finally:
            if self.proc.poll() is None:
                self.proc.kill()
            self._log.close()
        return rc, time.monotonic() - t0


@pytest.mark.skipif(not os.path.exists(LMCACHE), reason="the lmcache CLI is not installed")
def test_lmcache_server_stores_through_kvstream_and_a_new_server_serves_it(tier_dirs, tmp_path):
    # the second tier is throttled so that its copies are still deferred when SIGTERM comes
    spec = {"type": "plugin", "module_path": "kvstream_backend", "class_name": "KVStreamL2Adapter",
            "adapter_params": {"tiers": [
                {"name": "nvme", "path": tier_dirs[0], "max_size_gb": 1},
                {"name": "pfs", "path": tier_dirs[1], "max_size_gb": 1,
                 "emulate": {"write_mbps": 2}},
            ]}}
    first = Server(spec, str(tmp_path / "server1.log"))
    try:
        assert first.client("store") == {"stored": True}
        on_pfs_at_sigterm = len(chunk_files(tier_dirs[1]))
    finally:
        rc, took = first.stop()
    log = first.log()
    assert rc in (0, -signal.SIGTERM), f"server exit {rc}:\n{log}"
    assert "Traceback" not in log, log
    assert "kvstream L2 adapter: closed" in log, log
    # every chunk reached every tier: close drained the deferred copies before L1 was freed
    assert [len(chunk_files(d)) for d in tier_dirs] == [CHUNKS, CHUNKS], log
    assert took < 30, f"server took {took:.1f} s to exit after SIGTERM"
    assert on_pfs_at_sigterm < CHUNKS, "nothing was left to drain: the test shows nothing"

    second = Server(spec, str(tmp_path / "server2.log"))
    try:
        got = second.client("load")
    finally:
        second.stop()
    assert got == {"tokens": 2048, "identical": True}, second.log()
    assert "8 L2" in second.log(), "the retrieve was not served from the L2 adapter"
