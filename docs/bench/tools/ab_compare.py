"""Side by side: the median step of every configuration in each ``kvstream bench --json`` report
of a folder (``ab_routing.sh``'s ``old-N.json``/``new-N.json``), then each report's targets.

Usage: ``python ab_compare.py FOLDER``
"""

from __future__ import annotations

import glob
import json
import statistics
import sys


def main(folder: str) -> None:
    reports = {f.rsplit("/", 1)[-1][:-5]: json.load(open(f))
               for f in sorted(glob.glob(f"{folder}/*.json"))}
    rows: dict[str, dict[str, float]] = {}
    for tag, rep in reports.items():
        for c in rep["configs"]:
            if c["step_s"]:
                rows.setdefault(c["name"], {})[tag] = statistics.median(c["step_s"])
    print("step s".ljust(24) + "".join(t.rjust(8) for t in reports))
    for name, by in rows.items():
        print(name.ljust(24) + "".join(f"{by.get(t, float('nan')):8.3f}" for t in reports))
    for tag, rep in reports.items():
        print(f"{tag}: " + "; ".join(f"{t['name']} {t['value']:.2f}{'' if t['met'] else ' NOT met'}"
                                     for t in rep["targets"]))


if __name__ == "__main__":
    main(sys.argv[1])
