"""Side by side, in one run: kvstream's ``batch_get_v1`` (the disk alone, and two tiers) against
SGLang's ``HiCacheFile`` through the path SGLang's controller gives it (``batch_get`` into
flat pages, then ``set_from_flat_data_page``; ``file`` has no v1), same pages, same disk.

Runs in the SGLang environment (``tox -e sglang``'s, or one like it)::

    python -m kvstream_backend.bench.hicache --workdir /var/tmp --second /dev/shm

Before every read pass the page cache of every file is dropped (``posix_fadvise(DONTNEED)``),
so both read the device (kvstream reads with O_DIRECT anyway; a tmpfs second tier is memory
whatever is dropped: the table says which file system each tier is on). Configurations
alternate within each round, and the median of the rounds is reported.
"""

from __future__ import annotations

import argparse
import functools
import os
import shutil
import statistics
import sys
import time
import uuid
from typing import Any

import msgspec
import torch

from ..tables import table
from . import plain
from .report import save


class Row(msgspec.Struct):
    config: str
    tiers: str
    pages: int
    page_bytes: int
    seconds: list[float]
    pages_per_s: float
    gb_per_s: float
    ratio_vs_file: float = 0.0


class Report(msgspec.Struct):
    layout: str
    page_bytes: int
    pages: int
    rounds: int
    workdir_fs: str
    second_fs: str
    rows: list[Row]
    targets: dict[str, str]
    limits_gbps: dict[str, float]  # each tier apart from any backend: plain O_DIRECT reads


def _fs_type(path: str) -> str:
    best, fs = "", "?"
    with open("/proc/mounts") as f:
        for line in f:
            _, mnt, typ = line.split()[:3]
            if path.startswith(mnt) and len(mnt) > len(best):
                best, fs = mnt, typ
    return fs


def _drop_caches(root: str) -> None:
    for d, _, files in os.walk(root):
        for name in files:
            try:
                fd = os.open(os.path.join(d, name), os.O_RDONLY)
            except OSError:
                continue
            try:
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            finally:
                os.close(fd)


def _host_pool(layout: str, pages: int, page: int) -> Any:
    from sglang.srt.mem_cache.memory_pool import MHATokenToKVPool
    from sglang.srt.mem_cache.pool_host.mha import get_mha_host_pool_cls

    dev = MHATokenToKVPool(size=pages * page, page_size=page, dtype=torch.bfloat16,
                           head_num=8, head_dim=128, layer_num=8, device="cpu",
                           enable_memory_saver=False)
    info = dev.get_device_pool_infos()[0].buffer_info
    return get_mha_host_pool_cls(info)(
        info, 1.2, 0, page, layout, pin_memory=False, device_capacity_tokens=dev.size,
        start_layer=dev.start_layer, end_layer=dev.end_layer)


