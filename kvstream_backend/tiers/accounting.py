"""Per-tier and per-step accounting of the read path (loop thread only; no I/O, no policy).

A *step* is one demanded pool: it opens when a get's first chunk joins while none is open and
closes when every demanded chunk is delivered or missed. Its report covers the bytes each tier
moved and the time it had at least one read in flight between those two moments, so reads of
prefetches that ran inside the step count toward the tiers' bandwidth, not toward ``bytes``.
"""

from __future__ import annotations

import collections

from ..stats import StepReport, TierStep


class TierMeter:
    """Cumulative counters of one tier; a step's figures are differences of two snapshots."""

    __slots__ = ("name", "bytes", "chunks", "busy_s", "hedged_bytes", "errors", "inflight",
                 "busy_since", "write_bytes", "error_kinds", "repaired", "reads", "lost",
                 "read_s", "max_read_s")

    def __init__(self, name: str) -> None:
        self.name = name
        self.bytes = 0
        self.chunks = 0
        self.busy_s = 0.0
        self.hedged_bytes = 0
        self.errors = 0
        self.inflight = 0
        self.busy_since = 0.0
        self.write_bytes = 0
        self.repaired = 0  # chunk copies re-made from another tier
        self.error_kinds: collections.Counter[str] = collections.Counter()
        self.reads = 0  # reads that ended
        self.lost = 0  # of those, good copies another tier's copy beat
        self.read_s = 0.0  # their latencies, summed
        self.max_read_s = 0.0  # the longest since the open step began

    def started(self, now: float) -> None:
        if self.inflight == 0:
            self.busy_since = now
        self.inflight += 1

    def ended(self, now: float, moved: int, hedge: bool, started_at: float) -> None:
        self.inflight -= 1
        if self.inflight == 0:
            self.busy_s += now - self.busy_since
        self.bytes += moved
        if hedge:
            self.hedged_bytes += moved
        took = now - started_at
        self.reads += 1
        self.read_s += took
        if took > self.max_read_s:
            self.max_read_s = took

    def step_opened(self) -> None:
        """A step begins: ``max_read_s`` covers its reads from here (the other counters are
        cumulative; a step takes their difference)."""
        self.max_read_s = 0.0

    def error(self, kind: str) -> None:
        self.errors += 1
        self.error_kinds[kind] += 1

    def snapshot(self, now: float) -> TierStep:
        busy = self.busy_s + (now - self.busy_since if self.inflight else 0.0)
        return TierStep(self.name, self.bytes, self.chunks, busy, self.hedged_bytes,
                        self.errors, self.reads, self.lost, self.read_s, self.max_read_s)


def _delta(a: TierStep, b: TierStep) -> TierStep:
    """The step between snapshots ``a`` and ``b`` (``max_read_s`` was reset when it opened)."""
    return TierStep(a.name, b.bytes - a.bytes, b.chunks - a.chunks, b.busy_s - a.busy_s,
                    b.hedged_bytes - a.hedged_bytes, b.errors - a.errors, b.reads - a.reads,
                    b.lost - a.lost, b.read_s - a.read_s, b.max_read_s)


class StepMeter:
    """The open step's figures and the reports of closed steps."""

    def __init__(self, meters: list[TierMeter], keep: int = 1024) -> None:
        self._meters = meters
        self.reports: collections.deque[StepReport] = collections.deque(maxlen=keep)
        self.closed = 0
        self.open = False
        self._t0 = self._last = 0.0
        self._start: list[TierStep] = []
        self.chunks = self.misses = self.bytes = self.overlap = 0

    def opened(self, now: float) -> None:
        if self.open:
            return
        self.open = True
        self._t0 = self._last = now
        for m in self._meters:
            m.step_opened()
        self._start = [m.snapshot(now) for m in self._meters]
        self.chunks = self.misses = self.bytes = self.overlap = 0

    def joined(self, n: int = 1) -> None:
        self.chunks += n

    def delivered(self, nbytes: int, now: float) -> None:
        self.bytes += nbytes
        self._last = now

    def missed(self, now: float) -> None:
        self.misses += 1
        self._last = now

    def close(self, now: float) -> None:
        if not self.open:
            return
        self.open = False
        tiers = [_delta(a, m.snapshot(now)) for a, m in zip(self._start, self._meters,
                                                            strict=True)]
        t = max(self._last - self._t0, 1e-9)
        agg = sum(ts.bandwidth for ts in tiers)
        bound = self.bytes / agg if agg > 0 else 0.0
        rep = StepReport(
            chunks=self.chunks, misses=self.misses, bytes=self.bytes,
            time_s=t if self.bytes else 0.0, bound_s=bound,
            gap=(t / bound - 1) if bound > 0 else 0.0, write_overlap_bytes=self.overlap,
            tiers=tiers,
        )
        self.reports.append(rep)
        self.closed += 1
