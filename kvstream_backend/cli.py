"""The ``kvstream`` command: ``bench``, ``check-config``, ``model`` and ``sim``."""

from __future__ import annotations

import argparse
import importlib
import json
import os
import sys
from collections.abc import Sequence

from rich.console import Console

from .argtypes import floats
from .config import ConfigError, parse_config
from .tables import table

err = Console(stderr=True)


def _fail(msg: str, code: int = 1) -> int:
    err.print(f"[bold red]error:[/] {msg}")
    return code


# ---- check-config ---------------------------------------------------------------------------
def check_config(path: str) -> int:
    """Validate a whole LMCache YAML: LMCache's own loader, plugin selection, kvstream keys,
    tier directories and their I/O paths. Exit 0 only if the plugin would load and work."""
    if not os.path.isfile(path):
        return _fail(f"{path}: no such file", 2)
    os.environ.setdefault("LMCACHE_TRACK_USAGE", "false")
    os.environ.setdefault("LMCACHE_LOG_LEVEL", "WARNING")
    from lmcache.v1.config import LMCacheEngineConfig  # the LMCache loader, as in production

    try:
        cfg = LMCacheEngineConfig.from_file(path)
    except Exception as e:  # noqa: BLE001 - report whatever LMCache's loader rejects
        return _fail(f"{path}: LMCache cannot load it: {e}", 2)
    extra = cfg.extra_config or {}
    plugins = list(cfg.storage_plugins or [])
    selected = []
    for name in plugins:
        mod = extra.get(f"storage_plugin.{name}.module_path")
        cls = extra.get(f"storage_plugin.{name}.class_name")
        if not mod or not cls:
            return _fail(f"{path}: storage_plugins lists {name!r} but extra_config lacks "
                         f"storage_plugin.{name}.module_path / class_name")
        try:
            klass = getattr(importlib.import_module(mod), cls)
        except (ImportError, AttributeError) as e:
            return _fail(f"{path}: storage_plugin.{name}: cannot import {mod}.{cls}: {e}")
        from .adapters.lmcache_plugin import KVStreamBackend

        if isinstance(klass, type) and issubclass(klass, KVStreamBackend):
            selected.append(name)
    if not selected:
        return _fail(f"{path}: storage_plugins ({plugins}) does not select "
                     "kvstream_backend.KVStreamBackend")
    try:
        kcfg = parse_config(extra, check_paths=False)  # validation must not create directories
    except ConfigError as e:
        return _fail(f"{path}: {e}")
    from .io.probe import probe
    from .tiers.tier import Tier

    tiers = table(f"kvstream tiers ({path})", "tier", "capacity GB", "free GB", "io",
                  "O_DIRECT", "emulated")
    problems = []
    for i, t in enumerate(kcfg.tiers):
        key = f"kvstream.tiers[{i}].path"
        existing = _nearest_existing(t.path)
        if not os.path.isdir(existing) or not os.access(existing, os.W_OK | os.X_OK):
            return _fail(f"{path}: {key}: {existing} is not a writable directory")
        if existing != os.path.abspath(t.path):
            kind, direct = "MISSING", "?"
            problems.append(f"{key}: {t.path} does not exist: the tier starts DOWN and joins "
                            "when the directory appears (kvstream never creates a tier root)")
        else:
            tier = Tier(t, file_mode=kcfg.file_mode, dir_mode=kcfg.dir_mode, negative_ms=0)
            try:
                tier.open()
                io = probe(tier.tmp_dir, t.io, t.direct, kcfg.file_mode)
            except OSError as e:
                return _fail(f"{path}: {key}: {t.path}: {e}")
            kind, direct = io.kind, "yes" if io.direct else "no"
        st = os.statvfs(existing)
        free = st.f_bavail * st.f_frsize
        if t.capacity_bytes > free:
            problems.append(f"kvstream.tiers[{i}].max_size_gb ({t.max_size_gb:g}) exceeds the "
                            f"free space of {existing} ({free / 2**30:.1f} GB)")
        tiers.add_row(t.name, f"{t.max_size_gb:g}", f"{free / 2**30:.1f}", kind, direct,
                      "yes" if t.emulate else "no")
    problems += _memory_problems(kcfg, float(cfg.max_local_cpu_size or 0))
    out = Console()
    out.print(tiers)
    for t in kcfg.tiers:
        out.print(f"  {t.name}: {t.path}")
    for p in problems:
        err.print(f"[yellow]warning:[/] {p}")
    out.print(f"[green]OK[/]: {path} selects kvstream as storage plugin {selected[0]!r}")
    return 0


