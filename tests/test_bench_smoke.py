"""The main job runs end to end (tiny shapes): every configuration, the report and its files."""

from __future__ import annotations

import json
import os

from kvstream_backend import format as fmt
from kvstream_backend.bench.cli import DEFAULT_PFS
from kvstream_backend.cli import main
from kvstream_backend.config import EmulateConfig
from kvstream_backend.tiers.emulate import serial_seconds, tier_throttle


def test_bench_runs_every_configuration(tmp_path) -> None:
    out, png = tmp_path / "bench.json", tmp_path / "bench.png"
    rc = main(["bench", "--requests", "2", "--chunks", "3", "--steps", "1", "--layers", "2",
               "--kv-bytes-per-token", "4096", "--write-rounds", "6", "--workdir", str(tmp_path),
               "--json", str(out), "--plot", str(png)])
    assert rc == 0
    rep = json.loads(out.read_text())
    names = {c["name"] for c in rep["configs"]}
    assert {"kvstream", "kvstream-first", "kvstream-second", "static-0.5", "static-0.7",
            "static-0.9", "lmcache-disk", "kvstream+backlog", "lmcache-disk+backlog",
            "fast", "fast-rev", "fast-alone", "fast-warm"} <= names
    assert all(len(c["step_s"]) == 1 and c["step_s"][0] > 0 for c in rep["configs"])
    assert rep["bound_s"] > 0 and len(rep["targets"]) >= 4
    kv = next(c for c in rep["configs"] if c["name"] == "kvstream")
    chunks = 2 * 3  # every chunk of the step was read by some tier, and each read took time
    assert sum(t["reads"] for t in kv["tiers"]) >= chunks
    assert all(t["mean_read_ms"] > 0 for t in kv["tiers"] if t["reads"])
    writes = {w["name"]: w["seconds"] for w in rep["writes"]}
    assert set(writes) == {"kvstream", "kvstream-visible", "lmcache-disk", "limit-nvme",
                           "limit-pfs", "limit-nvme+others", "limit-pfs+others"}
    # six rounds: LMCache's disk backend never frees the capacity its removals release, so
    # the bench must size it for every round (with fewer, the leak stayed under its capacity)
    assert all(len(s) == 6 and all(x > 0 for x in s) for s in writes.values())
    # the emulated tier's write limit is never faster than its throttle replayed over the
    # round's chunk files (the second tier's write stream, as in the engine)
    chunk = rep["setup"]["chunk_bytes"]
    replay = serial_seconds(tier_throttle(EmulateConfig(**DEFAULT_PFS), 1, write=True),
                            [fmt.HEADER_SIZE + fmt.padded(chunk)] * (rep["write_bytes"] // chunk))
    assert min(writes["limit-pfs"] + writes["limit-pfs+others"]) >= replay * 0.999
    assert png.stat().st_size > 10_000
    assert not list(tmp_path.glob("kvstream-bench-*")), "the bench left its tiers behind"


def test_bench_on_given_tiers_leaves_them_as_it_found_them(tmp_path, capsys) -> None:
    """Each run works in a new subdirectory of a ``--tier`` path: chunks a run left behind
    would turn the next run's first write round into no-ops."""
    a, b = tmp_path / "a", tmp_path / "b"
    for d in (a, b):
        d.mkdir()
        (d / "mine").write_text("not the bench's")
    tiny = ["bench", "--requests", "1", "--chunks", "2", "--steps", "1", "--layers", "2",
            "--kv-bytes-per-token", "4096", "--write-rounds", "1", "--workdir", str(tmp_path)]
    assert main([*tiny, "--tier", str(a), "--tier", f"{b}:write_mbps=400"]) == 0
    assert sorted(os.listdir(a)) == sorted(os.listdir(b)) == ["mine"]
    assert main([*tiny, "--tier", str(a), "--tier", str(tmp_path / "unmounted")]) == 2
    assert "unmounted: no such directory" in " ".join(capsys.readouterr().out.split())
    assert main([*tiny, "--tier", str(a), "--tier", f"{b}:jitter=2"]) == 2  # a bad option
    assert "emulate.jitter" in capsys.readouterr().out
    assert os.listdir(a) == os.listdir(b) == ["mine"]  # nothing made for a run refused


def test_set_lays_kvstream_keys_over_the_bench_and_names_a_bad_one(tmp_path, capsys) -> None:
    """``--set KEY=VALUE`` reaches every kvstream configuration (the report says so); a key
    kvstream does not have, a bad value or the tiers (``--tier``'s) is refused by name."""
    tiny = ["bench", "--requests", "1", "--chunks", "2", "--steps", "1", "--layers", "2",
            "--kv-bytes-per-token", "4096", "--write-rounds", "1", "--workdir", str(tmp_path)]
    for bad, named in ((["--set", "read_target_ms=soon"], "--set.read_target_ms"),
                       (["--set", "read_tagret_ms=25"], "read_tagret_ms"),
                       (["--set", "tiers=[]"], "--set.tiers"),
                       (["--set", "static_split=0.5"], "--set.static_split")):
        assert main([*tiny, *bad]) == 2
        assert named in " ".join(capsys.readouterr().out.split())
    out, stats = tmp_path / "bench.json", tmp_path / "engine-stats.json"
    assert main([*tiny, "--set", f"stats_file={stats}", "--set", "hedge=false",
                 "--json", str(out)]) == 0
    rep = json.loads(out.read_text())
    assert f"--set stats_file={stats} hedge=False: over the bench's own keys in every " \
           "kvstream configuration" in rep["notes"]
    assert json.loads(stats.read_text())["tiers"], "the engines wrote their counters there"
