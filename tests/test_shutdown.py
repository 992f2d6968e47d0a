"""Shutdown as LMCache does it: ``StorageManager.close()`` frees LMCache's buffers (closing
LocalCPUBackend) before it closes kvstream. Staged writes must be finished or dropped first,
never written from freed memory; a fresh process then reads whole chunks only."""

from __future__ import annotations

import glob
import json
import os
import subprocess
import sys
from pathlib import Path

from kvstream_backend.bench import workload as W

REPO = Path(__file__).resolve().parent.parent
SHAPE = W.Shape.from_bytes_per_token(65536, 64, 4)  # 16 MiB per 256-token chunk

_READER = """
import json, sys, torch
from kvstream_backend.bench import workload as W
tiers, n = json.loads(sys.argv[1]), int(sys.argv[2])
shape = W.Shape.from_bytes_per_token(65536, 64, 4)
sm = W.open_manager(W.kvstream_backend(tiers), shape, 0.5)
ref = torch.empty(2, shape.layers, 256, shape.hidden, dtype=W.DTYPE)
hits = same = 0
for i in range(n):
    key = shape.key(i)
    if sm.batched_contains([key], pin=True)[0] != 1:
        continue
    hits += 1
    (obj,) = sm.batched_get([key], location=W.location(sm))
    W.fill(ref, i)
    same += obj is not None and torch.equal(obj.tensor, ref)
    if obj is not None:
        obj.ref_count_down()
    sm.batched_unpin([key], [W.location(sm)])
sm.close()
print("REPORT " + json.dumps({"hits": hits, "identical": same}))
"""


def _tiers(dirs: list[str], **opts) -> list[dict]:
    return [{"name": f"t{i}", "path": d, "max_size_gb": 4, **opts} for i, d in enumerate(dirs)]


def _read_back(tiers: list[dict], n: int) -> dict:
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    out = subprocess.run([sys.executable, "-c", _READER, json.dumps(tiers), str(n)], env=env,
                         capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    line = [x for x in out.stdout.splitlines() if x.startswith("REPORT ")][-1]
    return json.loads(line[len("REPORT "):])


def test_close_right_after_64_puts_publishes_them_all(tier_dirs):
    for d in tier_dirs:
        os.makedirs(d, exist_ok=True)
    tiers = _tiers(tier_dirs)
    sm = W.open_manager(W.kvstream_backend(tiers), SHAPE, 1.5)
    kv = sm.storage_backends["kvstream"]
    W.put(sm, SHAPE, list(range(64)))
    sm.close()  # at once, as a server being stopped does: LocalCPUBackend is closed first
    st = kv.engine.stats()
    assert st.writes_dropped == 0 and st.writes_published == 64
    assert all(t.up and not t.errors for t in st.tiers), [(t.name, t.errors) for t in st.tiers]
    assert _read_back(tiers, 64) == {"hits": 64, "identical": 64}


def test_close_out_of_time_drops_whole_chunks_only(tier_dirs):
    for d in tier_dirs:
        os.makedirs(d, exist_ok=True)
    tiers = _tiers(tier_dirs, emulate={"write_mbps": 64})  # 4 chunks a second at most
    sm = W.open_manager(W.kvstream_backend(tiers, close_timeout_s=0.5), SHAPE, 1.5)
    kv = sm.storage_backends["kvstream"]
    W.put(sm, SHAPE, list(range(32)))
    sm.close()
    st = kv.engine.stats()
    assert st.writes_dropped > 0, "the close timeout should have run out"
    assert st.writes_published + st.writes_dropped + st.writes_failed == 32
    assert all(t.up for t in st.tiers), "a tier was marked down at shutdown"
    got = _read_back(_tiers(tier_dirs), 32)
    assert got["hits"] == got["identical"] == st.writes_published


_SERVER = """
import json, signal, sys, time
from kvstream_backend.bench import workload as W
tiers, n = json.loads(sys.argv[1]), int(sys.argv[2])
shape = W.Shape.from_bytes_per_token(65536, 64, 4)
def stop(signum, frame):  # what servers do on SIGTERM: unwind and shut down
    raise SystemExit(0)
signal.signal(signal.SIGTERM, stop)
sm = W.open_manager(W.kvstream_backend(tiers, close_timeout_s=1), shape, 1.5)
try:
    W.put(sm, shape, list(range(n)))
    print("PUT", flush=True)
    time.sleep(60)
finally:
    sm.close()
"""


def test_sigterm_mid_write_no_crash_and_only_whole_chunks(tier_dirs):
    tiers = _tiers(tier_dirs, emulate={"write_mbps": 200})  # the writes are still going on
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    p = subprocess.Popen([sys.executable, "-c", _SERVER, json.dumps(tiers), "48"], env=env,
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    assert p.stdout is not None and p.stdout.readline().strip() == "PUT"
    p.send_signal(15)
    _, err = p.communicate(timeout=120)
    assert p.returncode == 0, f"exit {p.returncode}: {err[-2000:]}"
    assert "marked DOWN" not in err
    got = _read_back(_tiers(tier_dirs), 48)
    assert 0 < got["hits"] == got["identical"], got
    leftovers = [f for d in tier_dirs for f in os.listdir(os.path.join(d, "kvs1", "tmp"))]
    assert leftovers == [], "a temporary file outlived a graceful shutdown"


def test_lmcache_engine_close_publishes_what_was_stored(tmp_path, tier_dirs):
    import torch
    from lmcache.v1.cache_engine import LMCacheEngineBuilder
    from lmcache.v1.config import LMCacheEngineConfig

    from . import lmcache_helpers as H

    y = H.write_yaml(tmp_path / "e.yaml", tier_dirs)
    name = f"kvs-close-{os.getpid()}"
    eng = LMCacheEngineBuilder.get_or_create(name, LMCacheEngineConfig.from_file(str(y)),
                                             H.metadata(), H.CPUConnector(),
                                             lambda t, r: None, lambda o, r: o)
    eng.post_init(async_lookup_server=H.LookupServerStub())
    tokens = list(range(5000, 5000 + 64 * 256))  # 64 chunks, stored and closed at once
    src = torch.randn(2, H.LAYERS, len(tokens), H.HIDDEN).to(H.DTYPE)
    eng.store(tokens, kv=src)
    kv = eng.storage_manager.storage_backends["kvstream"]
    LMCacheEngineBuilder.destroy(name)  # LMCacheEngine.close -> StorageManager.close
    st = kv.engine.stats()
    assert st.writes_published == 64 and st.writes_dropped == 0
    assert all(t.up and not t.errors for t in st.tiers)
    files = [f for d in tier_dirs for f in glob.glob(os.path.join(d, "kvs1", "chunks", "*", "*",
                                                                  "*.kvs"))]
    assert len(files) == 2 * 64
