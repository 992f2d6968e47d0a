"""``kvstream bench --set KEY=VALUE``: kvstream keys laid over the bench's own in every kvstream
configuration (the CPU bench, ``--gpu`` and ``--gpu --trace``)."""

from __future__ import annotations

from typing import Any

from ..config import ConfigError, parse_params


def settings(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    """``--set``'s keys, checked as kvstream's own (a ConfigError names the key)."""
    given = dict(pairs)
    if "tiers" in given:
        raise ConfigError("--set.tiers: the bench's tiers come from --tier")
    if "static_split" in given:
        raise ConfigError("--set.static_split: the bench's static-* rows set their own")
    probe = [{"name": "probe", "path": "/nonexistent", "max_size_gb": 1}]
    parse_params({**given, "tiers": probe}, label="--set")
    return given


def settings_notes(given: dict[str, Any]) -> list[str]:
    """The report's note on ``--set`` (none without it)."""
    if not given:
        return []
    keys = " ".join(f"{k}={v}" for k, v in given.items())
    return [f"--set {keys}: over the bench's own keys in every kvstream configuration"]
