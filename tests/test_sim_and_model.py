"""``kvstream model`` and ``kvstream sim`` (kvsim): the paper's worked example and trace replays."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from kvstream_backend.cli import main
from kvstream_backend.config import EmulateConfig
from kvstream_backend.sim.cli import trace_path
from kvstream_backend.sim.replay import Request, SimParams, reuse_distances, run, simulate
from kvstream_backend.tiers.emulate import serial_seconds, tier_throttle

# The Mooncake traces ship with the package (kvstream_backend/sim/traces, Apache-2.0).
CONVERSATION = Path(trace_path("conversation"))


def _model(capsys, *args: str) -> dict:
    assert main(["model", *args]) == 0
    return json.loads(capsys.readouterr().out)


def test_model_worked_example(capsys) -> None:
    meets = _model(capsys, "--split", "0.75", "--bw", "3,1")
    assert meets["penalty"] == pytest.approx(1.0) and meets["phi"] == pytest.approx(0.75)
    slower = _model(capsys, "--split", "0.75", "--bw", "2,1", "--demand-gb", "30")
    assert slower["penalty"] == pytest.approx(1.125)
    assert slower["bound_s"] == pytest.approx(10.0) and slower["static_s"] == pytest.approx(11.25)
    worse = _model(capsys, "--split", "0.75", "--bw", "3,0.5")
    assert worse["static_s"] > worse["first_tier_alone_s"]


def test_model_rejects_bad_input(capsys) -> None:
    assert main(["model", "--split", "1.5", "--bw", "3,1"]) == 2
    assert main(["model", "--split", "0.5", "--bw", "3"]) == 2


def test_reuse_distances() -> None:
    reqs = [Request(0, 0, (1, 2, 3)), Request(1, 0, (1, 4)), Request(2, 0, (2,))]
    # accesses 1 2 3 1 4 2: reuse of 1 after {2,3}; reuse of 2 after {3,1,4}
    assert reuse_distances(reqs) == [2, 3]


def _synthetic(n: int = 400) -> list[Request]:
    import random

    rng = random.Random(3)
    reqs, t = [], 0.0
    for _ in range(n):
        t += rng.expovariate(4.0)
        root = rng.randrange(40)
        blocks = tuple([root * 1000] + [root * 1000 + k for k in range(1, rng.randint(2, 30))])
        reqs.append(Request(t, len(blocks) * 512, blocks))
    return reqs


P = SimParams(kv_bytes_per_token=65536, gpu_mem_gb=1, tier_bw_gbps=(3.0, 1.0), bw_jitter=0.3)


def test_more_memory_never_increases_demand() -> None:
    reqs = _synthetic()
    demand = [simulate(reqs, m, P).simulated_demand_bytes for m in (0.5, 1, 2, 4, 8, 16)]
    assert demand == sorted(demand, reverse=True) and demand[0] > demand[-1]


def test_higher_arrival_rate_never_lowers_mean_ttft() -> None:
    reqs = _synthetic()
    ttft = []
    for scale in (0.5, 1, 2, 4, 8):
        p = SimParams(**{**vars(P), "rate_scale": scale})
        ttft.append(next(x.ttft_mean_s for x in simulate(reqs, 2, p).policies
                         if x.name == "kvstream"))
    assert ttft == sorted(ttft)


@pytest.mark.parametrize("jitter", [0.0, 0.3, 0.6])
def test_kvstream_never_slower_than_the_best_static_split(jitter: float) -> None:
    p = SimParams(**{**vars(P), "bw_jitter": jitter})
    res = simulate(_synthetic(), 1, p)
    by = {x.name: x for x in res.policies}
    best_static = min((x for x in res.policies if x.name.startswith("static-")),
                      key=lambda x: x.retrieval_s_total)
    assert by["kvstream"].retrieval_s_total <= best_static.retrieval_s_total
    assert by["kvstream"].retrieval_s_total < by["first-tier"].retrieval_s_total


def test_eq2_predicts_simulated_demand_on_the_conversation_trace() -> None:
    rep = run(str(CONVERSATION), "mooncake", [25, 50, 100, 200, 400], P, "trace")
    demand = [m.simulated_demand_bytes for m in rep.memory]
    assert demand == sorted(demand, reverse=True)
    assert rep.demand_correlation is not None and rep.demand_correlation >= 0.99
    for m in rep.memory:
        assert m.predicted_demand_bytes == pytest.approx(m.simulated_demand_bytes, rel=0.1)


def test_sim_cli_is_deterministic(tmp_path) -> None:
    outs = []
    for i in range(2):
        out = tmp_path / f"r{i}.json"
        assert main(["sim", "--kv-bytes-per-token", "65536",  # the bundled trace by default
                     "--host-mem-gb", "50,100,200", "--gpu-mem-gb", "10", "--tier-bw", "3,1",
                     "--bw-jitter", "0.3", "--order", "random", "--seed", "5", "--limit",
                     "3000", "--json", str(out)]) == 0
        outs.append(out.read_text())
    assert outs[0] == outs[1]
    rep = json.loads(outs[0])
    assert len(rep["memory"]) == 3 and rep["requests"] == 3000


def test_sim_simple_format_and_errors(tmp_path) -> None:
    tr = tmp_path / "t.jsonl"
    tr.write_text("\n".join(json.dumps({"t": i * 0.1, "blocks": [1, 2, 3 + i]})
                            for i in range(20)))
    assert main(["sim", "--trace", str(tr), "--format", "simple", "--kv-bytes-per-token",
                 "1024", "--host-mem-gb", "0.001", "--tier-bw", "2,1"]) == 0
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"t": 0, "blocks": [1]}\n{"oops": 1}\n')
    assert main(["sim", "--trace", str(bad), "--format", "simple", "--kv-bytes-per-token",
                 "1024", "--host-mem-gb", "1", "--tier-bw", "2,1"]) == 2


def test_a_throttle_replay_gives_the_emulated_tiers_limit() -> None:
    mib = [1 << 20] * 50
    steady = EmulateConfig(write_mbps=100)
    assert serial_seconds(tier_throttle(steady, 0, write=True), mib) == pytest.approx(0.5)
    assert tier_throttle(steady, 0, write=False) is None  # reads run free
    bursty = EmulateConfig(write_mbps=100, jitter=0.35, pattern="bursty", period_s=0.1, seed=1)
    a = serial_seconds(tier_throttle(bursty, 0, write=True), mib)
    assert a == serial_seconds(tier_throttle(bursty, 0, write=True), mib)  # reproducible
    assert a != serial_seconds(tier_throttle(bursty, 1, write=True), mib)  # a stream per tier
    assert 0.5 / 1.35 <= a <= 0.5 / 0.65
