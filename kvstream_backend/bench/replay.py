"""``kvstream bench --gpu --trace NAME|FILE``: time to first token under a real trace, every
configuration replaying the same plan (:mod:`kvstream_backend.sim.plan`) in a process of its
own (:mod:`.replay_worker`), with kvsim's prediction beside each measurement.

Configurations: ``kvstream`` (disk + /dev/shm), ``kvstream-disk`` and ``kvstream-shm`` (one tier
each), ``static-best`` (a fixed split at the ratio of the two tiers' measured limits),
``lmcache-disk`` (LocalDiskBackend, O_DIRECT), ``lmcache-cpu`` (LocalCPUBackend, stored in the
same process: the ceiling) and ``nocache`` (every prompt prefilled). The page cache is dropped
before each phase; ``kvstream-last`` measures kvstream again after every other configuration
(does its place in the order matter?). ``--gpu-only`` runs some of them (after the same fill
and limits), so that a replay too long for one device call can be measured in two. kvsim
(:func:`~kvstream_backend.sim.plan.predict`) gets the same plan and what this run measured apart
from the configurations:

* each tier's plain read limit (:func:`.plain.best_read`, O_DIRECT, the best thread count),
  with the host->GPU copy after it, as LMCache copies each request after reading it. (Run 5,
  2026-12-06, fed kvsim each tier's rate into GPU memory less the copy's time instead, and
  missed by 16-25%: the plain reader overlaps its copies with its reads, shm reached 33.5 GB/s
  into the GPU against 35.6 GB/s plain, so "less the copy" came to 200 GB/s. The rate into GPU
  memory, :func:`.plain.read_files` with a device, is still measured and reported);
* the host->GPU rate (``lmcache-cpu``'s retrieval);
* the stand-in's prefill, a :class:`~kvstream_backend.sim.plan.PrefillModel` fitted on every
  request's shapes timed in the fill process.

The limits are measured twice, after the fill and after the last phase, and kvsim takes each
tier's best: on a virtio disk whose host caches writes, the host is still flushing the fill's
writes when the first is taken.
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
from ..sim.cli import trace_path
from ..sim.plan import PrefillModel, Serving, TracePlan, plan, predict
from ..sim.replay import load_trace
from ..tables import table
from . import plain
from .gpu import only_configs
from .gpu_worker import DRY, device
from .replay_worker import ModelShape, ReplaySpec
from .report import save
from .settings import settings_notes

GB = 1e9
PHASES = ("kvstream", "kvstream-disk", "kvstream-shm", "static-best", "lmcache-disk",
          "lmcache-cpu", "nocache", "kvstream-last")  # in the order they run
STORAGE_CONFIGS = ("kvstream", "kvstream-disk", "kvstream-shm", "static-best", "lmcache-disk",
                   "kvstream-last")
TWO_TIERS = ("disk", "shm")


class ConfigResult(msgspec.Struct):
    name: str
    ok: bool
    error: str = ""
    ttft_mean_s: float = 0.0
    ttft_p50_s: float = 0.0
    ttft_p90_s: float = 0.0
    ttft_p99_s: float = 0.0
    storage_share: float = 0.0  # of the summed TTFT, the time spent waiting for storage
    retrieved_gb: float = 0.0
    prefill_tokens_per_s: float = 0.0
    predicted_p50_s: float | None = None
    predicted_p90_s: float | None = None
    p50_error: float | None = None  # predicted / measured - 1
    # kvsim again, fed the storage rates this run achieved instead of the plain limits: it
    # separates the model's error from the limit measurement's
    run_gbps: float = 0.0  # this configuration's storage read rate (net of host->GPU)
    predicted_run_p50_s: float | None = None
    cuda_ops: str = ""
    store: dict[str, Any] = {}
    engine: dict[str, Any] = {}  # kvstream's engine stats at the end (per tier: bytes, hedges)
    requests: list[dict] = []
    batches: list[dict] = []


class ReplayReport(msgspec.Struct):
    trace: str
    segment_start: int
    requests: int
    time_scale: float
    token_budget: int
    model: ModelShape
    dry_run: bool
    limits_gbps: dict[str, float]  # each tier's best sample: what kvsim is fed
    h2d_gbps: float
    configs: list[ConfigResult]
    targets: list[dict[str, Any]]
    notes: list[str]
    # each tier's samples, after the fill and after the last phase (reports before 2026-12-05
    # evening have none)
    limit_samples_gbps: dict[str, list[float]] = {}
    # each tier read straight into GPU memory by the plain reader (best sample; reports before
    # 2026-12-06 have none); reported beside the limits, not fed to kvsim
    to_gpu_gbps: dict[str, float] = {}
    # the stand-in's prefill, fitted on its timed shapes in the fill process (kvsim's prefill;
    # before 2026-12-06 kvsim used each configuration's average rate instead)
    prefill_model: PrefillModel | None = None
    prefill_samples: list[tuple[int, int, float]] = []


def _net_of_copy(gbps: float, h2d: float) -> float:
    """The storage share of a retrieval rate ``gbps`` that includes host->GPU at ``h2d``:
    ``1 / (1 / gbps - 1 / h2d)`` (``gbps < h2d``)."""
    return 1 / (1 / gbps - 1 / h2d)


def _pct(xs: list[float], q: float) -> float:
    s = sorted(xs)
    return s[min(len(s) - 1, int(round(q / 100 * (len(s) - 1))))]


class ReplayBench:
    def __init__(self, args: Any, console: Any) -> None:
        self.console = console
        self.args = args
        self.model = ModelShape() if not DRY else ModelShape(
            layers=2, hidden=64, heads=2, kv_heads=2, head_dim=32, intermediate=128, vocab=512)
        reqs = load_trace(trace_path(args.trace), "mooncake", 512)
        self.plan: TracePlan = plan(args.trace, reqs, args.trace_requests, args.trace_scale,
                                    args.token_budget)
        self.work = os.path.join(args.workdir, "kvstream-replay")
        self.disk = os.path.join(self.work, "tier-disk")
        self.shm = os.path.join(args.gpu_shm, "kvstream-replay")
        self.lmc = os.path.join(self.work, "lmcache-disk")
        self.notes: list[str] = settings_notes(args.settings)
        self.only = set(only_configs(args.gpu_only, PHASES))
        self.limit_samples: dict[str, list[float]] = {}
        self.to_gpu_samples: dict[str, list[float]] = {}
        self.prefill_samples: list[tuple[int, int, float]] = []
        self.prefill: PrefillModel | None = None  # fitted on prefill_samples once they come

    @property
    def limits(self) -> dict[str, float]:
        """Each tier's read limit: the best of the samples taken so far."""
        return {k: max(v) for k, v in self.limit_samples.items()}

    @property
    def to_gpu(self) -> dict[str, float]:
        """Each tier's rate into GPU memory: the best of the samples taken so far."""
        return {k: max(v) for k, v in self.to_gpu_samples.items()}

    # ---- LMCache configurations ----------------------------------------------------------
    def _stored_gb(self) -> float:
        blocks = {b for p in self.plan.cached_blocks for b in p}
        return len(blocks) * 512 * self.model.kv_bytes_per_token / (1 << 30)

    def _base(self, local_cpu: bool = False) -> dict[str, Any]:
        return {"chunk_size": 256, "local_cpu": local_cpu,
                "max_local_cpu_size": round(self._stored_gb() * 1.2 + 2, 1),
                "lmcache_instance_id": "kvstream-bench"}

    def _kvstream(self, tiers: list[str], **opts: Any) -> dict[str, Any]:
        cap = round(self._stored_gb() * 1.2 + 2, 1)
        paths = {"disk": self.disk, "shm": self.shm}
        cfg = self._base()
        cfg["storage_plugins"] = ["kvstream"]
        cfg["extra_config"] = {
            "storage_plugin.kvstream.module_path": "kvstream_backend",
            "storage_plugin.kvstream.class_name": "KVStreamBackend",
            "kvstream.tiers": [{"name": t, "path": paths[t], "max_size_gb": cap} for t in tiers],
            "kvstream.prefetch_max_gb": 32,
            # the store pass writes every prefix at once: stage it all, so that nothing is
            # shed or dropped and every tier holds every chunk before the replay
            "kvstream.staging_budget_mb": int(self._stored_gb() * 1.1 * 1024) + 256,
            **{f"kvstream.{k}": v for k, v in {**opts, **self.args.settings}.items()},
        }
        return cfg

    def _localdisk(self) -> dict[str, Any]:
        cfg = self._base()
        cfg.update({"local_disk": f"file://{self.lmc}/",
                    "max_local_disk_size": round(self._stored_gb() * 1.2 + 2, 1),
                    "extra_config": {"use_odirect": True}})
        return cfg

    # ---- phases -------------------------------------------------------------------------
    def _phase(self, name: str, lmcache: dict[str, Any], store: bool,
               recompute: bool = False, replay: bool = True,
               calibrate: bool = False) -> ConfigResult:
        spec = ReplaySpec(name, lmcache, self.plan, self.model, self.work, store, recompute,
                          replay, calibrate)
        path = os.path.join(self.work, f"spec-{name}.json")
        with open(path, "wb") as f:
            f.write(msgspec.json.encode(spec))
        files.drop_caches()
        self.console.print(f"  {name} ...", end="")
        t = time.perf_counter()
        r = subprocess.run([sys.executable, "-m", "kvstream_backend.bench.replay_worker", path],
                           capture_output=True, text=True, timeout=1800)
        lines = [ln for ln in r.stdout.splitlines() if ln.startswith("RESULT ")]
        rec = json.loads(lines[-1][7:]) if lines else {
            "ok": False, "error": f"worker exited {r.returncode}: {r.stderr[-3000:]}"}
        self.console.print(f" {time.perf_counter() - t:.1f} s"
                           + ("" if rec.get("ok") else f" [red]{rec.get('error')}[/]"))
        return self._result(name, rec)

    def _result(self, name: str, rec: dict) -> ConfigResult:
        if not rec.get("ok"):
            return ConfigResult(name, False, rec.get("error", "?") + "\n"
                                + rec.get("traceback", ""))
        if "requests" not in rec:  # the fill: stored (and timed the stand-in), replayed nothing
            self._prefill_from([tuple(x) for x in rec.get("prefill_samples", [])])
            return ConfigResult(name, True, cuda_ops=rec.get("cuda_ops", ""),
                                store=rec.get("store", {}))
        reqs, batches = rec["requests"], rec["batches"]
        ttft = [r["ttft_s"] for r in reqs]
        storage = sum(r["storage_s"] for r in reqs)
        prefill_s = sum(b["prefill_s"] for b in batches)
        return ConfigResult(
            name, True, ttft_mean_s=statistics.fmean(ttft), ttft_p50_s=_pct(ttft, 50),
            ttft_p90_s=_pct(ttft, 90), ttft_p99_s=_pct(ttft, 99),
            storage_share=storage / sum(ttft),
            retrieved_gb=sum(b["retrieved_bytes"] for b in batches) / GB,
            prefill_tokens_per_s=sum(b["new_tokens"] for b in batches) / max(prefill_s, 1e-9),
            cuda_ops=rec.get("cuda_ops", ""), store=rec.get("store", {}),
            engine=rec.get("kvstream", {}), requests=reqs, batches=batches)

    def _measure_limits(self, sample: int = 4 << 30) -> None:
        """Each tier's read limit apart from the engine: a plain O_DIRECT reader over up to
        ``sample`` bytes of kvstream's chunk files, the best of 1, 2, 4, ... threads; then the
        same into GPU memory."""
        dev = device()
        for name, root in (("disk", self.disk), ("shm", self.shm)):
            paths, total = [], 0
            for d, _, fs in os.walk(root):
                for f in fs:
                    if f.endswith(".kvs") and total < sample:
                        paths.append(os.path.join(d, f))
                        total += os.path.getsize(paths[-1])
            if paths:
                best, _ = plain.best_read(paths, os.cpu_count() or 1, files.drop_caches)
                self.limit_samples.setdefault(name, []).append(best / GB)
                best, _ = plain.best_read(paths, os.cpu_count() or 1, files.drop_caches, dev)
                self.to_gpu_samples.setdefault(name, []).append(best / GB)

    def _prefill_from(self, samples: list[tuple[int, int, float]]) -> None:
        """Keep the stand-in's timed prefills and kvsim's model fitted on them (none without)."""
        self.prefill_samples = samples
        self.prefill = PrefillModel.fit(samples) if samples else None

    def _split(self) -> float:
        """static-best's disk share: the disk's part of the two tiers' summed limits after the
        fill (the first sample of each)."""
        first = {k: v[0] for k, v in self.limit_samples.items()}
        return first.get("disk", 1.0) / max(sum(first.values()), 1e-9)

    def rescore(self, rep: ReplayReport) -> ReplayReport:
        """kvsim's predictions and the targets again, from what a stored report measured (no
        GPU, nothing replayed): the report as this version of kvsim would have written it."""
        if (rep.segment_start, rep.requests) != (self.plan.start, len(self.plan.requests)):
            raise ValueError(f"the report replayed requests {rep.segment_start}.. of "
                             f"{rep.requests}, this plan {self.plan.start}.. of "
                             f"{len(self.plan.requests)}")
        self.model = rep.model
        self.notes = rep.notes
        self.limit_samples = rep.limit_samples_gbps or {k: [v] for k, v in
                                                        rep.limits_gbps.items()}
        self.to_gpu_samples = {k: [v] for k, v in rep.to_gpu_gbps.items()}
        self._prefill_from(rep.prefill_samples)
        configs = [msgspec.structs.replace(r, predicted_p50_s=None, predicted_p90_s=None,
                                           p50_error=None, run_gbps=0.0,
                                           predicted_run_p50_s=None) for r in rep.configs]
        return self._report(configs, self._split())

    def run(self) -> ReplayReport:
        shutil.rmtree(self.work, ignore_errors=True)
        shutil.rmtree(self.shm, ignore_errors=True)
        os.makedirs(self.disk)
        os.makedirs(self.shm)
        os.makedirs(self.lmc)
        if not files.drop_caches():
            self.notes.append("page cache NOT dropped between phases (needs root)")
        p = self.plan
        self.console.print(
            f"trace {p.trace}: requests {p.start}..{p.start + len(p.requests) - 1} (the "
            f"burstiest {len(p.requests)}), arrivals / {p.time_scale:g}, token budget "
            f"{p.token_budget}, {self._stored_gb():.1f} GiB of cached prefixes")
        # kvstream's tiers are filled in a process of their own (it replays nothing), so the
        # first configuration measured starts from the same state as every later one
        # (and the stand-in's prefill is timed there, on every request's shapes, for kvsim)
        fill = self._phase("store", self._kvstream(["disk", "shm"]), store=True, replay=False,
                           calibrate=True)
        if not fill.ok:
            return self._report([fill], 0.0)
        self.notes.append(f"kvstream's tiers filled in {fill.store.get('store_s')} s "
                          "(both tiers, one process)")
        self._measure_limits()
        g = self._split()
        self.notes.append(f"static-best splits at g = {g:.3f} (disk's share, from the limits)")
        results: list[ConfigResult] = []
        phases = [("kvstream", self._kvstream(["disk", "shm"]), False, False),
                  ("kvstream-disk", self._kvstream(["disk"]), False, False),
                  ("kvstream-shm", self._kvstream(["shm"]), False, False),
                  ("static-best", self._kvstream(["disk", "shm"], static_split=round(g, 3)),
                   False, False),
                  ("lmcache-disk", self._localdisk(), True, False),
                  ("lmcache-cpu", self._base(local_cpu=True), True, False),
                  ("nocache", {}, False, True),
                  ("kvstream-last", self._kvstream(["disk", "shm"]), False, False)]
        # --gpu-only is checked against PHASES before the fill: a phase missing there would
        # be dropped here without a word
        assert tuple(ph[0] for ph in phases) == PHASES, "PHASES must name every phase, in order"
        phases = [ph for ph in phases if ph[0] in self.only]
        if len(phases) < len(PHASES):
            self.notes.append("--gpu-only: " + ", ".join(ph[0] for ph in phases) + (
                "" if "lmcache-cpu" in self.only else
                " (no lmcache-cpu: kvsim has no host->GPU rate, so nothing is predicted)"))
        for name, cfg, store, recompute in phases:
            results.append(self._phase(name, cfg, store, recompute))
            self._checkpoint(results, g)
        self._measure_limits()
        self.notes.append("limits measured after the fill and after the last phase; kvsim takes "
                          "each tier's best")
        return self._report(results, g)

    def _report(self, results: list[ConfigResult], g: float) -> ReplayReport:
        p = self.plan
        by = {r.name: r for r in results}
        cpu = by.get("lmcache-cpu")
        h2d = cpu.retrieved_gb / max(sum(b["storage_s"] for b in cpu.batches), 1e-9) \
            if cpu is not None and cpu.ok else 0.0
        self._predict(results, g, h2d)
        return ReplayReport(p.trace, p.start, len(p.requests), p.time_scale, p.token_budget,
                            self.model, DRY, self.limits, h2d, results,
                            self._targets(by), self.notes, self.limit_samples, self.to_gpu,
                            self.prefill, self.prefill_samples)

    def _checkpoint(self, results: list[ConfigResult], g: float) -> None:
        """The report so far, to ``--json`` (a run cut short keeps what it measured)."""
        if self.args.json:
            save(self._report(results, g), self.args.json)

    def _predict(self, results: list[ConfigResult], g: float, h2d: float) -> None:
        lim = self.limits
        two = tuple(lim.get(t, 0.0) for t in TWO_TIERS)
        tiers = {"kvstream": two, "kvstream-last": two, "static-best": two,
                 "kvstream-disk": two[:1], "kvstream-shm": two[1:], "lmcache-disk": two[:1],
                 "lmcache-cpu": (), "nocache": ()}
        for r in results:
            if not r.ok or not h2d or r.name not in tiers or not all(tiers[r.name]):
                continue
            pred = self._kvsim(r, tiers[r.name], g, h2d)
            r.predicted_p50_s, r.predicted_p90_s = _pct(pred, 50), _pct(pred, 90)
            r.p50_error = r.predicted_p50_s / r.ttft_p50_s - 1
        self._predict_at_run_rates(results, g, h2d)

    def _predict_at_run_rates(self, results: list[ConfigResult], g: float, h2d: float) -> None:
        """kvsim fed what the single-tier configurations read at (their retrieval rate with the
        host->GPU time taken out), not the limits."""
        by = {r.name: r for r in results if r.ok}
        for r in by.values():
            read_s = sum(b["storage_s"] for b in r.batches)
            if r.retrieved_gb and read_s and h2d and r.retrieved_gb / read_s < h2d:
                r.run_gbps = _net_of_copy(r.retrieved_gb / read_s, h2d)
        disk, shm = (by[n].run_gbps if n in by else 0.0 for n in ("kvstream-disk", "kvstream-shm"))
        tiers = {"kvstream": (disk, shm), "kvstream-last": (disk, shm),
                 "static-best": (disk, shm), "kvstream-disk": (disk,), "kvstream-shm": (shm,)}
        if "lmcache-disk" in by:
            tiers["lmcache-disk"] = (by["lmcache-disk"].run_gbps,)
        for name, tt in tiers.items():
            c = by.get(name)
            if c is None or not all(tt):
                continue
            c.predicted_run_p50_s = _pct(self._kvsim(c, tt, g, h2d), 50)

    def _kvsim(self, r: ConfigResult, tiers_gbps: tuple[float, ...], g: float,
               h2d: float) -> list[float]:
        """kvsim's TTFT of each request of the plan for configuration ``r``: the prefill model
        fitted in the fill process (else the configuration's own average rate)."""
        prefill = self.prefill or PrefillModel.at_rate(r.prefill_tokens_per_s)
        return predict(self.plan, Serving(r.name, tiers_gbps, h2d, prefill,
                                          self.model.kv_bytes_per_token,
                                          split=g if r.name == "static-best" else None,
                                          recompute=r.name == "nocache"))

    def _targets(self, by: dict[str, ConfigResult]) -> list[dict[str, Any]]:
        """Issue 24's targets, for kvstream measured first and measured last alike."""
        out: list[dict[str, Any]] = []
        ld = by.get("lmcache-disk")
        singles = [by[n] for n in ("kvstream-disk", "kvstream-shm") if n in by and by[n].ok]
        for name in ("kvstream", "kvstream-last"):
            k = by.get(name)
            if k is None or not k.ok:
                continue
            if ld is not None and ld.ok:
                for f in ("ttft_mean_s", "ttft_p50_s"):
                    v = getattr(k, f) / getattr(ld, f)
                    out.append({"name": f"{name} {f} / lmcache-disk's", "value": round(v, 3),
                                "goal": "<= 0.5", "met": v <= 0.5})
            if singles:
                best = min(x.ttft_p99_s for x in singles)
                out.append({"name": f"{name} p99 / best single tier's p99",
                            "value": round(k.ttft_p99_s / best, 3), "goal": "<= 1.0",
                            "met": k.ttft_p99_s <= best})
        for name in STORAGE_CONFIGS:
            r = by.get(name)
            if r is not None and r.p50_error is not None:
                out.append({"name": f"kvsim p50 / measured, {name}",
                            "value": round(1 + r.p50_error, 3), "goal": "within 10%",
                            "met": abs(r.p50_error) <= 0.1})
        return out

    def cleanup(self) -> None:
        shutil.rmtree(self.work, ignore_errors=True)
        shutil.rmtree(self.shm, ignore_errors=True)