def _storage_config(extra: dict[str, Any] | None, layout: str) -> Any:
    from sglang.srt.mem_cache.hicache_storage import HiCacheStorageConfig

    return HiCacheStorageConfig(
        tp_rank=0, tp_size=1, pp_rank=0, pp_size=1, attn_cp_rank=0, attn_cp_size=1,
        is_mla_model=False, enable_storage_metrics=False,
        is_page_first_layout=layout == "page_first", model_name="bench/model",
        extra_config=extra)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--workdir", default="/var/tmp", help="the disk (kvstream's tier 0 and "
                    "HiCacheFile's directory)")
    ap.add_argument("--second", default="/dev/shm", help="kvstream's second tier")
    ap.add_argument("--pages", type=int, default=256, help="pages per pass (2 MiB each)")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--layout", default="page_first", choices=["page_first", "layer_first"])
    ap.add_argument("--json", default="", help="write the report here")
    args = ap.parse_args(argv)

    from sglang.srt.mem_cache.hicache_storage import HiCacheFile
    from sglang.srt.mem_cache.storage.backend_factory import StorageBackendFactory

    page = 64
    host = _host_pool(args.layout, args.pages, page)
    run = f"kvs-hicache-bench-{uuid.uuid4().hex[:8]}"
    disk, second = os.path.join(args.workdir, run), os.path.join(args.second, run)
    idx = host.alloc(args.pages * page)
    flat = host.kv_buffer.view(torch.uint8).view(-1)
    flat.copy_(torch.randint(0, 256, flat.shape, dtype=torch.uint8))
    keys = [f"{i:064x}" for i in range(args.pages)]
    want = [host.get_data_page(idx[i * page]).clone() for i in range(args.pages)]
    page_bytes = want[0].numel() * want[0].element_size()

    def kvstream(tiers: list[str]) -> Any:
        extra = {"backend_name": "kvstream", "module_path": "kvstream_backend",
                 "class_name": "KVStreamHiCacheStorage", "interface_v1": 1,
                 "tiers": [{"name": f"t{i}", "path": p, "max_size_gb": 64}
                           for i, p in enumerate(tiers)]}
        b = StorageBackendFactory.create_backend("dynamic", _storage_config(extra, args.layout),
                                                 host)
        b.register_mem_pool_host(host)
        return b

    configs: dict[str, tuple[Any, list[str]]] = {}
    try:
        configs["kvstream-disk"] = (kvstream([disk + "/a"]), [disk + "/a"])
        configs["kvstream-2tiers"] = (kvstream([disk + "/b", second + "/b"]),
                                      [disk + "/b", second + "/b"])
        fdir = disk + "/file"
        os.makedirs(fdir)
        hf = HiCacheFile(_storage_config({"file_storage_path": fdir}, args.layout),
                         file_path=fdir)
        hf.register_mem_pool_host(host)
        configs["HiCacheFile"] = (hf, [fdir])
        for name, (b, _) in configs.items():  # store every page in every configuration
            if name == "HiCacheFile":
                ok = b.batch_set(keys, [host.get_data_page(idx[i * page])
                                        for i in range(args.pages)])
            else:
                ok = all(b.batch_set_v1(keys, idx))
                b.engine.flush(600)
            if not ok:
                print(f"{name}: storing the pages failed", file=sys.stderr)
                return 1

        times: dict[str, list[float]] = {n: [] for n in configs}
        for _ in range(args.rounds):
            for name, (b, roots) in configs.items():
                for r in roots:
                    _drop_caches(r)
                flat.zero_()
                t0 = time.perf_counter()
                if name == "HiCacheFile":  # CacheController._generic_page_get
                    dst = [host.get_dummy_flat_data_page() for _ in keys]
                    got = b.batch_get(keys, dst)
                    for i, d in enumerate(got):
                        if d is None:
                            break
                        host.set_from_flat_data_page(idx[i * page], d)
                    n = sum(d is not None for d in got)
                else:
                    n = sum(b.batch_get_v1(keys, idx))
                times[name].append(time.perf_counter() - t0)
                if n != args.pages or any(
                        not torch.equal(host.get_data_page(idx[i * page]).view(torch.uint8),
                                        want[i].view(torch.uint8)) for i in range(0, n, 17)):
                    print(f"{name}: {n} of {args.pages} pages, or wrong bytes", file=sys.stderr)
                    return 1
        limits = {}
        for name, root in (("disk", disk + "/a"), ("second", second + "/b")):
            paths = [os.path.join(d, f) for d, _, fs in os.walk(root) for f in fs
                     if f.endswith(".kvs")]
            best, _ = plain.best_read(paths, os.cpu_count() or 1,
                                      functools.partial(_drop_caches, root))
            limits[name] = best / 1e9
        rows = []
        for name, (_, roots) in configs.items():
            med = statistics.median(times[name])
            rows.append(Row(name, " + ".join(_fs_type(r) for r in roots),
                            args.pages, page_bytes, [round(t, 4) for t in times[name]],
                            args.pages / med, args.pages * page_bytes / med / 1e9))
        base = next(row for row in rows if row.config == "HiCacheFile")
        for row in rows:
            row.ratio_vs_file = round(row.gb_per_s / base.gb_per_s, 3)
        ratio = {row.config: row.ratio_vs_file for row in rows}
        targets = {
            "kvstream-disk >= 1.0x HiCacheFile": _verdict(ratio["kvstream-disk"], 1.0),
            "kvstream-2tiers >= 1.5x HiCacheFile": _verdict(ratio["kvstream-2tiers"], 1.5),
        }
        report = Report(args.layout, page_bytes, args.pages, args.rounds,
                        _fs_type(args.workdir), _fs_type(args.second), rows, targets,
                        {k: round(v, 3) for k, v in limits.items()})
        from rich.console import Console

        render(report, Console())
        if args.json:
            save(report, args.json)
        return 0
    finally:
        for name, (b, _) in configs.items():
            if name != "HiCacheFile":
                b.close()
        shutil.rmtree(disk, ignore_errors=True)
        shutil.rmtree(second, ignore_errors=True)


def _verdict(ratio: float, target: float) -> str:
    return f"{ratio:.2f}x: {'met' if ratio >= target else 'NOT met'}"


def render(report: Report, console: Any) -> None:
    t = table(f"HiCache storage read, {report.pages} pages of {report.page_bytes >> 20} MiB "
              f"({report.layout}), page cache dropped, median of {report.rounds}", "config",
              "pages/s", "GB/s", "x HiCacheFile")
    for r in report.rows:
        t.add_row(r.config, f"{r.pages_per_s:.0f}", f"{r.gb_per_s:.2f}", f"{r.ratio_vs_file:.2f}")
    console.print(t)
    for r in report.rows:
        console.print(f"  {r.config}: {r.tiers}")
    console.print("  each tier's limit (a plain O_DIRECT reader of kvstream's files, best of "
                  "1..cores threads): " + ", ".join(f"{k} {v:.2f} GB/s"
                                                     for k, v in report.limits_gbps.items()))
    for k, v in report.targets.items():
        console.print(f"  {k}: {v}")


if __name__ == "__main__":
    sys.exit(main())
