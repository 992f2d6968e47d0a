"""Per-step and per-tier accounting structs (msgspec, so reports serialise to JSON as they are)."""

from __future__ import annotations

import msgspec


class TierStep(msgspec.Struct):
    """What one tier did during one step."""

    name: str
    bytes: int = 0  # bytes moved by this tier's reads, hedges and losers included
    chunks: int = 0  # chunks this tier delivered (won)
    busy_s: float = 0.0  # time with at least one read in flight
    hedged_bytes: int = 0
    errors: int = 0
    reads: int = 0  # reads that ended (won, lost or failed): reads == chunks + lost + failed
    lost: int = 0  # reads that returned a good copy after another tier's copy was delivered
    read_s: float = 0.0  # the reads' latencies (issue to completion), summed
    max_read_s: float = 0.0  # the longest read that ended in the step

    @property
    def bandwidth(self) -> float:
        """Achieved bandwidth in bytes/s while busy (0 if the tier read nothing)."""
        return self.bytes / self.busy_s if self.busy_s > 0 else 0.0


class StepReport(msgspec.Struct):
    """One pooled retrieval step: from the first chunk admitted to the last one resolved.

    ``bound_s`` is D / sum(b_k) with b_k each tier's achieved bandwidth in this step;
    ``gap`` is time_s / bound_s - 1 (0 means the step ran at the aggregate-bandwidth bound).
    """

    chunks: int
    misses: int
    bytes: int
    time_s: float
    bound_s: float
    gap: float
    write_overlap_bytes: int
    tiers: list[TierStep]


class TierInfo(msgspec.Struct):
    name: str
    path: str
    io: str
    direct: bool
    io_reason: str
    up: bool
    down_reason: str
    chunks: int
    used_bytes: int
    capacity_bytes: int
    emulated: bool
    read_bytes: int
    write_bytes: int
    quarantined: dict[str, int]
    evicted: int
    capacity_skips: int
    errors: dict[str, int]
    inline_issue: str = ""  # what the io_uring inline-issue probe measured at start
    read_busy_s: float = 0.0  # time with at least one read in flight, since start
    repaired: int = 0  # chunk copies re-made from another tier (replication upkeep)
    replica_fraction: float = 1.0  # of the chunks the other tiers hold, the share this one has
    reads: int = 0  # reads that ended, since start
    lost_reads: int = 0  # good copies read after another tier's copy was delivered
    read_s: float = 0.0  # the reads' latencies (issue to completion), summed


class EngineStats(msgspec.Struct):
    tiers: list[TierInfo]
    steps: int
    chunks_read: int
    misses: dict[str, int]
    writes_staged: int
    writes_published: int
    writes_failed: int
    write_overlap_bytes: int
    hedged_bytes: int
    prefetch_hits: int = 0  # demanded chunks whose lookup-time read had already landed
    prefetch_dropped: int = 0  # prefetches given up before a get (released, expired)
    prefetch_expired: int = 0
    prefetch_held_bytes: int = 0  # prefetch buffers allocated and not demanded yet
    writes_dropped: int = 0  # staged chunks given up (close, memory), never written
    replicas_shed: int = 0  # queued copies given up under memory pressure (visible elsewhere)
    staged_bytes: int = 0  # payload bytes of staged chunks not finished (buffers held)