def render(rep: ReplayReport, console: Any) -> None:
    t = table(f"TTFT under {rep.trace} ({rep.requests} requests from #{rep.segment_start}, "
              f"arrivals / {rep.time_scale:g}, budget {rep.token_budget} tokens)"
              + (" [DRY RUN: not a measurement]" if rep.dry_run else ""),
              "config", "mean", "p50", "p90", "p99", "wait", "GB", "sim50", "err", "run50")
    for r in rep.configs:
        if not r.ok:
            continue
        sim = (f"{r.predicted_p50_s:.2f}", f"{r.p50_error:+.0%}") \
            if r.predicted_p50_s is not None and r.p50_error is not None else ("", "")
        run = "" if r.predicted_run_p50_s is None else f"{r.predicted_run_p50_s:.2f}"
        t.add_row(r.name, f"{r.ttft_mean_s:.2f}", f"{r.ttft_p50_s:.2f}", f"{r.ttft_p90_s:.2f}",
                  f"{r.ttft_p99_s:.2f}", f"{r.storage_share:.0%}", f"{r.retrieved_gb:.1f}",
                  *sim, run)
    console.print(t)
    console.print("TTFT in seconds; wait: the share of TTFT spent waiting for storage; sim50: "
                  "kvsim's p50 from the plain limits and host->GPU (err: against the measured "
                  "p50); run50: kvsim's p50 fed the read rates this run achieved")
    for r in rep.configs:
        if not r.ok:
            console.print(f"[red]{r.name} failed:[/] {r.error.splitlines()[0]}")
    console.print("limits (plain O_DIRECT reader; the best of the samples after the fill and "
                  "after the last phase): "
                  + ", ".join(f"{k} {v:.2f} GB/s ("
                              + " / ".join(f"{x:.2f}"
                                           for x in rep.limit_samples_gbps.get(k, [v])) + ")"
                              for k, v in rep.limits_gbps.items())
                  + f"; host->GPU {rep.h2d_gbps:.1f} GB/s (lmcache-cpu's retrieval); read "
                  "in this run: " + ", ".join(f"{r.name} {r.run_gbps:.2f} GB/s"
                                              for r in rep.configs if r.run_gbps))
    if rep.to_gpu_gbps:
        console.print("into GPU memory (the plain reader, a host->GPU copy after each read): "
                      + ", ".join(f"{k} {v:.2f} GB/s" for k, v in rep.to_gpu_gbps.items()))
    console.print("prefill: a stand-in (transformers LlamaModel, random weights, one request "
                  "at a time), not vLLM's")
    if rep.prefill_model is not None and rep.prefill_samples:
        errs = sorted(abs(rep.prefill_model.seconds(n, p) / t - 1)
                      for n, p, t in rep.prefill_samples)
        console.print(f"kvsim's prefill: fitted on {len(errs)} timed shapes (off by "
                      f"{errs[len(errs) // 2]:.0%} at the median, {errs[-1]:.0%} at most): "
                      + ", ".join(f"{k} {v:.3g}" for k, v in
                                  msgspec.structs.asdict(rep.prefill_model).items()))
    for tg in rep.targets:
        console.print(f"  {tg['name']}: {tg['value']} ({tg['goal']}: "
                      f"{'met' if tg['met'] else 'NOT met'})")
    for n in rep.notes:
        console.print(f"  note: {n}")


