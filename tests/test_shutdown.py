"""Shutdown as LMCache does it: ``StorageManager.close()`` frees LMCache's buffers (closing
LocalCPUBackend) before it closes kvstream. Staged writes must be finished or dropped first,
never written from freed memory; a fresh process then reads whole chunks only."""

from __future__ import annotations

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
