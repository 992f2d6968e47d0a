"""``kvstream bench``: every configuration measured in one run, on the same chunks.

Configurations (see README and docs/benchmarks.md): (a) ``kvstream`` all tiers, completion
routing, and ``kvstream-rev`` the same tiers listed in the reverse order; with an emulated
second tier also ``fast``/``fast-rev`` (that tier unthrottled, in both orders),
``fast-alone`` and ``fast-warm``, else ``kvstream-warm`` (the ``-warm`` row keeps its engine
across rounds, as a server does; every other kvstream row opens a new one per step, which
starts from the rates the one before saved: ``remember_rates``); (b)
``kvstream-first`` and ``kvstream-second``, one tier each; (c) ``static-g`` fixed splits;
(d) ``lmcache-disk``, LMCache's own LocalDiskBackend on the first tier with O_DIRECT; (a)/(d)
again with a write backlog as large as a step's reads (``+backlog``) and with the next
requests' lookups arriving while the step retrieves (``+load``); and (e)
``limit-<tier>``, each tier's read limit measured apart from the engine on the same chunk files:
fio (io_uring, O_DIRECT), or where fio is absent a plain O_DIRECT thread-pool reader. The bound
D/sum(b_k) comes from (e) only, never from kvstream's own rows; each b_k is the tier's best
round, since noise only ever slows a read (a virtio disk varies by +-25% from pass to pass, and
a median limit put kvstream's step under its own bound).
"""

from __future__ import annotations

import argparse
import collections
import functools
import os
import platform
import resource
import shutil
import statistics
import tempfile
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

from .. import format as fmt
from ..argtypes import setting
from ..config import ConfigError, parse_config
from ..io import files
from ..tiers.emulate import serial_seconds, tier_throttle
from .report import BenchReport, ConfigResult, Target, TierResult, WriteRow, plot, render, save
from .settings import settings, settings_notes

DEFAULT_PFS = {"read_mbps": 600, "write_mbps": 400, "jitter": 0.35, "pattern": "bursty",
               "period_s": 1.0, "seed": 1}
GiB = 1 << 30


def add_bench_parser(sub: Any) -> None:
    p = sub.add_parser("bench", help="the main job: kvstream vs static splits, LMCache's disk "
                       "backend and fio, side by side", description=__doc__,
                       formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--tier", action="append", default=[], metavar="PATH[:k=v,...]",
                   help="a real tier directory, optionally emulated (read_mbps=, write_mbps=, "
                   "jitter=, pattern=, period_s=, seed=); repeat for each tier. The run works "
                   "in a new subdirectory of it, removed at the end (unless --keep). Default: "
                   "a local-disk tier and a throttled, fluctuating tmpfs tier")
    p.add_argument("--requests", type=int, default=None, help="requests per step (R)")
    p.add_argument("--chunks", type=int, default=None, help="matched chunks per request (C)")
    p.add_argument("--steps", type=int, default=None, help="measured steps per configuration")
    p.add_argument("--kv-bytes-per-token", type=int, default=65536,
                   help="per-rank KV bytes per token (default: a 32B GQA model at TP=4, "
                   "64 layers: 16 MiB per 256-token chunk)")
    p.add_argument("--layers", type=int, default=64)
    p.add_argument("--write-rounds", type=int, default=3,
                   help="interleaved write rounds (kvstream, each tier's write limit, "
                   "LMCache's disk backend), each putting two steps' chunks")
    p.add_argument("--claim-batch", type=int, default=4)
    p.add_argument("--set", action="append", type=setting, default=[], metavar="KEY=VALUE",
                   help="a kvstream.* key for every kvstream configuration, over the bench's "
                   "own (repeat; e.g. --set read_target_ms=25); with --gpu too")
    p.add_argument("--quick", action="store_true", help="a smaller run (< 3 min on 2 cores)")
    p.add_argument("--workdir", default="/var/tmp", help="where the local-disk tier is created")
    p.add_argument("--json", metavar="FILE", help="write every measurement as JSON")
    p.add_argument("--plot", metavar="FILE.png", help="per-tier bandwidth and gap per config")
    p.add_argument("--keep", action="store_true", help="keep the tier directories")
    g = p.add_argument_group("GPU (kvstream bench --gpu: LMCache's CUDA connector, cuda:0)")
    g.add_argument("--gpu", action="store_true",
                   help="measure the step through LMCache's paged GPU connector instead "
                   "(refuses without CUDA); --requests, --workdir and --json apply")
    g.add_argument("--gpu-shape", default="32,8,128,16", metavar="L,H,D,BS",
                   help="layers, KV heads, head dim, block size (default: Llama-3.1-8B)")
    g.add_argument("--gpu-tokens", type=int, default=4096, help="tokens per request")
    g.add_argument("--gpu-rounds", type=int, default=2, help="interleaved rounds")
    g.add_argument("--gpu-iters", type=int, default=2, help="steps per configuration and round")
    g.add_argument("--gpu-shm", default="/dev/shm", help="where the memory tier is created")
    g.add_argument("--gpu-only", metavar="A,B,...",
                   help="run only these configurations (kvstream-disk, kvstream-shm, kvstream, "
                   "kvstream-rev, static-0.5, static-0.7, kvstream-emu, limits, lmcache-disk, "
                   "lmcache-cpu; default: all); with --trace, the replay's: kvstream, "
                   "kvstream-disk, kvstream-shm, static-best, lmcache-disk, lmcache-cpu, "
                   "nocache, kvstream-last")
    g.add_argument("--gpu-torch-threads", type=int, default=1, metavar="N",
                   help="torch intra-op threads in each phase (default 1, as vLLM's GPU "
                   "worker serves; 0: torch's default, one per core)")
    g.add_argument("--gpu-cold", action="store_true",
                   help="no warm-up: step 0 of each retrieve process also makes the GPU "
                   "connector's first call (default: one chunk of other tokens is stored and "
                   "retrieved first, as a serving process has before its first request)")
    g.add_argument("--trace", metavar="NAME|FILE",
                   help="with --gpu: time to first token under a request trace instead "
                   "(conversation, synthetic: the bundled Mooncake traces; or a .jsonl file)")
    g.add_argument("--trace-requests", type=int, default=48,
                   help="replay the burstiest N consecutive requests of the trace")
    g.add_argument("--trace-scale", type=float, default=1.0,
                   help="divide the trace's inter-arrival times by this")
    g.add_argument("--token-budget", type=int, default=16384,
                   help="tokens prefilled per batch (vLLM's max_num_batched_tokens)")
    g.add_argument("--rescore", metavar="REPORT.json",
                   help="with --gpu --trace: no replay, no GPU; kvsim's predictions and the "
                   "targets again from a stored report's measurements (its trace, requests, "
                   "scale and budget; --json writes the rescored report)")
    p.set_defaults(func=run)


