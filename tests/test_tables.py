"""Every table a user reads stays readable in an 80-column terminal or a log: no line wider
than 80 and every row's key (a configuration, a tier, a counter) printed whole, never cut to
"kvstream-…" (issue 21). Rendered from results recorded in docs/bench, so the rows are real."""

from __future__ import annotations

import io
import re
from pathlib import Path

import msgspec
import pytest
from rich.console import Console

from kvstream_backend.cli import main

DOCS = Path(__file__).resolve().parent.parent / "docs" / "bench"
ANSI = re.compile(r"\x1b\[[0-9;]*m")


def _render(fn, *args) -> str:
    buf = io.StringIO()
    fn(*args, Console(file=buf, width=80, force_terminal=False))
    return ANSI.sub("", buf.getvalue())


def _check(out: str, keys: list[str]) -> None:
    lines = out.splitlines()
    assert max(len(ln) for ln in lines) <= 80, out
    assert "…" not in out, out
    firsts = {ln.split()[0] for ln in lines if ln.strip()}
    for k in keys:
        assert k in firsts, f"{k!r} is not printed whole at the start of a row:\n{out}"


def test_the_main_bench_table() -> None:
    from kvstream_backend.bench.report import BenchReport, render

    rep = msgspec.json.decode((DOCS / "readpath-quick-gluster.json").read_bytes(),
                              type=BenchReport)
    _check(_render(render, rep), [c.name for c in rep.configs] + [w.name for w in rep.writes])


def test_the_gpu_bench_table() -> None:
    from kvstream_backend.bench.gpu import GpuReport, render

    rep = msgspec.json.decode((DOCS / "gpu-h200-readpath-after.json").read_bytes(),
                              type=GpuReport)
    _check(_render(render, rep), [c.name for c in rep.configs])


@pytest.mark.parametrize("raw", ["replay-h200-run1.json", "replay-h100-run4.json"])
def test_the_trace_replay_table(raw: str) -> None:
    """A report of every vintage renders (run 1 predates the limit samples, run 4 has them)."""
    from kvstream_backend.bench.replay import ReplayReport, render

    rep = msgspec.json.decode((DOCS / raw).read_bytes(), type=ReplayReport)
    rep.configs[1].ok, rep.configs[1].error = False, "RuntimeError: " + "a long reason " * 12
    out = _render(render, rep)
    _check(out, [c.name for c in rep.configs if c.ok])
    assert f"{rep.configs[1].name} failed: RuntimeError" in out
    for v in rep.limit_samples_gbps.values():  # the samples kvsim's limit was the best of
        assert " / ".join(f"{x:.2f}" for x in v) in " ".join(out.split())


def test_the_hicache_table() -> None:
    pytest.importorskip("torch")
    from kvstream_backend.bench.hicache import Report, render

    rep = msgspec.json.decode((DOCS / "hicache-side-by-side.json").read_bytes(), type=Report)
    _check(_render(render, rep), [r.config for r in rep.rows])


def test_the_sim_table() -> None:
    from kvstream_backend.sim.cli import render
    from kvstream_backend.sim.replay import SimReport

    rep = msgspec.json.decode((DOCS / "sim-conversation.json").read_bytes(), type=SimReport)
    out = _render(render, rep, "conversation")
    _check(out, [f"{m.host_mem_gb:g}:" for m in rep.memory])
    for m in rep.memory:
        for p in m.policies:
            assert re.search(rf"^ ?{re.escape(f'{m.host_mem_gb:g}: {p.name}')} ", out, re.M), out


def test_the_soak_table() -> None:
    from kvstream_backend.soak import SoakReport, render

    rep = SoakReport(61.0, {"put": 1200, "get": 3400, "remove": 80}, {"torn": 3, "enospc": 2},
                     1150, 3, 1, 0, 0, 0, {"disk": 2}, {})
    out = _render(render, rep, 7)
    lines = out.splitlines()
    assert max(len(ln) for ln in lines) <= 80 and "…" not in out, out
    assert any(ln.strip().startswith("chunks whose every copy a fault destroyed") for ln in lines)


def test_the_config_check_table(tmp_path, capsys, monkeypatch) -> None:
    monkeypatch.setenv("COLUMNS", "80")
    tiers = []
    for name in ("nvme-local-array-0", "pfs-scratch-project"):
        d = tmp_path / ("a-rather-long-directory-name-" * 2) / name
        d.mkdir(parents=True)
        tiers.append(f"{{name: {name}, path: '{d}', max_size_gb: 1}}")
    y = tmp_path / "lmcache.yaml"
    y.write_text("chunk_size: 256\nlocal_cpu: false\nmax_local_cpu_size: 64\n"
                 "storage_plugins: [kvstream]\nextra_config:\n"
                 "  storage_plugin.kvstream.module_path: kvstream_backend\n"
                 "  storage_plugin.kvstream.class_name: KVStreamBackend\n"
                 f"  kvstream.tiers: [{', '.join(tiers)}]\n")
    assert main(["check-config", str(y)]) == 0
    out = ANSI.sub("", capsys.readouterr().out)
    _check(out, ["nvme-local-array-0", "pfs-scratch-project"])
    assert str(tmp_path) in out.replace("\n", "")  # each tier's path, on a line of its own


def test_a_row_key_cut_short_fails_the_check() -> None:
    """The check above catches what issue 21 saw (rich's default table at 80 columns)."""
    from rich.table import Table

    t = Table()
    for c in ("config", "step s", "GB/s", "per-tier GB (GB/s)", "gap to bound",
              "vs lmcache-disk", "CPU s proc/machine"):
        t.add_column(c)
    t.add_row("kvstream+backlog", "0.480", "1.12", "tier0 0.54 (1.13), tier1 0.07 (0.07)",
              "+88.1%", "0.67x", "0.29/1.41")
    with pytest.raises(AssertionError):
        _check(_render(lambda c: c.print(t)), ["kvstream+backlog"])
