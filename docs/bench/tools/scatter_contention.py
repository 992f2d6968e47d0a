"""What slows LMCache's host->GPU scatter while a fast tier is read (issue 20, stop 39).

On an H200 (stop 38, docs/benchmarks.md) a kvstream step's first scatters took 17-55 ms while
/dev/shm's reads were in flight and 11 ms after (the disk alone: 11.5 ms throughout). Two
candidates, separated here:

* the host's memory: readers copying out of /dev/shm and the scatter kernel reading pinned host
  memory share it (``native-T``: T threads running kvstream's native read-and-hash loop, which
  holds no GIL while it reads, over 32 MiB chunk files into pinned buffers);
* the GIL: the completion loop and the tier workers take it around every read while the get's
  thread launches the scatter (``gil``: one thread holding the GIL in bursts of ``--burst-us``
  with ``--gap-us`` between them, the shape of a completion loop's turns);

each under the default switch interval (5 ms) and optionally a short one (``--switch-ms``), and
with the readers at the default priority and a lower one (``--nice``), or pinned away from the
scatter's thread (``--loads 15p``: is it a core of its own that the scatter's thread lacks?).

The step is LMCache's LocalCPUBackend step of ``kvstream bench --gpu``'s shape (every chunk hot
in pinned memory: the scatter and nothing else), timed per ``batched_to_gpu`` as the bench does,
and checked byte for byte against what was stored. Usage (a CUDA GPU, LMCache's ``cuda_ops``):
``python docs/bench/tools/scatter_contention.py --json OUT.json``.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import threading
import time
from typing import Any

for _k, _v in (("LMCACHE_TRACK_USAGE", "false"), ("DO_NOT_TRACK", "1"), ("PYTHONHASHSEED", "0")):
    os.environ.setdefault(_k, _v)

import torch  # noqa: E402

from kvstream_backend.bench import gpu_worker as gw  # noqa: E402
from kvstream_backend.io.threads import _native  # noqa: E402

CHUNK = 32 << 20


class Load:
    """Background threads started before a step and stopped after it; ``moved`` bytes read."""

    def __init__(self, readers: int, gil: bool, files: list[str], burst_s: float,
                 gap_s: float, nice: int, pin: bool = False) -> None:
        self.nice = nice
        self.pin = pin  # readers on CPUs 1.., this (the scatter's) thread on CPU 0
        self.stop = threading.Event()
        self.moved = 0
        self.lock = threading.Lock()
        self.threads = [threading.Thread(target=self._read, args=(files[i::readers], i),
                                         daemon=True) for i in range(readers)]
        if gil:
            self.threads.append(threading.Thread(target=self._hold, args=(burst_s, gap_s),
                                                 daemon=True))

    def _read(self, mine: list[str], i: int) -> None:
        if self.pin:  # threads start with their creator's affinity: CPU 0 alone, here
            cpus = sorted(self.cpus)[1:]
            os.sched_setaffinity(threading.get_native_id(), {cpus[i % len(cpus)]})
        if self.nice:  # this thread only (Linux: a thread's own nice value)
            os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), self.nice)
        buf = torch.empty(CHUNK, dtype=torch.uint8, pin_memory=not gw.DRY)
        seg = [(buf.data_ptr(), CHUNK)]
        fds = [os.open(f, os.O_RDONLY) for f in mine]
        try:
            while not self.stop.is_set():
                for fd in fds:
                    moved, _, err = _native.read_hashed(fd, seg, 0, 0, CHUNK, 1 << 20)
                    if err:
                        raise OSError(err, os.strerror(err))
                    with self.lock:
                        self.moved += moved
        finally:
            for fd in fds:
                os.close(fd)

    def _hold(self, burst_s: float, gap_s: float) -> None:
        os.sched_setaffinity(threading.get_native_id(), self.cpus)  # anywhere, as before
        while not self.stop.is_set():
            end = time.perf_counter() + burst_s
            while time.perf_counter() < end:  # pure Python: holds the GIL
                pass
            time.sleep(gap_s)

    def __enter__(self) -> Load:
        self.cpus = os.sched_getaffinity(0)
        if self.pin:
            os.sched_setaffinity(threading.get_native_id(), {min(self.cpus)})
        self.t0 = time.perf_counter()
        for t in self.threads:
            t.start()
        time.sleep(0.05)  # the readers at speed before the step
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop.set()
        for t in self.threads:
            t.join()
        os.sched_setaffinity(threading.get_native_id(), self.cpus)
        self.gbps = self.moved / (time.perf_counter() - self.t0) / 1e9


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--json", required=True)
    ap.add_argument("--shm", default="/dev/shm/kvstream-contention")
    ap.add_argument("--readers", default="0,4,8,12,16", help="reader thread counts")
    ap.add_argument("--nice", default="0,10", help="the reader threads' nice values")
    ap.add_argument("--iters", type=int, default=3, help="steps per load")
    ap.add_argument("--burst-us", type=float, default=300.0)
    ap.add_argument("--gap-us", type=float, default=700.0)
    ap.add_argument("--loads", default="",
                    help="instead of the readers x nice grid: loads such as 16,15p,15pg (a reader "
                         "count; p: readers pinned to CPUs 1.., the scatter's thread to CPU 0; g: "
                         "with the GIL holder)")
    ap.add_argument("--switch-ms", type=float, default=0.0,
                    help="also run every load under this switch interval (0: the default only)")
    a = ap.parse_args()
    if _native is None:
        sys.exit("the native read-and-hash loop is not built (docs/bench/tools/device_setup.sh)")
    torch.set_num_threads(1)  # as vLLM's GPU worker and the bench's retrieve processes
    s = gw.Shape(32, 8, 128, 16, 8, 4096)
    os.makedirs(a.shm, exist_ok=True)
    files = []
    for i in range(64):  # 2 GiB of chunk files, read round and round
        p = os.path.join(a.shm, f"c{i}")
        if not os.path.exists(p):
            with open(p, "wb") as f:
                f.write(os.urandom(1 << 20) * (CHUNK >> 20))
        files.append(p)
    work = os.path.join(a.shm, "work")
    os.makedirs(work, exist_ok=True)
    lmc = {"chunk_size": s.chunk, "local_cpu": True, "max_local_cpu_size": 9.0,
           "lmcache_instance_id": "kvstream-bench"}
    eng, conn = gw.build_engine("contention", lmc, s, work)
    tokens, blocks_s, blocks_r = gw._workload(s)
    kv = gw._kv(s, zero=False)
    ones = torch.ones(s.tokens, dtype=torch.bool)
    for r in range(s.requests):
        eng.store(tokens[r], mask=ones, kvcaches=kv,
                  slot_mapping=gw._slots(blocks_s[r], s.block_size).to(gw.device()), offset=0,
                  req_id=f"store-{r}")
    gw._sync()
    orig = [t.clone() for t in kv]  # the paged connector keeps its first call's KV pointers
    slots = [gw._slots(b, s.block_size) for b in blocks_r]
    tl = gw._Timeline(eng, conn)
    gw._step(eng, kv, tokens, slots, -1, tl)  # the kernels' first call, not measured
    rows: list[dict[str, Any]] = []
    default_switch = sys.getswitchinterval()
    most = max(int(n) for n in a.readers.split(","))
    loads = [(0, False, 0, False), (0, True, 0, False)]
    if a.loads:
        loads += [(int(x.rstrip("pg")), "g" in x, 0, "p" in x) for x in a.loads.split(",")]
    else:
        for nice in (int(x) for x in a.nice.split(",")):
            loads += [(int(n), False, nice, False) for n in a.readers.split(",") if int(n)]
            loads.append((most, True, nice, False))
    switches = [default_switch] + ([a.switch_ms / 1e3] if a.switch_ms else [])
    try:
        for switch in switches:
            sys.setswitchinterval(switch)
            for readers, gil, nice, pin in loads:
                steps = []
                with Load(readers, gil, files, a.burst_us / 1e6, a.gap_us / 1e6,
                          nice, pin) as load:
                    for it in range(a.iters):
                        st = gw._step(eng, kv, tokens, slots, it, tl)
                        st["identical"] = gw._verify(kv, orig, s, blocks_s, blocks_r,
                                                     st["retrieved"])
                        steps.append(st)
                scat = [x for st in steps for x in st["timeline"]["scatter_s"]]
                row = {"switch_ms": round(switch * 1e3, 2), "readers": readers, "gil": gil,
                       "nice": nice, "pinned": pin,
                       "step_s": [st["step_s"] for st in steps],
                       "h2d_s": [st["h2d_s"] for st in steps],
                       "scatter_median_s": round(statistics.median(scat), 4),
                       "scatter_max_s": round(max(scat), 4), "reader_gbps": round(load.gbps, 2),
                       "identical": all(st["identical"] for st in steps)}
                rows.append(row)
                print(json.dumps(row), flush=True)
    finally:
        eng.close()
        from lmcache.v1.cache_engine import LMCacheEngineBuilder

        LMCacheEngineBuilder.destroy("kvstream-bench")
        with open(a.json, "w") as f:
            json.dump({"shape": [s.layers, s.kv_heads, s.head_dim, s.block_size, s.requests,
                                 s.tokens], "burst_us": a.burst_us, "gap_us": a.gap_us,
                       "rows": rows}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
