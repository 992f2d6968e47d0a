"""Prometheus export of an engine's counters, computed at scrape time (nothing on the hot path)."""

from __future__ import annotations

from collections.abc import Iterator

from prometheus_client import CollectorRegistry, start_http_server
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from .engine import Engine


class EngineCollector(Collector):
    def __init__(self, engine: Engine) -> None:
        self.engine = engine

    def collect(self) -> Iterator[Metric]:
        st = self.engine.stats()
        up = GaugeMetricFamily("kvstream_tier_up", "1 if the tier is healthy", labels=["tier"])
        used = GaugeMetricFamily("kvstream_tier_used_bytes", "bytes held", labels=["tier"])
        rb = CounterMetricFamily("kvstream_read_bytes", "bytes read", labels=["tier"])
        wb = CounterMetricFamily("kvstream_write_bytes", "bytes written", labels=["tier"])
        q = CounterMetricFamily("kvstream_quarantined", "chunk files moved aside",
                                labels=["tier", "reason"])
        err = CounterMetricFamily("kvstream_io_errors", "I/O errors", labels=["tier", "error"])
        rep = GaugeMetricFamily("kvstream_tier_replica_fraction",
                                "share of the chunks the other tiers hold that this tier holds",
                                labels=["tier"])
        fix = CounterMetricFamily("kvstream_tier_repaired", "chunk copies re-made from another "
                                  "tier", labels=["tier"])
        reads = CounterMetricFamily("kvstream_tier_reads", "chunk reads that ended (won, lost "
                                    "or failed)", labels=["tier"])
        lost = CounterMetricFamily("kvstream_tier_lost_reads", "good copies read after another "
                                   "tier's copy was delivered (hedges' losers)", labels=["tier"])
        lat = CounterMetricFamily("kvstream_tier_read_seconds", "chunk reads' latencies, issue to "
                                  "completion, summed (mean: rate of this / rate of reads)",
                                  labels=["tier"])
        for t in st.tiers:
            up.add_metric([t.name], 1.0 if t.up else 0.0)
            used.add_metric([t.name], t.used_bytes)
            rb.add_metric([t.name], t.read_bytes)
            wb.add_metric([t.name], t.write_bytes)
            for reason, n in t.quarantined.items():
                q.add_metric([t.name, reason], n)
            for e, n in t.errors.items():
                err.add_metric([t.name, e], n)
            rep.add_metric([t.name], t.replica_fraction)
            fix.add_metric([t.name], t.repaired)
            reads.add_metric([t.name], t.reads)
            lost.add_metric([t.name], t.lost_reads)
            lat.add_metric([t.name], t.read_s)
        yield from (up, used, rb, wb, q, err, rep, fix, reads, lost, lat)
        yield CounterMetricFamily("kvstream_chunks_read", "chunks delivered", st.chunks_read)
        miss = CounterMetricFamily("kvstream_misses", "chunks not delivered", labels=["reason"])
        for reason, n in st.misses.items():
            miss.add_metric([reason], n)
        yield miss
        yield CounterMetricFamily("kvstream_steps", "pooled retrieval steps", st.steps)
        yield CounterMetricFamily("kvstream_hedged_bytes", "bytes re-read by hedges",
                                  st.hedged_bytes)
        yield CounterMetricFamily("kvstream_write_overlap_bytes",
                                  "bytes written while reads were outstanding",
                                  st.write_overlap_bytes)
        if self.engine.steps:
            last = self.engine.steps[-1]
            yield GaugeMetricFamily("kvstream_last_step_seconds", "last step time", last.time_s)
            yield GaugeMetricFamily("kvstream_last_step_gap",
                                    "last step time over the aggregate-bandwidth bound, minus 1",
                                    last.gap)


def registry_for(engine: Engine) -> CollectorRegistry:
    reg = CollectorRegistry(auto_describe=True)
    reg.register(EngineCollector(engine))
    return reg


def serve(engine: Engine, port: int) -> None:
    """Expose the engine's metrics on ``port`` (HTTP, /metrics)."""
    start_http_server(port, registry=registry_for(engine))