def _memory_problems(kcfg, host_gb: float) -> list[str]:
    """kvstream reads into and writes from LMCache's host buffers (``max_local_cpu_size``):
    prefetches up to ``prefetch_max_gb`` and unfinished writes up to twice
    ``staging_budget_mb``. Leave at least half to LMCache's own cache and the gets in flight."""
    need = kcfg.prefetch_max_gb + 2 * kcfg.staging_budget_mb / 1024
    if need <= host_gb / 2:
        return []
    return [f"kvstream.prefetch_max_gb ({kcfg.prefetch_max_gb:g}) + 2 x kvstream."
            f"staging_budget_mb ({kcfg.staging_budget_mb}) = {need:.1f} GB of LMCache's host "
            f"memory, more than half of max_local_cpu_size ({host_gb:g} GB): allocations for "
            "gets may fail (misses). Raise max_local_cpu_size or lower the two bounds."]


def _nearest_existing(path: str) -> str:
    p = os.path.abspath(path)
    while not os.path.exists(p):
        p = os.path.dirname(p)
    return p


# ---- model ----------------------------------------------------------------------------------
def model_cmd(split: float, bws: list[float], demand_gb: float) -> int:
    from .policy import model

    if not 0 <= split <= 1:
        return _fail("--split must be in [0, 1]", 2)
    if len(bws) < 2 or any(b <= 0 for b in bws):
        return _fail("--bw needs at least two positive bandwidths", 2)
    shares = [split] + [(1 - split) / (len(bws) - 1)] * (len(bws) - 1)
    bound = model.bound_s(demand_gb, bws)
    static = model.static_s(demand_gb, shares, bws)
    print(json.dumps({
        "demand_gb": demand_gb, "bw_gbps": bws, "split": shares,
        "phi": model.phi(bws), "bound_s": bound, "static_s": static,
        "penalty": static / bound, "first_tier_alone_s": demand_gb / bws[0],
    }, indent=2))
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="kvstream", description=__doc__)
    sub = ap.add_subparsers(dest="cmd", required=True)

    cc = sub.add_parser("check-config", help="validate an LMCache YAML that selects kvstream")
    cc.add_argument("file")

    mo = sub.add_parser("model", help="the paper's performance model (Eq. 3-6)")
    mo.add_argument("--split", type=float, required=True, help="first tier's share g")
    mo.add_argument("--bw", type=floats, required=True, help="tier bandwidths, GB/s: B0,B1")
    mo.add_argument("--demand-gb", type=float, default=1.0)

    so = sub.add_parser("soak", help="writes, pooled reads and injected faults; counts losses")
    so.add_argument("--minutes", type=float, default=20.0)
    so.add_argument("--seed", type=int, default=0)
    so.add_argument("--chunk-kb", type=int, default=256)
    so.add_argument("--workdir", default="/var/tmp", help="where the two tiers are created")
    so.add_argument("--json", metavar="FILE")

    from .bench.cli import add_bench_parser
    from .sim.cli import add_sim_parser

    add_bench_parser(sub)
    add_sim_parser(sub)

    args = ap.parse_args(argv)
    if args.cmd == "check-config":
        return check_config(args.file)
    if args.cmd == "model":
        return model_cmd(args.split, args.bw, args.demand_gb)
    if args.cmd == "soak":
        from .soak import main as soak_main

        return soak_main(args.minutes, args.seed, args.chunk_kb, args.json, args.workdir)
    return int(args.func(args))


if __name__ == "__main__":
    sys.exit(main())