def parse_tier(spec: str, name: str) -> dict[str, Any]:
    path, _, opts = spec.partition(":")
    tier: dict[str, Any] = {"name": name, "path": os.path.abspath(path)}
    if opts:
        em: dict[str, Any] = {}
        for kv in opts.split(","):
            k, _, v = kv.partition("=")
            em[k.strip()] = v.strip()
        tier["emulate"] = em
    return tier


def run(args: argparse.Namespace) -> int:
    os.environ.setdefault("LMCACHE_TRACK_USAGE", "false")
    os.environ.setdefault("LMCACHE_LOG_LEVEL", "ERROR")
    import logging

    from rich.console import Console

    for name in ("lmcache", "kvstream"):
        logging.getLogger(name).setLevel(logging.ERROR)
    console = Console()
    try:
        args.settings = settings(args.set)
    except ConfigError as e:
        console.print(f"[red]error:[/] {e}")
        return 2
    if args.gpu and (args.trace or args.rescore):
        from .replay import run_replay

        return run_replay(args, console)
    if args.gpu:
        from .gpu import run_gpu

        return run_gpu(args, console)
    try:
        bench = Bench(args, console)
    except (ValueError, ConfigError) as e:
        console.print(f"[red]error:[/] {e}")
        return 2
    try:
        report = bench.run()
    finally:
        bench.cleanup()
    render(report, console)
    if args.json:
        save(report, args.json)
        console.print(f"wrote {args.json}")
    if args.plot:
        plot(report, args.plot)
        console.print(f"wrote {args.plot}")
    return 0


