"""``kvstream bench --gpu``: the step through LMCache's CUDA connector, every configuration in
one run, interleaved round by round, each retrieve in a fresh process (page cache dropped first
where the machine allows it). See :mod:`kvstream_backend.bench.gpu_worker` for one phase.

Configurations: ``kvstream`` (disk + /dev/shm), ``kvstream-rev`` (the same tiers listed in the
reverse order), ``kvstream-disk`` and ``kvstream-shm`` (one
tier each), ``static-0.5``/``static-0.7`` (fixed splits), ``kvstream-emu`` (the /dev/shm tier
throttled to half the disk's bandwidth measured in the same round), ``lmcache-disk``
(LocalDiskBackend, O_DIRECT) and ``lmcache-cpu`` (LocalCPUBackend, hot: the host->GPU ceiling
of this LMCache build), and ``limit-disk``/``limit-shm``: each tier's read limit apart from the
engine (a plain O_DIRECT reader of kvstream's chunk files, the best over 1..cores threads).
Whether LMCache's compiled ``cuda_ops`` loaded is reported: a run on its torch fallback is
labelled not representative. Per configuration: the step (lookups to the last retrieve), the storage
read (lookups to the last chunk delivered; kvstream only) and the host->GPU time (the sum of
LMCache's ``batched_to_gpu`` calls), with a per-request timeline in the JSON. Before its first
step a retrieve process stores and retrieves one chunk of other tokens, so that step 0 does not
include the CUDA connector's first calls (``--gpu-cold``: it does).
``--gpu-only`` runs some of them (``limits`` names the limit rows); a target whose rows did
not run is not printed.
"""

from __future__ import annotations

import json
import os
import shutil
import statistics
import subprocess
import sys
import time
from typing import Any

import msgspec

from ..io import files
from ..tables import table
from . import plain
from .gpu_worker import DRY, Phase, Shape, device
from .report import save
from .settings import settings_notes

GB = 1e9
CONFIGS = ("kvstream-disk", "kvstream-shm", "kvstream", "kvstream-rev", "static-0.5",
           "static-0.7", "kvstream-emu", "limits", "lmcache-disk", "lmcache-cpu")


class GpuConfig(msgspec.Struct):
    name: str
    step_s: list[float] = []
    storage_s: list[float] = []
    h2d_s: list[float] = []
    identical: list[bool] = []
    timelines: list[dict] = []
    kvstream_steps: list[list[dict]] = []
    errors: list[str] = []
    io: list[str] = []  # per kvstream tier: "name io direct (reason)"; limits: the reader
    cuda_ops: str = ""  # whether LMCache's compiled kernels loaded in the phase
    warmup_s: list[float] = []  # per retrieve process: the GPU connector's first calls


class GpuTarget(msgspec.Struct):
    name: str
    value: float
    goal: str
    met: bool


class GpuReport(msgspec.Struct):
    machine: dict[str, str]
    shape: Shape
    step_bytes: int
    rounds: int
    dry_run: bool
    configs: list[GpuConfig]
    targets: list[GpuTarget]
    notes: list[str]


def _med(xs: list[float]) -> float:
    return statistics.median(xs) if xs else float("nan")


