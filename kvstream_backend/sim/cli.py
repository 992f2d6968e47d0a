"""``kvstream sim`` argument parsing (the simulator itself is in :mod:`.replay`)."""

from __future__ import annotations

from typing import Any


def add_sim_parser(sub: Any) -> None:
    p = sub.add_parser("sim", help="replay a request trace through the performance model")
    p.set_defaults(func=lambda a: 2)