def plot(rep: ReplayReport, path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (a, b) = plt.subplots(1, 2, figsize=(13, 4.5))
    for r in rep.configs:
        if not r.ok:
            continue
        xs = sorted(q["ttft_s"] for q in r.requests)
        a.plot(xs, [(i + 1) / len(xs) for i in range(len(xs))], label=r.name)
        b.plot([q["arrival_s"] for q in r.requests], [q["ttft_s"] for q in r.requests], ".-",
               label=r.name, markersize=3, linewidth=0.8)
    a.set(xlabel="TTFT (s)", ylabel="fraction of requests", title="TTFT CDF")
    b.set(xlabel="arrival (s, scaled trace time)", ylabel="TTFT (s)", title="TTFT over time")
    a.legend(fontsize=8)
    b.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def run_replay(args: Any, console: Any) -> int:
    try:
        only_configs(args.gpu_only, PHASES)
    except ValueError as e:
        console.print(f"[red]error:[/] {e}")
        return 2
    if args.rescore:
        try:
            with open(args.rescore, "rb") as f:
                stored = msgspec.json.decode(f.read(), type=ReplayReport)
        except (OSError, msgspec.DecodeError) as e:  # (ValidationError is a DecodeError)
            console.print(f"[red]error:[/] {args.rescore}: not a replay report: {e}")
            return 2
        args.trace, args.trace_requests = stored.trace, stored.requests
        args.trace_scale, args.token_budget = stored.time_scale, stored.token_budget
        try:
            rep = ReplayBench(args, console).rescore(stored)
        except ValueError as e:
            console.print(f"[red]error:[/] {args.rescore}: {e}")
            return 2
        render(rep, console)
        if args.json:
            save(rep, args.json)
        return 0
    if not DRY:
        import torch

        if not torch.cuda.is_available():
            console.print("[red]error:[/] kvstream bench --gpu --trace needs a CUDA GPU")
            return 2
    bench = ReplayBench(args, console)
    try:
        rep = bench.run()
    finally:
        if not args.keep:
            bench.cleanup()
    render(rep, console)
    if args.json:
        save(rep, args.json)
    if args.plot:
        plot(rep, args.plot)
    return 0 if all(r.ok for r in rep.configs) else 1
