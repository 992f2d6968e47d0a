"""Benchmark results: msgspec structs (``--json``), a rich table, targets and a plot."""

from __future__ import annotations

import statistics

import msgspec
from rich.console import Console

from ..io import files
from ..tables import table

GB = 1e9


class TierResult(msgspec.Struct):
    """A kvstream tier's reads in one configuration: medians over its steps."""

    name: str
    bytes: int
    busy_s: float
    gbps: float
    reads: float = 0.0
    lost: float = 0.0  # reads whose copy another tier's beat (what hedging cost)
    mean_read_ms: float = 0.0  # over every read of every step


class ConfigResult(msgspec.Struct):
    name: str
    description: str
    step_s: list[float]
    lookup_s: list[float]
    bytes_per_step: int
    tiers: list[TierResult] = []
    engine_gap: list[float] = []  # kvstream's own gap to D/sum(b_k) per step
    tier_gbps_per_step: dict[str, list[float]] = {}
    tier_samples: dict[str, list[tuple[int, float]]] = {}
    tier_reads: dict[str, list[tuple[int, int, float]]] = {}  # per step: reads, lost, seconds
    cpu_s: list[float] = []  # CPU seconds of the bench process per step
    machine_cpu_s: list[float] = []  # busy CPU seconds of the whole machine per step
    backlog_s: list[float] = []  # from the backlog's put until it is on every tier

    @property
    def median_s(self) -> float:
        return statistics.median(self.step_s)

    @property
    def gbps(self) -> float:
        return self.bytes_per_step / self.median_s / GB


class Target(msgspec.Struct):
    name: str
    value: float
    goal: str
    met: bool


class WriteRow(msgspec.Struct):
    """One writer (or one tier's write limit) over the interleaved write rounds: seconds per
    round for the same bytes (two steps' chunks)."""

    name: str
    description: str
    seconds: list[float]

    @property
    def median_s(self) -> float:
        return statistics.median(self.seconds)


class BenchReport(msgspec.Struct):
    machine: dict[str, str]
    setup: dict[str, str | int | float]
    configs: list[ConfigResult]
    bound_s: float  # D / sum(b_k), b_k measured apart from the engine (limit-* rows)
    targets: list[Target]
    notes: list[str]
    writes: list[WriteRow] = []  # the write rounds (kvstream, LMCache's disk, each limit)
    write_bytes: int = 0  # bytes each write round puts


def render(rep: BenchReport, console: Console) -> None:
    by = {c.name: c for c in rep.configs}
    base = by.get("lmcache-disk")
    t = table("kvstream bench: median step time (first lookup -> last get)", "config",
              "step s", "GB/s", "vs bound", "vs disk", "CPU s", "host CPU s")
    for c in rep.configs:
        gap = f"{c.median_s / rep.bound_s - 1:+.1%}" if rep.bound_s else "-"
        speed = f"{base.median_s / c.median_s:.2f}x" if base else "-"
        cpu = (f"{statistics.median(c.cpu_s):.2f}", f"{statistics.median(c.machine_cpu_s):.2f}") \
            if c.cpu_s else ("-", "-")
        t.add_row(c.name, f"{c.median_s:.3f}", f"{c.gbps:.2f}", gap, speed, *cpu)
    console.print(t)
    console.print(f"vs bound: step / D/sum(b_k) - 1, b_k = each limit-* row's best round "
                  f"(measured apart from the engine), {rep.bound_s:.3f} s per step; vs disk: "
                  "lmcache-disk's step / this one's; CPU s: this process's, host: the "
                  "machine's, per step")
    for c in rep.configs:
        if c.tiers:
            console.print(f"  {c.name}: " + ", ".join(
                f"{x.name} {x.bytes / GB:.2f} GB at {x.gbps:.2f} GB/s ({x.reads:g} reads, "
                f"{x.lost:g} lost, {x.mean_read_ms:.0f} ms each)" for x in c.tiers))
    if rep.writes:
        w = table(f"writes: {rep.write_bytes / GB:.2f} GB per round, rounds interleaved",
                  "writer", "median s", "GB/s", "per round s")
        for row in rep.writes:
            w.add_row(row.name, f"{row.median_s:.2f}", f"{rep.write_bytes / row.median_s / GB:.2f}",
                      " ".join(f"{x:.2f}" for x in row.seconds))
        console.print(w)
    console.print("targets (measured in this run; not asserted):")
    for x in rep.targets:
        mark = "[green]met[/]" if x.met else "[red]NOT met[/]"
        console.print(f"  {mark}  {x.name}: {x.value:.3f} (goal {x.goal})")
    for n in rep.notes:
        console.print(f"[dim]note:[/] {n}")


def plot(rep: BenchReport, path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(13, 4.5))
    for c in rep.configs:
        for tier, series in c.tier_gbps_per_step.items():
            if c.name in ("kvstream", "static-0.7", "kvstream+backlog"):
                ax1.plot(range(1, len(series) + 1), series, marker="o",
                         label=f"{c.name}: {tier}")
    ax1.xaxis.get_major_locator().set_params(integer=True)
    ax1.set_xlabel("step")
    ax1.set_ylabel("achieved tier bandwidth (GB/s)")
    ax1.set_title("per-tier bandwidth over steps")
    ax1.legend(fontsize=7)
    names = [c.name for c in rep.configs]
    gaps = [c.median_s / rep.bound_s - 1 if rep.bound_s else 0 for c in rep.configs]
    ax2.bar(names, gaps, color=["tab:green" if n.startswith("kvstream") else "tab:gray"
                                for n in names])
    ax2.axhline(0.05, color="tab:red", ls="--", lw=1, label="+5%")
    ax2.set_ylabel("step time / bound - 1")
    ax2.set_title("gap to the aggregate-bandwidth bound")
    ax2.tick_params(axis="x", rotation=45, labelsize=7)
    ax2.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def save(rep: msgspec.Struct, path: str) -> None:
    """``rep`` as indented JSON at ``path``, whole or not at all (written aside, then renamed:
    a run cut short mid-write leaves the previous checkpoint, never a torn file)."""
    files.replace_whole(path, msgspec.json.format(msgspec.json.encode(rep)), 0o666)
