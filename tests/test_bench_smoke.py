"""The main job runs end to end (tiny shapes): every configuration, the report and its files."""

from __future__ import annotations

import json

from kvstream_backend.cli import main


def test_bench_runs_every_configuration(tmp_path) -> None:
    out, png = tmp_path / "bench.json", tmp_path / "bench.png"
    rc = main(["bench", "--requests", "2", "--chunks", "3", "--steps", "1", "--layers", "2",
               "--kv-bytes-per-token", "4096", "--write-rounds", "2", "--workdir", str(tmp_path),
               "--json", str(out), "--plot", str(png)])
    assert rc == 0
    rep = json.loads(out.read_text())
    names = {c["name"] for c in rep["configs"]}
    assert {"kvstream", "kvstream-first", "kvstream-second", "static-0.5", "static-0.7",
            "static-0.9", "lmcache-disk", "kvstream+backlog", "lmcache-disk+backlog"} <= names
    assert all(len(c["step_s"]) == 1 and c["step_s"][0] > 0 for c in rep["configs"])
    assert rep["bound_s"] > 0 and len(rep["targets"]) >= 4
    writes = {w["name"]: w["seconds"] for w in rep["writes"]}
    assert set(writes) == {"kvstream", "kvstream-visible", "lmcache-disk", "limit-nvme",
                           "limit-pfs"}
    assert all(len(s) == 2 and all(x > 0 for x in s) for s in writes.values())
    # the emulated tier's write limit is never faster than its nominal rate (400 MiB/s)
    assert min(writes["limit-pfs"]) >= rep["write_bytes"] / (400 << 20) * 0.999
    assert png.stat().st_size > 10_000
    assert not list(tmp_path.glob("kvstream-bench-*")), "the bench left its tiers behind"