class GpuBench:
    def __init__(self, args: Any, console: Any) -> None:
        self.console = console
        L, H, D, BS = (int(x) for x in args.gpu_shape.split(","))
        self.shape = Shape(L, H, D, BS, args.requests or 8, args.gpu_tokens)
        self.rounds = args.gpu_rounds
        self.iters = args.gpu_iters
        self.torch_threads = args.gpu_torch_threads
        self.warmup = not args.gpu_cold
        self.work = os.path.join(args.workdir, "kvstream-gpu-bench")
        self.disk = os.path.join(self.work, "tier-disk")
        self.shm = os.path.join(args.gpu_shm, "kvstream-gpu-bench")
        self.lmc = os.path.join(self.work, "lmcache-disk")
        self.json: str | None = args.json
        self.results: dict[str, GpuConfig] = {}
        self.only = set(only_configs(args.gpu_only))
        self.settings: dict[str, Any] = args.settings  # --set, over the bench's own keys
        self.notes: list[str] = settings_notes(args.settings)

    # ---- LMCache configurations ----------------------------------------------------------
    def _base(self, local_cpu: bool = False) -> dict[str, Any]:
        gb = self.shape.step_bytes / (1 << 30)
        return {"chunk_size": self.shape.chunk, "local_cpu": local_cpu,
                "max_local_cpu_size": round(2 * gb + 1, 1),
                "lmcache_instance_id": "kvstream-bench"}

    def _kvstream(self, tiers: list[dict], **opts: Any) -> dict[str, Any]:
        cap = round(2 * self.shape.step_bytes / (1 << 30) + 1, 1)
        cfg = self._base()
        cfg["storage_plugins"] = ["kvstream"]
        cfg["extra_config"] = {
            "storage_plugin.kvstream.module_path": "kvstream_backend",
            "storage_plugin.kvstream.class_name": "KVStreamBackend",
            "kvstream.tiers": [dict(t, max_size_gb=cap) for t in tiers],
            "kvstream.prefetch_max_gb": round(self.shape.step_bytes / (1 << 30) + 0.5, 1),
            # the store phase writes a whole step at once: stage it all, so that every tier
            # holds every chunk before the first retrieve (a smaller budget sheds copies)
            "kvstream.staging_budget_mb": 2 * self.shape.step_bytes >> 20,
            **{f"kvstream.{k}": v for k, v in {**opts, **self.settings}.items()},
        }
        return cfg

    def _tiers(self, shm_read_mbps: float | None = None) -> list[dict]:
        shm: dict[str, Any] = {"name": "shm", "path": self.shm}
        if shm_read_mbps:
            shm["emulate"] = {"read_mbps": round(shm_read_mbps, 1)}
        return [{"name": "disk", "path": self.disk}, shm]

    def _localdisk(self) -> dict[str, Any]:
        cfg = self._base()
        cfg.update({"local_disk": f"file://{self.lmc}/",
                    "max_local_disk_size": round(2 * self.shape.step_bytes / GB + 1, 1),
                    "extra_config": {"use_odirect": True}})
        return cfg

    # ---- phases -------------------------------------------------------------------------
    def _phase(self, kind: str, config: str, lmcache: dict, iters: int = 1) -> dict:
        p = Phase(kind, config, lmcache, self.shape, self.work, iters, self.torch_threads,
                  warmup=self.warmup)
        self.console.print(f"  {kind:8s} {config} ...", end="")
        t = time.perf_counter()
        r = subprocess.run([sys.executable, "-m", "kvstream_backend.bench.gpu_worker",
                            msgspec.json.encode(p).decode()],
                           capture_output=True, text=True, timeout=900)
        lines = [ln for ln in r.stdout.splitlines() if ln.startswith("RESULT ")]
        rec = json.loads(lines[-1][7:]) if lines else {
            "ok": False, "error": f"worker exited {r.returncode}: {r.stderr[-3000:]}"}
        self.console.print(f" {time.perf_counter() - t:.1f} s"
                           + ("" if rec.get("ok") else f" [red]{rec.get('error')}[/]"))
        return rec

    def _checkpoint(self) -> None:
        """Write what was measured so far (a run cut short still leaves its numbers)."""
        if self.json:
            save(self._report(), self.json)

    def _record(self, name: str, rec: dict) -> GpuConfig:
        c = self.results.setdefault(name, GpuConfig(name))
        if self.torch_threads and rec.get("torch_threads") not in (None, self.torch_threads):
            c.errors.append(f"the phase ran torch with {rec['torch_threads']} threads, not the "
                            f"{self.torch_threads} asked for")
        if not rec.get("ok"):
            c.errors.append(str(rec.get("error")) + "\n" + str(rec.get("traceback", "")))
            return c
        c.cuda_ops = c.cuda_ops or str(rec.get("cuda_ops", ""))
        if "warmup_s" in rec:
            c.warmup_s.append(rec["warmup_s"])
        if not c.io and rec.get("kvstream"):
            c.io = [f"{t['name']} io={t['io']} direct={t['direct']} ({t['io_reason']})"
                    for t in rec["kvstream"]["tiers"]]
        for st in rec.get("steps", []):
            c.step_s.append(st["step_s"])
            c.h2d_s.append(st["h2d_s"])
            if "storage_s" in st:
                c.storage_s.append(st["storage_s"])
            c.identical.append(st["identical"])
            c.timelines.append(st["timeline"])
            c.kvstream_steps.append(st.get("kvstream_steps", []))
        return c

    def run(self) -> GpuReport:
        shutil.rmtree(self.work, ignore_errors=True)
        shutil.rmtree(self.shm, ignore_errors=True)
        for d in (self.disk, self.shm, self.lmc):
            os.makedirs(d)
        s = self.shape
        self.console.print(f"[bold]kvstream bench --gpu[/]: {s.requests} requests x {s.tokens} "
                           f"tokens, {s.step_bytes / (1 << 30):.2f} GiB per step, "
                           f"{self.rounds} rounds")
        rec = self._phase("store", "kvstream", self._kvstream(self._tiers()))
        if not rec.get("ok"):
            raise RuntimeError(f"store failed: {rec.get('error')}\n{rec.get('traceback', '')}")
        dropped = files.drop_caches()
        if not dropped:
            self.notes.append("page cache NOT dropped between phases (needs root): disk reads "
                              "may come from memory")
        for rnd in range(self.rounds):
            self.console.print(f"round {rnd + 1}/{self.rounds}")
            order = [("kvstream-disk", self._kvstream(self._tiers()[:1])),
                     ("kvstream-shm", self._kvstream(self._tiers()[1:])),
                     ("kvstream", self._kvstream(self._tiers())),
                     ("kvstream-rev", self._kvstream(self._tiers()[::-1])),
                     ("static-0.5", self._kvstream(self._tiers(), static_split=0.5)),
                     ("static-0.7", self._kvstream(self._tiers(), static_split=0.7)),
                     ("kvstream-emu", None)]
            for name, cfg in order:
                if name not in self.only:
                    continue
                if cfg is None:  # the second tier at half the disk's bandwidth of this round
                    disk = self.results.get("kvstream-disk")
                    if disk is None or not disk.storage_s:
                        continue
                    mbps = s.step_bytes / disk.storage_s[-1] / 2 / (1 << 20)
                    cfg = self._kvstream(self._tiers(shm_read_mbps=mbps))
                files.drop_caches()
                self._record(name, self._phase("retrieve", name, cfg, self.iters))
                self._checkpoint()
            if "limits" in self.only:
                self._limits()
                self._checkpoint()
            # LMCache 0.5.6's disk and CPU backends do not find a previous process's chunks:
            # each stores, then retrieves in one process (LocalDisk reads with O_DIRECT)
            shutil.rmtree(self.lmc, ignore_errors=True)
            os.makedirs(self.lmc)
            for name, cfg in (("lmcache-disk", self._localdisk()),
                              ("lmcache-cpu", self._base(local_cpu=True))):
                if name in self.only:
                    self._record(name, self._phase("same", name, cfg, self.iters))
                    self._checkpoint()
        return self._report()

    def _limits(self) -> None:
        """Each tier's read limit apart from the engine, on kvstream's own chunk files: a plain
        O_DIRECT reader from 1, 2, 4, ... cores threads, the best of them (page cache dropped
        before each); then the same reader copying each file to the GPU after reading it
        (``limit-<tier>-gpu``): what the tier delivers into GPU memory when its reads and the
        host->GPU copies share the host."""
        dev = device()
        for name, root in (("disk", self.disk), ("shm", self.shm)):
            paths = [os.path.join(d, f) for d, _, fs in os.walk(root) for f in fs
                     if f.endswith(".kvs")]
            if not paths:
                continue
            total = sum(os.path.getsize(p) for p in paths)
            for row, into, how in ((f"limit-{name}", None, "plain O_DIRECT preadv"),
                                   (f"limit-{name}-gpu", dev,
                                    "plain O_DIRECT preadv + host->GPU copy")):
                best, rates = plain.best_read(paths, os.cpu_count() or 1, files.drop_caches,
                                              into)
                c = self.results.setdefault(row, GpuConfig(row))
                c.step_s.append(self.shape.step_bytes / best)
                c.io.append(f"{how}, GB/s by threads: " + ", ".join(
                    f"{t}: {r / GB:.1f}" for t, r in rates.items()) + f" ({total >> 20} MiB)")

    # ---- results ------------------------------------------------------------------------
    def _gbps(self, name: str, field: str = "step_s") -> float:
        c = self.results.get(name)
        xs = getattr(c, field) if c is not None else []
        return self.shape.step_bytes / _med(xs) / GB if xs else float("nan")

    def _report(self) -> GpuReport:
        targets: list[GpuTarget] = []

        def target(name: str, value: float, goal: str, met: bool) -> None:
            if value == value:  # not NaN: the configurations it compares ran
                targets.append(GpuTarget(name, value, goal, met))

        ceiling = self._gbps("lmcache-cpu")
        best = max((x for x in (self._gbps("kvstream-disk"), self._gbps("kvstream-shm"))
                    if x == x), default=float("nan"))  # (of those that ran)
        for name in ("kvstream", "kvstream-rev"):
            r = best / self._gbps(name)
            target(f"{name} step / best single tier's step", r, "<= 0.95", r <= 0.95)
        limits = self._gbps("limit-disk") + self._gbps("limit-shm")
        bound = min(ceiling, limits)
        for name in ("kvstream", "kvstream-rev"):
            r = self._gbps(name) / bound
            target(f"{name} / min(LocalCPU ceiling, limit_disk + limit_shm)", r, ">= 0.8",
                   r >= 0.8)
        into_gpu = min(ceiling, self._gbps("limit-disk-gpu") + self._gbps("limit-shm-gpu"))
        for name in ("kvstream", "kvstream-rev"):
            r = self._gbps(name) / into_gpu
            target(f"{name} / min(LocalCPU ceiling, limit_disk_gpu + limit_shm_gpu)", r,
                   ">= 0.8", r >= 0.8)
        r = self._gbps("kvstream-shm", "storage_s") / self._gbps("limit-shm")
        target("shm alone, storage read / its plain limit", r, ">= 0.8", r >= 0.8)
        emu, ld = self._gbps("kvstream-emu"), self._gbps("lmcache-disk")
        target("kvstream (disk + shm at half the disk) / LocalDiskBackend", emu / ld, ">= 1.35",
               emu / ld >= 1.35)
        c = self.results.get("kvstream")
        if c is not None and c.step_s:
            over = _med(c.step_s) / max(_med(c.storage_s), _med(c.h2d_s))
            target("kvstream step / max(storage read, host->GPU)", over, "<= 1.1", over <= 1.1)
        notes = list(self.notes)
        notes.append("each retrieve process stored and retrieved one chunk of other tokens "
                     "before its first step (the GPU connector's first calls, as a serving "
                     "process makes them before its first request)" if self.warmup else
                     "--gpu-cold: each retrieve process's step 0 includes the GPU connector's "
                     "first calls")
        bad = [n for n, r in self.results.items() if r.identical and not all(r.identical)]
        if bad:
            notes.append(f"KV NOT byte-identical on the device in: {', '.join(bad)}")
        ops = {r.cuda_ops for r in self.results.values() if r.cuda_ops}
        if ops != {"loaded"}:
            notes.append("NOT REPRESENTATIVE of a deployment: lmcache.cuda_ops did not load in "
                         f"every phase ({'; '.join(sorted(ops)) or 'unknown'}); LMCache "
                         "scattered with plain torch, which bounds the step")
        if DRY:
            notes.append("DRY RUN on a CPU machine (reference copy instead of LMCache's "
                              "CUDA connector): not a GPU measurement")
        import platform

        machine = {"host": platform.node(), "python": platform.python_version(),
                   "cpus": str(os.cpu_count()), "cuda_ops": "; ".join(sorted(ops)),
                   "torch_threads": str(self.torch_threads or "torch default (one per core)")}
        try:
            import torch

            machine["torch"] = str(torch.__version__)
            if torch.cuda.is_available():
                machine["gpu"] = torch.cuda.get_device_name(0)
        except ImportError:
            pass
        return GpuReport(machine, self.shape, self.shape.step_bytes, self.rounds, DRY,
                         list(self.results.values()), targets, notes)

    def cleanup(self) -> None:
        shutil.rmtree(self.work, ignore_errors=True)
        shutil.rmtree(self.shm, ignore_errors=True)