class Bench:
    """One benchmark run: its tiers, workload and measurements (see the module doc)."""

    def __init__(self, args: argparse.Namespace, console: Any) -> None:
        from . import fio, plain
        from . import workload as W

        self.args, self.console, self.W, self.fio, self.plain = args, console, W, fio, plain
        self.R = args.requests or (4 if args.quick else 8)
        self.C = args.chunks or 8
        self.S = args.steps or (2 if args.quick else 5)
        self.write_rounds = args.write_rounds
        self.shape = W.Shape.from_bytes_per_token(args.kv_bytes_per_token, args.layers, 4)
        self.D = self.R * self.C * self.shape.chunk_bytes
        self.requests = [[r * self.C + j for j in range(self.C)] for r in range(self.R)]
        self.idx = [i for r in self.requests for i in r]
        n = self.R * self.C  # the next step's requests (their lookups are the load)
        self.next_requests = [[n + r * self.C + j for j in range(self.C)] for r in range(self.R)]
        self.next_idx = [i for r in self.next_requests for i in r]
        self.notes: list[str] = settings_notes(args.settings)
        self._cleanup: list[str] = []
        if args.tier:
            self.tiers = [parse_tier(s, f"tier{i}") for i, s in enumerate(args.tier)]
            where = "--tier"
        else:  # the default: a local-disk tier and an emulated network file system on tmpfs
            self.tiers = [{"name": "nvme", "path": args.workdir},
                          {"name": "pfs", "path": "/dev/shm", "emulate": DEFAULT_PFS}]
            where = "--workdir"
        self.cap_gb = (5 * self.D + (self.S + 2) * self.D) / GiB * 1.2
        # checked before the run makes a directory of its own (none is left on a bad spec)
        for t in self.tiers:
            t.setdefault("max_size_gb", self.cap_gb)
            if not os.path.isdir(t["path"]):
                raise ValueError(f"{where} {t['path']}: no such directory (is it mounted?)")
            if not os.access(t["path"], os.W_OK | os.X_OK):
                raise ValueError(f"{where} {t['path']}: not writable")
        self.emulate = [t.emulate for t in
                        parse_config({"kvstream.tiers": self.tiers}, check_paths=False).tiers]
        if len(self.tiers) < 2:
            raise ValueError("the benchmark needs two tiers (--tier twice)")
        for t in self.tiers:  # a directory of this run's own: chunks an earlier run left
            t["path"] = tempfile.mkdtemp(prefix="kvstream-bench-", dir=t["path"])
            self._cleanup.append(t["path"])  # would make its first writes no-ops
        if not args.tier:
            self.notes.append(
                f"embedded tiers: 'nvme' = {self.tiers[0]['path']} (local disk, real I/O); "
                f"'pfs' = {self.tiers[1]['path']} (tmpfs) EMULATED as a network file system: "
                f"{DEFAULT_PFS}")
        # LMCache 0.5.6's LocalDiskBackend.remove() lowers `usage` but not the
        # `current_cache_size` it admits by (only its evictions do): every byte the run puts
        # stays counted, so its capacity holds them all (the write rounds and each round's
        # backlog), or it evicts the chunks the steps read
        self.disk_cap_gb = self.cap_gb + (2 * args.write_rounds + self.S + 1) * self.D / GiB
        # LMCache's host memory per StorageManager: a step, the next step's prefetches and a
        # write backlog (two managers may be open at once: kvstream's and LMCache disk's)
        self.mem_gb = 3 * self.D / GiB + 0.5
        self._open: dict[str, Any] = {}

    def cleanup(self) -> None:
        for sm in self._open.values():
            sm.close()
        self._open.clear()
        if not self.args.keep:
            for d in self._cleanup:
                shutil.rmtree(d, ignore_errors=True)

    def configs(self) -> list[Config]:
        m, t = self.args.claim_batch, self.tiers

        def kv(tiers: list[dict[str, Any]], **keys: Any) -> dict[str, Any]:
            return self.W.kvstream_backend(tiers, prefetch_max_gb=self.D / GiB,
                                           **{**keys, **self.args.settings})

        disk_dir = os.path.join(t[0]["path"], "lmcache-disk")
        os.makedirs(disk_dir, exist_ok=True)
        base = [
            Config("kvstream", "all tiers, completion-driven routing", kv(t, claim_batch=m)),
            Config("kvstream-first", "first tier only", kv(t[:1], claim_batch=m)),
            Config("kvstream-second", "second tier only", kv(t[1:2], claim_batch=m)),
            *[Config(f"static-{g}", f"replicated, fixed split {g}:{1 - g:.1f}",
                     kv(t[:2], claim_batch=m, static_split=g)) for g in (0.5, 0.7, 0.9)],
            # LMCache's disk index lives in memory only: its StorageManager stays open.
            Config("lmcache-disk", "LMCache LocalDiskBackend, first tier, O_DIRECT",
                   self.W.local_disk_backend(disk_dir, self.disk_cap_gb), persistent=True),
        ]
        rev = t[1::-1]  # a user lists tiers in any order: the speed must not depend on it
        base.insert(1, Config("kvstream-rev", "all tiers, listed in the reverse order",
                              kv(rev, claim_batch=m)))
        # Every other kvstream row opens a new engine per step (a restarted process: its router
        # starts from the rates the engine before saved, unless --set remember_rates=false); one
        # row keeps its engine across rounds, as a server does.
        warm = "its engine kept across rounds (a serving process: the tiers' rates measured)"
        if t[1].get("emulate"):  # the second tier unthrottled: a fast second tier (tmpfs)
            fast = [t[0], {k: v for k, v in t[1].items() if k != "emulate"}]
            base[2:2] = [
                Config("fast", "first tier + the second unthrottled", kv(fast, claim_batch=m)),
                Config("fast-rev", "the same, listed in the reverse order",
                       kv(fast[::-1], claim_batch=m)),
                Config("fast-alone", "the second tier unthrottled, alone",
                       kv(fast[1:], claim_batch=m)),
                Config("fast-warm", f"first tier + the second unthrottled, {warm}",
                       kv(fast, claim_batch=m), persistent=True),
            ]
        else:
            base.insert(2, Config("kvstream-warm", f"all tiers, {warm}", kv(t, claim_batch=m),
                                  persistent=True))
        a, d = base[0], base[-1]
        budget_mb = max(1, (self.D >> 20) // 2)  # half the backlog: the bound must act
        return base + [
            Config("kvstream+backlog", f"{a.desc}, a write backlog = the step's reads, staging "
                   f"budget {budget_mb} MB", kv(t, claim_batch=m, staging_budget_mb=budget_mb),
                   backlog=len(self.idx)),
            Config("lmcache-disk+backlog", f"{d.desc}, a write backlog = the step's reads",
                   d.backend, backlog=len(self.idx), persistent=True, base=d.name),
        ] + [
            Config(f"{c.name}+load", f"{c.desc}, next requests' lookups arriving mid-step",
                   c.backend, load=True, persistent=c.persistent, base=c.name)
            for c in (a, d)
        ]

    def _manager(self, c: Config) -> Any:
        key = c.base or c.name
        if key not in self._open:
            self._open[key] = self.W.open_manager(c.backend, self.shape, self.mem_gb)
        return self._open[key]

    def _release(self, c: Config) -> None:
        if not c.persistent:
            self._open.pop(c.base or c.name).close()

    def run(self) -> BenchReport:
        from rich.progress import Progress

        W, S, D = self.W, self.S, self.D
        configs = self.configs()
        results = {c.name: ConfigResult(c.name, c.desc, [], [], D) for c in configs}
        limit_tool = "fio" if self.fio.available() else "plain"
        if limit_tool == "plain":
            self.notes.append("fio is not installed: each tier's limit is measured with a "
                              "plain O_DIRECT thread-pool reader (kvstream_backend.bench.plain)")
        for t in self.tiers:
            desc = (f"{limit_tool} O_DIRECT read of kvstream's chunk files on {t['name']} "
                    "(the device limit, apart from the engine)")
            results[f"limit-{t['name']}"] = ConfigResult(f"limit-{t['name']}", desc, [], [], D)
        dropped = files.drop_caches()
        if not dropped:
            self.notes.append("could not drop the page cache (not root): O_DIRECT paths are "
                              "unaffected, buffered fallbacks may read from memory")
        self.console.print(
            f"kvstream bench: {self.R} requests x {self.C} chunks = {D / GiB:.2f} GiB per step "
            f"({self.shape.chunk_bytes >> 20} MiB chunks), {S} rounds over "
            f"{len(results)} configurations")
        with Progress(console=self.console, transient=True) as prog:
            wr = self.write_rounds
            task = prog.add_task("writing", total=(S + 1) * len(results)
                                 + wr * (2 + len(self.tiers)))
            writes = self._writes(configs, limit_tool, prog, task)
            # Every path measured here is O_DIRECT, so the page cache is dropped once, not
            # before each step: that would also evict torch's and LMCache's code, and the
            # timed lookups would page it back in from the very disk under test. Configs that
            # read through the page cache (a tier without O_DIRECT) still drop before a step.
            files.drop_caches()
            seq = 0
            for rnd in range(-1, S):  # round -1 warms up; round-robin spreads the noise
                label = "warm-up" if rnd < 0 else f"round {rnd + 1}/{S}"
                for c in configs:
                    prog.update(task, description=f"{label}: {c.name}")
                    sm = self._manager(c)
                    pending = list(range(10**6 + seq, 10**6 + seq + c.backlog))
                    seq += c.backlog
                    if W.uses_page_cache(sm):
                        files.drop_caches()
                    t_put: list[float] = []

                    def backlog(sm: Any = sm, pending: list[int] = pending,
                                t_put: list[float] = t_put) -> None:
                        t_put.append(time.perf_counter())
                        W.put(sm, self.shape, pending)

                    with _CpuMeter() as cpu:
                        # the backlog is put once the step's reads are in flight (vLLM: step
                        # N's saves arrive while step N+1's lookups have started its reads)
                        r = W.step(sm, self.shape, self.requests, verify=rnd < 0,
                                   after_lookups=backlog if pending else None,
                                   between_gets=functools.partial(self._next_lookup, sm)
                                   if c.load else None)
                    if c.load:
                        for req in self.next_requests:
                            W.unpin(sm, self.shape, req)
                    if rnd >= 0:
                        _record(results[c.name], r, cpu)
                    if pending:  # replicated, then removed: the tiers do not fill up
                        W.wait_puts(sm, self.shape, pending)
                        if rnd >= 0:  # until the backlog is on every tier, not only the reads
                            results[c.name].backlog_s.append(time.perf_counter() - t_put[0])
                        W.remove(sm, self.shape, pending)
                    self._release(c)
                    prog.advance(task)
                for t in self.tiers:
                    prog.update(task, description=f"{label}: limit of {t['name']}")
                    paths = _chunk_files(t["path"], self.shape, self.idx)
                    depth = self.args.claim_batch * 2
                    with _CpuMeter() as cpu:
                        if limit_tool == "fio":
                            block = min(4 << 20, self.shape.chunk_bytes)
                            secs, nbytes = self.fio.read_files(paths, block, depth, t["path"])
                        else:
                            secs, nbytes = self.plain.read_files(paths, depth)
                    if rnd >= 0:
                        res = results[f"limit-{t['name']}"]
                        res.step_s.append(secs * D / nbytes)
                        res.cpu_s.append(cpu.proc_s)
                        res.machine_cpu_s.append(cpu.machine_s)
                    prog.advance(task)
        return _report(list(results.values()), D, self.R, self.C, S, self.shape, self.tiers,
                       self.notes, dropped, limit_tool, writes)

    def _writes(self, configs: list[Config], limit_tool: str, prog: Any,
                task: Any) -> dict[str, list[float]]:
        """Interleaved write rounds: kvstream and LMCache's disk backend each put the two
        steps' chunks (the step's and the next step's), and each tier's write limit is taken
        right after kvstream's, before its StorageManager closes: in the same state, LMCache's
        host buffers still resident (on a VM the rate at which a tmpfs-backed file system gets
        fresh pages falls several-fold with the memory in use, so a limit taken with those
        buffers freed, or apart from the run, is a different machine). Every
        round but the last removes what it wrote; the last round's chunks are the ones read.
        Returns seconds per round for ``kvstream`` (every copy finished), ``kvstream-visible``
        (every chunk's first copy published), ``lmcache-disk`` and ``limit-<tier>``."""
        W, D, idx = self.W, self.D, self.idx + self.next_idx
        out: dict[str, list[float]] = collections.defaultdict(list)
        for rnd in range(self.write_rounds):
            last = rnd == self.write_rounds - 1
            for c in (configs[0], next(c for c in configs if c.name == "lmcache-disk")):
                prog.update(task, description=f"writes {rnd + 1}/{self.write_rounds}: {c.name}")
                sm = self._manager(c)
                keys, objs = W.chunks(sm, self.shape, idx)
                t0 = time.perf_counter()  # from the hand-off: filling the tensors is not I/O
                sm.batched_put(keys, objs)
                visible = W.wait_visible(sm, self.shape, idx)
                W.wait_puts(sm, self.shape, idx)
                out[c.name].append(time.perf_counter() - t0)
                if visible is not None:
                    out["kvstream-visible"].append(visible)
                if not last:
                    W.remove(sm, self.shape, idx)
                if c is configs[0]:  # the limits right after kvstream's copies, with its
                    for i, t in enumerate(self.tiers):  # LMCache buffers still resident
                        (secs,) = self._write_limits([i], limit_tool, 2 * D)
                        out[f"limit-{t['name']}"].append(secs)
                        prog.advance(task)
                    every = range(len(self.tiers))
                    for t, secs in zip(self.tiers, self._write_limits(every, limit_tool, 2 * D),
                                       strict=True):
                        out[f"limit-{t['name']}+others"].append(secs)
                self._release(c)
                prog.advance(task)
        return out

    def _write_limits(self, tiers: Iterable[int], tool: str, size: int) -> list[float]:
        """Seconds each of ``tiers`` takes to write ``size`` bytes at its limit, apart from
        the engine, the tiers written at once (fio, or the plain writer). An emulated tier is
        the slower of the file system under it and its own write throttle replayed over the
        round's chunk files: the throttle can only slow a tier down."""
        tiers = list(tiers)
        block, depth = min(4 << 20, self.shape.chunk_bytes), self.args.claim_batch * 2
        mod = self.fio if tool == "fio" else self.plain
        measured = mod.write_files([self.tiers[i]["path"] for i in tiers], size, block, depth)
        sizes = [fmt.HEADER_SIZE + fmt.padded(self.shape.chunk_bytes)] * (
            size // self.shape.chunk_bytes)
        out = []
        for i, (secs, nbytes) in zip(tiers, measured, strict=True):
            secs *= size / nbytes
            em = self.emulate[i]
            throttle = tier_throttle(em, i, write=True) if em else None
            if throttle is not None:
                secs = max(secs, serial_seconds(throttle, sizes))
            out.append(secs)
        return out

    def _next_lookup(self, sm: Any, r: int) -> None:
        """After request ``r``'s get: the lookup of the next step's request ``r``."""
        self.W.lookups(sm, self.shape, self.next_requests[r])


class _CpuMeter:
    """CPU seconds of this process and of the whole machine (all processes: a FUSE client
    and brick included) over a ``with`` block."""

    def __enter__(self) -> _CpuMeter:
        self._p0 = _proc_cpu()
        self._m0 = _machine_cpu()
        return self

    def __exit__(self, *exc: object) -> None:
        self.proc_s = _proc_cpu() - self._p0
        self.machine_s = _machine_cpu() - self._m0


def _proc_cpu() -> float:
    ru = resource.getrusage(resource.RUSAGE_SELF)
    return ru.ru_utime + ru.ru_stime


def _machine_cpu() -> float:
    """Busy CPU seconds of the machine so far (/proc/stat: all but idle and iowait)."""
    with open("/proc/stat") as f:
        fields = [int(x) for x in f.readline().split()[1:]]
    busy = sum(fields) - fields[3] - fields[4]
    return busy / os.sysconf("SC_CLK_TCK")


@dataclass(frozen=True)
class Config:
    name: str
    desc: str
    backend: dict[str, Any]
    persistent: bool = False  # keep the StorageManager open between rounds
    backlog: int = 0  # chunks written just before each step
    load: bool = False  # the next requests' lookups arrive between this step's gets
    base: str = ""  # the config whose StorageManager this one shares


def _record(res: ConfigResult, r: Any, cpu: _CpuMeter) -> None:
    """Add one measured step (and kvstream's per-tier accounting) to ``res``."""
    res.step_s.append(r.time_s)
    res.lookup_s.append(r.lookup_s)
    res.cpu_s.append(cpu.proc_s)
    res.machine_cpu_s.append(cpu.machine_s)
    for rep in r.engine_steps:
        res.engine_gap.append(rep.gap)
    for t in r.tiers:  # every read of the step, its prefetches included
        res.tier_gbps_per_step.setdefault(t.name, []).append(
            t.bytes / t.busy_s / 1e9 if t.busy_s else 0.0)
        res.tier_samples.setdefault(t.name, []).append((t.bytes, t.busy_s))
        res.tier_reads.setdefault(t.name, []).append((t.reads, t.lost, t.read_s))
    res.tiers = []
    for name, xs in res.tier_samples.items():
        b = int(statistics.median(x[0] for x in xs))
        busy = statistics.median(x[1] for x in xs)
        rs = res.tier_reads[name]
        n = sum(x[0] for x in rs)
        res.tiers.append(TierResult(
            name, b, busy, b / busy / 1e9 if busy else 0.0,
            reads=statistics.median(x[0] for x in rs), lost=statistics.median(x[1] for x in rs),
            mean_read_ms=1e3 * sum(x[2] for x in rs) / n if n else 0.0))


def _chunk_files(root: str, shape: Any, idx: list[int]) -> list[str]:
    from ..format import key_digest
    from ..tiers.tier import LAYOUT, SUFFIX

    out = []
    for i in idx:
        h = key_digest(shape.key(i).to_string()).hex()
        out.append(os.path.join(root, LAYOUT, "chunks", h[:2], h[2:4], h + SUFFIX))
    return out


def _report(results: list[ConfigResult], D: int, R: int, C: int, S: int, shape: Any,
            tiers: list[dict[str, Any]], notes: list[str], dropped: bool,
            limit_tool: str, writes: dict[str, list[float]]) -> BenchReport:
    """Derive each tier's limit b_k (its best round), the bound D/sum(b_k) and the targets."""
    by = {c.name: c for c in results}
    limits = []
    for t in tiers:
        b = D / min(by[f"limit-{t['name']}"].step_s)
        em = t.get("emulate") or {}
        if em.get("read_mbps"):  # the throttle is invisible to fio: its nominal rate is the limit
            nominal = float(em["read_mbps"]) * (1 << 20)
            notes.append(f"{t['name']} is emulated: its limit is the nominal "
                         f"{nominal / 1e9:.2f} GB/s (the file system under it reads "
                         f"{b / 1e9:.2f} GB/s)")
            b = min(b, nominal)
        limits.append(b)
    notes.append("each tier's limit b_k is its best round ("
                 + ", ".join(f"{t['name']} {lim / 1e9:.2f} GB/s" for t, lim in
                             zip(tiers, limits, strict=True))
                 + "): noise only slows a read; the table's limit rows are medians")
    bound = D / sum(limits)
    a, d = by["kvstream"], by["lmcache-disk"]
    targets = [Target("kvstream step / bound - 1", a.median_s / bound - 1, "<= 0.05",
                      a.median_s / bound - 1 <= 0.05)]
    if a.median_s < 0.97 * bound:
        notes.append(f"MEASUREMENT ERROR: kvstream's median step ({a.median_s:.3f} s) is "
                     f"{1 - a.median_s / bound:.1%} under the bound ({bound:.3f} s): the limits "
                     "were under-measured (noise, or a cache serving reads)")
        targets.append(Target("step under the bound (measurement error)",
                              a.median_s / bound, ">= 0.97", False))
    singles = [by["kvstream-first"], by["kvstream-second"]]
    best_single = min(singles, key=lambda c: c.median_s)
    targets.append(Target(f"kvstream / best single tier ({best_single.name})",
                          a.median_s / best_single.median_s, "< 1",
                          a.median_s < best_single.median_s))
    statics = [c for c in results if c.name.startswith("static-")]
    best_static = min(statics, key=lambda c: c.median_s)
    targets.append(Target(f"kvstream / best static ({best_static.name})",
                          a.median_s / best_static.median_s, "< 1",
                          a.median_s < best_static.median_s))
    targets.append(Target("speedup vs lmcache-disk", d.median_s / a.median_s, ">= 1.5",
                          d.median_s / a.median_s >= 1.5))
    ratio = D / limits[0] / by["kvstream-first"].median_s
    targets.append(Target(f"kvstream-first bandwidth / {limit_tool} limit", ratio, ">= 0.95",
                          ratio >= 0.95))
    share = _first_share(a)
    want = limits[0] / sum(limits)
    if share is not None:
        targets.append(Target(f"first tier's share of bytes (its share of sum(b_k) "
                              f"{want:.2f})", share, f"{want:.2f} +- 0.10",
                              abs(share - want) <= 0.10))
    rv = by["kvstream-rev"]
    targets.append(Target("kvstream, tiers listed in reverse / best single tier",
                          rv.median_s / best_single.median_s, "< 1",
                          rv.median_s < best_single.median_s))
    if "kvstream-warm" in by:
        r = by["kvstream-warm"].median_s / best_single.median_s
        targets.append(Target("kvstream-warm (engine kept across rounds) / best single tier", r,
                              "< 1", r < 1))
    if "fast" in by:  # a fast second tier must add to the first, in either order
        fast_single = min(by["kvstream-first"].median_s, by["fast-alone"].median_s)
        for name in ("fast", "fast-rev", "fast-warm"):
            r = by[name].median_s / fast_single
            targets.append(Target(f"{name} (second tier unthrottled) / best single tier", r,
                                  "<= 0.95", r <= 0.95))
    infl_a = by["kvstream+backlog"].median_s / a.median_s
    infl_d = by["lmcache-disk+backlog"].median_s / d.median_s
    targets.append(Target("backlog inflation kvstream (vs lmcache-disk "
                          f"{infl_d:.2f})", infl_a, "< lmcache-disk's", infl_a < infl_d))
    bl_a, bl_d = by["kvstream+backlog"], by["lmcache-disk+backlog"]
    if bl_a.backlog_s and bl_d.backlog_s:
        ta, td = statistics.median(bl_a.backlog_s), statistics.median(bl_d.backlog_s)
        notes.append(f"backlog on every tier after {ta:.2f} s (kvstream, staging budget half "
                     f"the backlog) and on disk after {td:.2f} s (lmcache-disk)")
    # kvstream writes every tier at once, so its targets take each tier's limit while every
    # tier is written; taken alone, the limits are what independent devices would give
    alone = list(zip(*(writes[f"limit-{t['name']}"] for t in tiers), strict=True))
    together = list(zip(*(writes[f"limit-{t['name']}+others"] for t in tiers), strict=True))
    rep = _ratios(together, writes["kvstream"], max)
    targets.append(Target("replicated write bandwidth / slowest tier's write limit, every tier "
                          "written at once (median of per-round ratios)", rep, ">= 0.9",
                          rep >= 0.9))
    rep1 = _ratios(alone, writes["kvstream"], max)
    slowed = statistics.median(max(a) / max(b) for a, b in zip(alone, together, strict=True))
    notes.append(f"writes: taken against each tier's limit alone, replicated writes reach "
                 f"{rep1:.2f}x the slowest tier's; {limit_tool} itself reaches {slowed:.2f}x of "
                 "it on that tier while every tier is written (tiers on one machine share its "
                 "CPUs and disks)")
    if writes.get("kvstream-visible"):
        vis = _ratios(together, writes["kvstream-visible"], min)
        targets.append(Target("visible write bandwidth / fastest tier's write limit, every "
                              "tier written at once (median of per-round ratios)", vis,
                              ">= 0.8 (near)", vis >= 0.8))
        notes.append("writes: visible write bandwidth / fastest tier's limit alone: "
                     f"{_ratios(alone, writes['kvstream-visible'], min):.2f}")
    write_rows = [WriteRow(name, _write_row(name, limit_tool), secs)
                  for name, secs in writes.items()]
    load_a = by["kvstream+load"].median_s / a.median_s
    load_d = by["lmcache-disk+load"].median_s / d.median_s
    targets.append(Target(f"load inflation kvstream (vs lmcache-disk {load_d:.2f})", load_a,
                          "<= 1.05", load_a <= 1.05))
    machine = {"python": platform.python_version(), "kernel": platform.release(),
               "cpus": str(os.cpu_count()), "page_cache_dropped": str(dropped)}
    setup = {"requests": R, "chunks_per_request": C, "steps": S,
             "chunk_bytes": shape.chunk_bytes, "step_bytes": D, "limit_tool": limit_tool,
             **{f"b_{t['name']}_gbps": b / 1e9 for t, b in zip(tiers, limits, strict=True)},
             "tiers": "; ".join(f"{t['name']}={t['path']}" for t in tiers)}
    return BenchReport(machine, setup, results, bound, targets, notes, write_rows, 2 * D)


_WRITE_ROWS = {
    "kvstream": "kvstream, every chunk on every tier (replicated)",
    "kvstream-visible": "kvstream, every chunk's first copy published (visible)",
    "lmcache-disk": "LMCache LocalDiskBackend, its one copy on the first tier",
}


def _ratios(limits: list[tuple[float, ...]], secs: list[float],
            pick: Callable[[tuple[float, ...]], float]) -> float:
    """Median over rounds of ``pick(round's tier limits) / secs``: a bandwidth ratio."""
    return statistics.median(pick(lim) / s for lim, s in zip(limits, secs, strict=True))


def _write_row(name: str, tool: str) -> str:
    if name in _WRITE_ROWS:
        return _WRITE_ROWS[name]
    tier, _, others = name.removeprefix("limit-").partition("+")
    return (f"{tool} O_DIRECT write on {tier}, " + ("every tier written at once" if others
            else "alone") + ", right after kvstream's round (emulated: the slower of that and "
            "the tier's write throttle replayed)")


def _first_share(res: ConfigResult) -> float | None:
    """The first tier's share of the bytes kvstream's tiers read (median over steps)."""
    names = list(res.tier_samples)
    if len(names) < 2:
        return None
    shares = [a[0] / (a[0] + b[0]) for a, b in zip(res.tier_samples[names[0]],
                                                    res.tier_samples[names[1]], strict=True)
              if a[0] + b[0]]
    return statistics.median(shares) if shares else None
