"""Every invalid ``kvstream.*`` key or value is rejected with a message that names it."""

from __future__ import annotations

import json
import os

import pytest

from kvstream_backend.config import ConfigError, parse_config


def _tiers(tmp_path, **extra):
    t = {"name": "a", "path": str(tmp_path / "a"), "max_size_gb": 1}
    t.update(extra)
    return [t]


BAD = [
    ({}, "kvstream.tiers"),
    ({"kvstream.tiers": []}, "kvstream.tiers"),
    ({"kvstream.tiers": "not json"}, "kvstream.tiers"),
    ({"kvstream.bogus": 1}, "kvstream.bogus"),
    ({"kvstream.claim_batch": 0}, "kvstream.claim_batch"),
    ({"kvstream.claim_batch": "many"}, "kvstream.claim_batch"),
    ({"kvstream.read_window": 99, "kvstream.read_queue_depth": 8}, "kvstream.read_window"),
    ({"kvstream.read_window": "deep"}, "kvstream.read_window"),
    ({"kvstream.copy_threads": 0}, "kvstream.copy_threads"),
    ({"kvstream.copy_threads": "all"}, "kvstream.copy_threads"),
    ({"kvstream.spare_cores": -1}, "kvstream.spare_cores"),
    ({"kvstream.spare_cores": len(os.sched_getaffinity(0))}, "kvstream.spare_cores"),
    ({"kvstream.read_target_ms": 0}, "kvstream.read_target_ms"),
    ({"kvstream.claim_depth": 2}, "kvstream.claim_depth"),  # replaced by read_window in 0.2
    ({"kvstream.hedge": "perhaps"}, "kvstream.hedge"),
    ({"kvstream.write_queue_depth": -1}, "kvstream.write_queue_depth"),
    ({"kvstream.staging_budget_mb": 0}, "kvstream.staging_budget_mb"),
    ({"kvstream.file_mode": 0o7777}, "kvstream.file_mode"),
    ({"kvstream.prefetch_timeout_s": 0}, "kvstream.prefetch_timeout_s"),
    ({"kvstream.metrics_port": 70000}, "kvstream.metrics_port"),
]

BAD_TIER = [
    ({"max_size_gb": -1}, "kvstream.tiers[0].max_size_gb"),
    ({"max_size_gb": "big"}, "kvstream.tiers[0].max_size_gb"),
    ({"name": "bad name!"}, "kvstream.tiers[0].name"),
    ({"io": "aio"}, "kvstream.tiers[0].io"),
    ({"direct": "sometimes"}, "kvstream.tiers[0].direct"),
    ({"colour": "red"}, "kvstream.tiers[0].colour"),
    ({"path": "relative/dir"}, "kvstream.tiers[0].path"),
    ({"path": "/proc/kvstream-cannot-exist"}, "kvstream.tiers[0].path"),
    ({"emulate": {"pattern": "wavy"}}, "kvstream.tiers[0].emulate.pattern"),
    ({"emulate": {"jitter": 1.5}}, "kvstream.tiers[0].emulate.jitter"),
    ({"emulate": {"read_mbps": 0}}, "kvstream.tiers[0].emulate.read_mbps"),
]


@pytest.mark.parametrize("extra,key", BAD)
def test_bad_engine_keys(tmp_path, extra, key) -> None:
    cfg = {"kvstream.tiers": _tiers(tmp_path), **extra} if extra else {}
    with pytest.raises(ConfigError) as e:
        parse_config(cfg)
    assert key in str(e.value)


@pytest.mark.parametrize("extra,key", BAD_TIER)
def test_bad_tier_keys(tmp_path, extra, key) -> None:
    with pytest.raises(ConfigError) as e:
        parse_config({"kvstream.tiers": _tiers(tmp_path, **extra)})
    assert key in str(e.value)


def test_missing_tier_field(tmp_path) -> None:
    with pytest.raises(ConfigError, match=r"kvstream\.tiers\[0\]\.path"):
        parse_config({"kvstream.tiers": [{"name": "a", "max_size_gb": 1}]})


def test_duplicate_and_overlapping_tiers(tmp_path) -> None:
    a = {"name": "a", "path": str(tmp_path / "a"), "max_size_gb": 1}
    with pytest.raises(ConfigError, match=r"kvstream\.tiers\[1\]\.name"):
        parse_config({"kvstream.tiers": [a, {**a, "path": str(tmp_path / "b")}]})
    with pytest.raises(ConfigError, match=r"kvstream\.tiers\[1\]\.path"):
        parse_config({"kvstream.tiers": [a, {**a, "name": "b", "path": str(tmp_path / "a/x")}]})


def test_unwritable_directory(tmp_path) -> None:
    f = tmp_path / "file"
    f.write_text("x")
    with pytest.raises(ConfigError, match=r"kvstream\.tiers\[0\]\.path"):
        parse_config({"kvstream.tiers": _tiers(tmp_path, path=str(f))})


def test_env_var_form(tmp_path) -> None:
    """LMCACHE_EXTRA_CONFIG delivers strings: tiers as JSON, scalars as text."""
    cfg = parse_config({
        "kvstream.tiers": json.dumps(_tiers(tmp_path)),
        "kvstream.claim_batch": "8",
        "kvstream.hedge": "false",
        "unrelated.key": "ignored",
    })
    assert cfg.claim_batch == 8 and cfg.hedge is False
    assert cfg.tiers[0].capacity_bytes == 1 << 30
    assert (tmp_path / "a").is_dir()