def render(rep: GpuReport, console: Any) -> None:
    t = table(f"GPU step: {rep.step_bytes / (1 << 30):.2f} GiB, medians over {rep.rounds} "
              "rounds", "configuration", "step s", "GB/s", "storage read s", "host->GPU s",
              "identical", "errors")
    for c in rep.configs:
        gbps = rep.step_bytes / _med(c.step_s) / GB if c.step_s else float("nan")
        t.add_row(c.name, f"{_med(c.step_s):.3f}", f"{gbps:.2f}",
                  f"{_med(c.storage_s):.3f}" if c.storage_s else "-", f"{_med(c.h2d_s):.3f}",
                  str(all(c.identical)) if c.identical else "-", str(len(c.errors)))
    console.print(t)
    for c in rep.configs:
        if c.name.startswith("limit-") and c.io:
            console.print(f"  {c.name}: {c.io[-1]}")
        elif c.kvstream_steps:
            console.print(f"  {c.name}: {_tier_reads(c.kvstream_steps)}")
    for g in rep.targets:
        mark = "[green]met[/]" if g.met else "[red]NOT met[/]"
        console.print(f"  {g.name}: {g.value:.2f} (target {g.goal}) {mark}")
    for n in rep.notes:
        console.print(f"  [yellow]note:[/] {n}")


