"""argparse value types shared by the ``kvstream`` subcommands (imports nothing of ours)."""

from __future__ import annotations

import argparse
from typing import Any

import msgspec


def floats(s: str) -> list[float]:
    """Comma-separated numbers."""
    try:
        return [float(x) for x in s.split(",")]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated numbers, got {s!r}") from None


def setting(s: str) -> tuple[str, Any]:
    """``KEY=VALUE``: a JSON value (``25``, ``0.5``, ``false``), else the text (``auto``)."""
    key, eq, value = s.partition("=")
    if not eq or not key.strip():
        raise argparse.ArgumentTypeError(f"expected KEY=VALUE, got {s!r}")
    try:
        return key.strip(), msgspec.json.decode(value)
    except msgspec.DecodeError:
        return key.strip(), value
