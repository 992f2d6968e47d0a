"""argparse value types shared by the ``kvstream`` subcommands (imports nothing of ours)."""

from __future__ import annotations

import argparse


def floats(s: str) -> list[float]:
    """Comma-separated numbers."""
    try:
        return [float(x) for x in s.split(",")]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated numbers, got {s!r}") from None