def _tier_reads(steps: list[list[dict]]) -> str:
    """Per tier, over the configuration's steps: reads, those lost to another tier's copy, and
    the longest read of a step (median over steps), from the engine's step reports."""
    per: dict[str, list[tuple[int, int, float]]] = {}
    for reports in steps:
        step: dict[str, tuple[int, int, float]] = {}
        for rep in reports:
            for t in rep["tiers"]:
                n, lost, longest = step.get(t["name"], (0, 0, 0.0))
                step[t["name"]] = (n + t.get("reads", 0), lost + t.get("lost", 0),
                                   max(longest, t.get("max_read_s", 0.0)))
        for name, x in step.items():
            per.setdefault(name, []).append(x)
    return "; ".join(
        f"{name} {statistics.median(x[0] for x in xs):g} reads per step, "
        f"{statistics.median(x[1] for x in xs):g} lost, longest "
        f"{1e3 * statistics.median(x[2] for x in xs):.0f} ms" for name, xs in per.items())


def only_configs(spec: str | None, choices: tuple[str, ...] = CONFIGS) -> list[str]:
    """The configurations ``--gpu-only`` names, of ``choices`` (all of them when None)."""
    if spec is None:
        return list(choices)
    names = [n.strip() for n in spec.split(",") if n.strip()]
    bad = [n for n in names if n not in choices]
    if bad or not names:
        raise ValueError(f"--gpu-only: unknown configuration {', '.join(bad) or '(none)'}; "
                         f"choose from {', '.join(choices)}")
    return names


def run_gpu(args: Any, console: Any) -> int:
    try:
        only_configs(args.gpu_only)
    except ValueError as e:
        console.print(f"[red]error:[/] {e}")
        return 2
    if not DRY:
        try:
            import torch
        except ImportError:
            console.print("[red]error:[/] kvstream bench --gpu needs torch with CUDA")
            return 2
        if not torch.cuda.is_available():
            console.print("[red]error:[/] kvstream bench --gpu needs a CUDA GPU, and "
                          "torch.cuda.is_available() is False on this machine (torch "
                          f"{torch.__version__}); run `kvstream bench` for the CPU benchmark")
            return 2
    bench = GpuBench(args, console)
    try:
        rep = bench.run()
    finally:
        bench.cleanup()
    render(rep, console)
    if args.json:
        save(rep, args.json)
        console.print(f"wrote {args.json}")
    return 0 if all(all(c.identical) and not c.errors for c in rep.configs) else 1
