"""CPU seconds per chunk read, by kvstream thread (stop 39): how much of each read's cost falls
on the completion loop and the tier threads, which take the GIL, beside the readers' copies.

Usage: ``python docs/bench/tools/thread_cpu.py [DIR] [MIB] [ROUNDS]`` (defaults /dev/shm, 8 MiB,
20 rounds). Writes 128 chunks into one engine tier under DIR, then per round looks up and pins all
of them with a lookup-time read, takes and demands every handle and waits for it, in LMCache's
order, in one warm engine. Prints GB/s and, per thread kind, CPU seconds (user + system, from
/proc) over the rounds and per read.
"""

from __future__ import annotations

import os
import shutil
import sys
import threading
import time

from engine_read import config, fill  # docs/bench/tools

from kvstream_backend.engine import Engine
from kvstream_backend.io.memory import AlignedBuffer


def cpu_by_kind() -> dict[str, float]:
    """CPU seconds of this process's threads, summed by name less its trailing index."""
    tick = os.sysconf("SC_CLK_TCK")
    out: dict[str, float] = {}
    for t in threading.enumerate():
        try:
            with open(f"/proc/self/task/{t.native_id}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
        except (OSError, TypeError):
            continue  # ended meanwhile
        kind = t.name.rstrip("0123456789")
        out[kind] = out.get(kind, 0.0) + (int(fields[11]) + int(fields[12])) / tick
    return out


def main() -> None:
    root = os.path.join(sys.argv[1] if len(sys.argv) > 1 else "/dev/shm", "kvstream-thread-cpu")
    size = int(sys.argv[2] if len(sys.argv) > 2 else 8) << 20
    rounds = int(sys.argv[3]) if len(sys.argv) > 3 else 20
    keys = [f"c{i}" for i in range(128)]
    fill(root, keys, size)
    pool = [AlignedBuffer(size) for _ in keys]
    e = Engine(config(root))
    e.wait_warm(60)
    c0, t0 = cpu_by_kind(), time.perf_counter()
    for _ in range(rounds):
        free = list(pool)
        e.lookup_and_pin("step", keys, read=lambda info, free=free: lambda n: free.pop())
        hs = [e.take("step", k) for k in keys]
        e.demand([h for h in hs if h is not None])
        for h in hs:
            assert h is not None and h.wait(60) is not None, "read failed"
        e.release("step")
    wall, c1 = time.perf_counter() - t0, cpu_by_kind()
    reads = rounds * len(keys)
    gbps = reads * size / wall / 1e9
    print(f"{reads} reads of {size >> 20} MiB in {wall:.2f} s ({gbps:.2f} GB/s)")
    for kind in sorted(c1, key=lambda k: c0.get(k, 0.0) - c1[k]):
        d = c1[kind] - c0.get(kind, 0.0)
        if d:
            print(f"  {kind:24s} {d:6.2f} CPU s, {d / reads * 1e6:7.1f} us per read")
    e.close()
    for b in pool:
        b.release()
    shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    main()
