"""The Prometheus export reports what the engine did (read at scrape time)."""

from __future__ import annotations

from prometheus_client import generate_latest

from kvstream_backend import format as fmt
from kvstream_backend.metrics import registry_for

from .helpers import check_all, write_all


def test_metrics_follow_the_engine(tier_dirs, make_engine) -> None:
    e = make_engine(tier_dirs)
    reg = registry_for(e)
    write_all(e, ["m1", "m2", "m3"], 8192)
    check_all(e, ["m1", "m2", "m3"], 8192)
    assert e.wait_idle(10)  # the step report is recorded once the pool has drained
    e.tiers[0].quarantine(fmt.key_digest("m1"), "bad-payload-checksum")
    text = generate_latest(reg).decode()
    assert 'kvstream_tier_up{tier="t0"} 1.0' in text
    assert "kvstream_chunks_read_total 3.0" in text
    assert 'kvstream_quarantined_total{reason="bad-payload-checksum",tier="t0"} 1.0' in text
    assert "kvstream_last_step_gap" in text
    written = sum(float(line.split()[-1]) for line in text.splitlines()
                  if line.startswith("kvstream_write_bytes_total"))
    assert written == 2 * 3 * fmt.file_size(8192)  # replicated: every chunk on both tiers

    def total(name: str) -> float:
        return sum(float(line.split()[-1]) for line in text.splitlines()
                   if line.startswith(name + "_total{"))

    # every read ended won or lost (no failures here), and each took some time
    assert total("kvstream_tier_reads") == 3 + total("kvstream_tier_lost_reads")
    assert total("kvstream_tier_read_seconds") > 0
