"""``kvstream check-config``: LMCache's own loader, plugin selection and every kvstream key."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from kvstream_backend.cli import main

from . import lmcache_helpers as H

REPO = Path(__file__).resolve().parent.parent


def test_good_file(tmp_path, tier_dirs, capsys) -> None:
    y = H.write_yaml(tmp_path / "ok.yaml", tier_dirs)
    assert main(["check-config", str(y)]) == 0
    assert "OK" in capsys.readouterr().out


def test_example_file_validates_without_creating_directories(tmp_path) -> None:
    doc = yaml.safe_load((REPO / "examples" / "lmcache-kvstream.yaml").read_text())
    for i, t in enumerate(doc["extra_config"]["kvstream.tiers"]):
        t["path"] = str(tmp_path / f"not-yet-{i}" / "kvstream")
    y = tmp_path / "example.yaml"
    y.write_text(yaml.safe_dump(doc))
    assert main(["check-config", str(y)]) == 0
    assert not (tmp_path / "not-yet-0").exists()


def test_a_missing_tier_root_is_reported_as_down_at_start(tmp_path, capsys) -> None:
    y = H.write_yaml(tmp_path / "m.yaml", [str(tmp_path / "there"), str(tmp_path / "absent")])
    (tmp_path / "there").mkdir()
    assert main(["check-config", str(y)]) == 0  # the plugin loads and serves from "there"
    out = capsys.readouterr()
    assert "MISSING" in out.out and "starts DOWN" in out.err
    assert not (tmp_path / "absent").exists()


def _bad(tmp_path, tier_dirs, mutate) -> Path:
    y = H.write_yaml(tmp_path / "bad.yaml", tier_dirs)
    doc = yaml.safe_load(y.read_text())
    mutate(doc)
    y.write_text(yaml.safe_dump(doc))
    return y


BAD = {
    "unknown kvstream key": (lambda d: d["extra_config"].update({"kvstream.colour": 1}),
                             "kvstream.colour"),
    "bad value": (lambda d: d["extra_config"].update({"kvstream.claim_batch": -3}),
                  "kvstream.claim_batch"),
    "plugin not selected": (lambda d: d.update({"storage_plugins": []}), "does not select"),
    "module missing": (lambda d: d["extra_config"].update(
        {"storage_plugin.kvstream.module_path": "no_such_module"}), "cannot import"),
    "class missing": (lambda d: d["extra_config"].update(
        {"storage_plugin.kvstream.class_name": "Nope"}), "cannot import"),
    "tier path is a file": (lambda d: d["extra_config"]["kvstream.tiers"][0].update(
        {"path": "/etc/hostname"}), "kvstream.tiers[0].path"),
    "no tiers": (lambda d: d["extra_config"].pop("kvstream.tiers"), "kvstream.tiers"),
}


@pytest.mark.parametrize("case", list(BAD))
def test_bad_files_exit_nonzero_with_the_reason(tmp_path, tier_dirs, capsys, case) -> None:
    mutate, reason = BAD[case]
    y = _bad(tmp_path, tier_dirs, mutate)
    assert main(["check-config", str(y)]) != 0
    assert reason in capsys.readouterr().err.replace("\n", "")


def test_missing_file_and_console_script(tmp_path) -> None:
    r = subprocess.run([sys.executable, "-m", "kvstream_backend.cli", "check-config",
                        str(tmp_path / "none.yaml")], capture_output=True, text=True)
    assert r.returncode == 2 and "no such file" in r.stderr


def test_memory_bounds_that_do_not_fit_lmcache_host_memory_are_warned(tmp_path, tier_dirs,
                                                                      capsys) -> None:
    y = H.write_yaml(tmp_path / "mem.yaml", tier_dirs, prefetch_max_gb=4,
                     staging_budget_mb=2048)  # max_local_cpu_size 0.5 GB in this YAML
    assert main(["check-config", str(y)]) == 0
    err = capsys.readouterr().err
    assert "kvstream.prefetch_max_gb (4) + 2 x kvstream.staging_budget_mb" in err
