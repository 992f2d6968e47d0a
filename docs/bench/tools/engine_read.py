"""One tier read through the engine alone, beside the plain reader of the same files.

Usage: ``python engine_read.py DIR [MIB] [CHUNKS] [ROUNDS]`` (defaults 32 MiB x 64 chunks, 3
rounds). Writes CHUNKS chunks of MIB MiB into an engine tier at DIR, then per round, page cache
dropped before each read: the plain O_DIRECT reader (best of 1..cores threads), the engine with
checksums, and the engine without. Every engine read is one lookup-time read of all chunks
(``lookup_and_pin`` with ``read=``), then every handle taken and demanded, as LMCache's order
gives it. Prints GB/s per round and the ratios to the plain limit. KVS_OPTS (a JSON object) adds
``kvstream.*`` keys, KVS_TIER_OPTS keys of the tier (for example ``{"io": "uring"}``).
KVS_VARIANTS (a JSON list of ``[label, kvstream keys, tier keys, hash piece bytes or null]``,
optionally a fifth item ``true``: hash in Python even where ``_kvstream_native`` is built)
replaces the two engine reads with those variants, each read once per round on the same files.
"""

from __future__ import annotations

import json
import os
import shutil
import sys
import time

from kvstream_backend.bench.plain import best_read
from kvstream_backend.config import parse_config
from kvstream_backend.engine import Engine
from kvstream_backend.io import files, threads
from kvstream_backend.io.memory import AlignedBuffer
from kvstream_backend.tiers.tier import SUFFIX


def config(root: str, tier_opts: dict | None = None, **kw: object):
    tier = {"name": "t", "path": root, "max_size_gb": 64,
            **json.loads(os.environ.get("KVS_TIER_OPTS", "{}")), **(tier_opts or {})}
    d = {"kvstream.tiers": [tier],
         "kvstream.prefetch_max_gb": 64, "kvstream.staging_budget_mb": 16384}
    d.update({f"kvstream.{k}": v for k, v in kw.items()})
    d.update({f"kvstream.{k}": v for k, v in json.loads(os.environ.get("KVS_OPTS", "{}")).items()})
    return parse_config(d)


def fill(root: str, keys: list[str], size: int) -> None:
    shutil.rmtree(root, ignore_errors=True)
    os.makedirs(root)
    e = Engine(config(root))
    buf = AlignedBuffer(size)
    for i, k in enumerate(keys):
        buf.view[:size] = (i.to_bytes(8, "little") + os.urandom(56)) * (size // 64)
        assert e.write(k, buf, size, b"m")
        assert e.flush(600)  # one buffer for every chunk: written before it is refilled
    e.close()
    buf.release()


def engine_read(root: str, keys: list[str], size: int, pool: list[AlignedBuffer],
                tier_opts: dict | None = None, **kw: object) -> float:
    e = Engine(config(root, tier_opts, **kw))
    e.wait_warm(60)
    free = list(pool)
    files.drop_caches()
    t0 = time.perf_counter()
    e.lookup_and_pin("step", keys, read=lambda info: lambda n: free.pop())
    hs = [e.take("step", k) for k in keys]
    e.demand([h for h in hs if h is not None])
    for h in hs:
        assert h is not None and h.wait(120) is not None, "read failed"
    secs = time.perf_counter() - t0
    e.release("step")
    e.close()
    return len(keys) * size / secs / 1e9


def main() -> None:
    root = sys.argv[1]
    size = int(sys.argv[2] if len(sys.argv) > 2 else 32) << 20
    n = int(sys.argv[3]) if len(sys.argv) > 3 else 64
    rounds = int(sys.argv[4]) if len(sys.argv) > 4 else 3
    keys = [f"chunk{i}" for i in range(n)]
    fill(root, keys, size)
    paths = [os.path.join(dp, f) for dp, _, fs in os.walk(root) for f in fs
             if f.endswith(SUFFIX)]
    pool = [AlignedBuffer(size) for _ in keys]
    for b in pool:
        b.view[::4096] = b"x" * len(b.view[::4096])  # touched once, as LMCache's pool is
    cores = os.cpu_count() or 1
    variants = json.loads(os.environ.get("KVS_VARIANTS", "null")) or [
        ["checksums on", {}, {}, None], ["off", {"verify_checksums": False}, {}, None]]
    default_piece, native = threads.HASH_PIECE, threads._native
    print(f"native read-and-hash loop: {'built' if native else 'NOT built'}", flush=True)
    for r in range(rounds):
        limit, rates = best_read(paths, cores, files.drop_caches)
        per = " ".join(f"{t}:{v / 1e9:.1f}" for t, v in rates.items())
        got = []
        for label, opts, tier_opts, piece, *python in variants:
            threads.HASH_PIECE = piece or default_piece
            threads._native = None if python and python[0] else native
            v = engine_read(root, keys, size, pool, tier_opts, **opts)
            got.append(f"{label} {v:.2f} ({v / limit * 1e9:.2f}x)")
        print(f"round {r}: plain {limit / 1e9:.2f} GB/s ({per}); engine " + ", ".join(got),
              flush=True)
    for b in pool:
        b.release()
    shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    main()
