"""Engine-level step in LMCache's order: lookups (lookup-time reads) for R requests, then one
get per request. Prints per-config step seconds and GB/s. Usage: engbench.py setup, then
engbench.py CONFIG... (CONFIG: shm, disk, disk+shm, ...; EB_MIB/EB_R/EB_C/EB_OPTS env).

Kept as run on the H200 (docs/benchmarks.md, issue 20): it drives the engine API of v0.1 and of
commit 5ba91df (``Engine.read(..., prefetch=True)``); from 4112b85 on, a lookup is
``engine.lookup_and_pin(owner, keys, read=...)`` followed by ``engine.take(owner, key)``."""
import os, sys, time, json, statistics, shutil
from kvstream_backend.config import parse_config
from kvstream_backend.engine import Engine
from kvstream_backend.io.memory import AlignedBuffer
from kvstream_backend.io import files

SIZE = int(os.environ.get("EB_MIB", "16")) << 20
R, C = int(os.environ.get("EB_R", "8")), int(os.environ.get("EB_C", "16"))
ROOT = {"disk": "/var/tmp/eb-disk", "shm": "/dev/shm/eb-shm"}

def cfg(tiers, **kw):
    d = {"kvstream.tiers": [{"name": t, "path": ROOT[t], "max_size_gb": 40} for t in tiers],
         "kvstream.prefetch_max_gb": 8, "kvstream.staging_budget_mb": 8192}
    d.update({f"kvstream.{k}": v for k, v in kw.items()})
    d.update({f"kvstream.{k}": v for k, v in json.loads(os.environ.get("EB_OPTS", "{}")).items()})
    return parse_config(d)

keys = [f"r{r}c{c}" for r in range(R) for c in range(C)]

def setup():
    for p in ROOT.values():
        shutil.rmtree(p, ignore_errors=True); os.makedirs(p)
    e = Engine(cfg(["disk", "shm"]))
    bufs = []
    for k in keys:
        b = AlignedBuffer(SIZE); b.view[:SIZE] = os.urandom(64) * (SIZE // 64); bufs.append(b)
        assert e.write(k, b, SIZE, b"m")
    assert e.flush(600); e.close()
    for b in bufs: b.release()

def step(tiers, **kw):
    e = Engine(cfg(tiers, **kw)); e.wait_warm(60)
    pool = [AlignedBuffer(SIZE) for _ in range(2 * R * C)]  # touched once, as LMCache's are
    for b in pool: b.view[::4096] = b"x" * len(b.view[::4096])
    alloc = lambda n: pool.pop()
    files.drop_caches()
    t0 = time.perf_counter()
    hs = []
    for r in range(R):  # the lookups: lookup-time reads
        reqs = []
        for k in keys[r*C:(r+1)*C]:
            info = e.lookup(k); reqs.append((k, info, None, alloc))
        hs.append(e.read(reqs, prefetch=True))
    ready = []
    for r in range(R):  # one get per request, in order
        e.demand(hs[r])
        for h in hs[r]:
            assert h.wait(60) is not None, h.reason
        ready.append(time.perf_counter() - t0)
    t = time.perf_counter() - t0
    for r in hs:
        for h in r: h.discard()
    st = e.stats()
    e.close()
    return t, ready[0], {x.name: x.read_bytes for x in st.tiers}

if __name__ == "__main__":
    if sys.argv[1] == "setup":
        setup(); sys.exit()
    out = {}
    for spec in sys.argv[1:]:
        tiers = spec.split("+")
        t, first, by = step(tiers)
        print(f"{spec:12s} step {t:.3f} s  {R*C*SIZE/t/1e9:5.2f} GB/s  first req ready {first:.3f}  bytes {by}", flush=True)
