"""The deferred, replicated writer (KVStream M2 + M3), and the repairs that keep replication.

:meth:`Writer.stage` runs on any thread (LMCache's forward thread) and returns at once; the
rest runs on the completion loop. Staged chunks get their header and join a queue per
healthy tier that lacks them; each tier writes from its own queue (``write_queue_depth`` copies
in flight), so a slow tier never holds back a fast tier's copy, and a chunk is visible as soon
as its fastest copy lands. All of this waits while a read is outstanding, unless the
memory held by unfinished chunks exceeds ``staging_budget_mb``: then (1) writes go on during
reads (counted as overlap), (2) queued copies of chunks already visible on another tier are
shed (counted; the repairs below re-make them when the chunk is read), and (3) past twice the
budget the oldest chunks not yet written anywhere are dropped (counted; LMCache recomputes
them). While every tier is down, staged chunks are dropped at once rather than held (their
buffers are LMCache's, and an outage can last). The forward thread never blocks. Each copy is one
:class:`~kvstream_backend.tiers.jobs.WriteJob` on its tier's worker. ``on_published(key)``
fires when the first copy is visible, ``on_done()`` when every copy is finished; the chunk's
buffer must stay valid until then.

Repairs: when a chunk is served from one tier while a healthy tier lacks it (it was down, or
evicted the chunk), that tier gets a copy of the file, behind reads and staged writes, one
copy at a time per tier (:class:`~kvstream_backend.tiers.jobs.RepairJob`).
"""

from __future__ import annotations

import collections
import errno
import os
import threading
from collections.abc import Callable
from dataclasses import dataclass, field

from .. import format as fmt
from ..config import KVStreamConfig
from ..handles import Buffer, Segment, call_safely, payload_views, segments
from ..io import files
from ..io.memory import SlabPool
from ..tiers.accounting import StepMeter
from ..tiers.jobs import RepairJob, WriteJob
from ..tiers.runtime import TierRuntime

REPAIR_BACKLOG = 4096  # chunk copies waiting for a quiet moment; older wishes are dropped


@dataclass
class StagedChunk:
    key: str
    digest: bytes
    buf: Buffer
    payload_len: int
    meta: bytes
    on_published: Callable[[str], None] | None
    on_done: Callable[[], None] | None
    hdr: tuple[int, memoryview] | None = None
    header: fmt.Header | None = None
    segs: list[Segment] = field(default_factory=list)  # the memory each copy writes (the
    # payload, padded when the buffer allows)
    pending: int = 0  # copies queued or in flight
    published: bool = False


class Writer:
    def __init__(self, cfg: KVStreamConfig, tiers: list[TierRuntime], slab: SlabPool,
                 steps: StepMeter, tier_down: Callable[[int, str], None]) -> None:
        self._cfg = cfg
        self._tiers = tiers
        self._slab = slab
        self._steps = steps
        self._tier_down = tier_down
        self._lock = threading.Lock()  # guards _writing, held_bytes, stopping, counters
        self._writing: set[bytes] = set()
        self.held_bytes = 0  # payload bytes of staged chunks not finished (buffers held)
        self.stopping = False
        self._staged: collections.deque[StagedChunk] = collections.deque()  # loop only
        self._queues: list[collections.deque[StagedChunk]] = [
            collections.deque() for _ in tiers]  # started chunks waiting for a tier's slot
        self._inflight = [0] * len(tiers)  # loop only
        self._repairs: collections.OrderedDict[tuple[bytes, int], int] = (
            collections.OrderedDict())  # (digest, target tier) -> source tier; loop only
        self._repairing = [False] * len(tiers)
        self.staged_total = 0
        self.published = 0
        self.failed = 0
        self.dropped = 0  # staged chunks given up (close, memory), never written
        self.shed = 0  # queued copies given up under memory pressure (visible elsewhere)
        self.overlap_bytes = 0

    # ---- any thread -----------------------------------------------------------------------
    def stage(self, key: str, digest: bytes, buf: Buffer, payload_len: int, meta: bytes,
              on_published: Callable[[str], None] | None,
              on_done: Callable[[], None] | None) -> StagedChunk | None:
        """Reserve ``digest`` for writing; None if it is already being written or closing."""
        with self._lock:
            if digest in self._writing or self.stopping:
                return None
            self._writing.add(digest)
            self.held_bytes += payload_len
            self.staged_total += 1
        return StagedChunk(key, digest, buf, payload_len, meta, on_published, on_done)

    def stop(self) -> None:
        """Stage nothing more (any thread; close)."""
        with self._lock:
            self.stopping = True

    def writing(self, digest: bytes) -> bool:
        with self._lock:
            return digest in self._writing

    def writing_any(self) -> bool:
        """Whether any staged chunk is unfinished (any thread)."""
        with self._lock:
            return bool(self._writing)

    # ---- the completion loop ------------------------------------------------------------
    def repairs_idle(self) -> bool:
        """No repair queued or running (the loop's state: the engine publishes it each turn)."""
        return not self._repairs and not any(self._repairing)

    def enqueue(self, chunk: StagedChunk) -> None:
        self._staged.append(chunk)

    @property
    def busy(self) -> bool:
        return (bool(self._staged) or any(self._queues) or any(self._inflight)
                or any(self._repairing))

    def served(self, digest: bytes, src: int) -> None:
        """``digest`` was just read from tier ``src``: queue a copy for healthy tiers lacking it."""
        for ti, rt in enumerate(self._tiers):
            if ti != src and rt.tier.up and not rt.tier.has(digest):
                self._repairs[(digest, ti)] = src
                if len(self._repairs) > REPAIR_BACKLOG:
                    self._repairs.popitem(last=False)

    def _pump_repairs(self) -> None:
        for (digest, ti), src in list(self._repairs.items()):
            if self._repairing[ti]:
                continue
            del self._repairs[(digest, ti)]
            target, source = self._tiers[ti], self._tiers[src]
            if not (target.tier.up and source.tier.up) or target.tier.has(digest):
                continue
            self._repairing[ti] = True
            target.io.repair(RepairJob(ti, digest, source.tier.chunk_path(digest)))
            if all(self._repairing):
                return

    def repaired(self, job: RepairJob) -> None:
        self._repairing[job.tier] = False
        rt = self._tiers[job.tier]
        if job.ok:
            rt.meter.repaired += 1
            rt.meter.write_bytes += job.moved
        elif job.errno:
            rt.meter.error(files.errname(job.errno))
            self._tier_down(job.tier, f"repair: {os.strerror(job.errno)}")

    def pump(self, reads_busy: bool) -> None:
        budget = self._cfg.staging_budget_bytes
        over = self.held_bytes > budget
        if over:
            self._shed(budget)
        if reads_busy and not over:
            return
        depth = self._cfg.write_queue_depth
        while self._staged and any(  # start chunks while some tier could take one now
                rt.tier.up and len(q) + self._inflight[i] < depth
                for i, (rt, q) in enumerate(zip(self._tiers, self._queues, strict=True))):
            chunk = self._staged.popleft()
            if reads_busy:
                self._steps.overlap += chunk.payload_len
                self.overlap_bytes += chunk.payload_len
            self._start(chunk)
        for ti, q in enumerate(self._queues):
            while q and self._inflight[ti] < depth:
                self._issue(ti, q.popleft())
        while self._staged and (self.held_bytes > 2 * budget
                                or not any(rt.tier.up for rt in self._tiers)):
            self._drop(self._staged.popleft())  # no tier can take it: hand the buffer back
        if not reads_busy and not self._staged and not any(self._queues) and self._repairs:
            self._pump_repairs()

    def _shed(self, budget: int) -> None:
        """Give up queued copies of chunks that are visible on another tier, oldest first."""
        for ti, q in enumerate(self._queues):
            keep: collections.deque[StagedChunk] = collections.deque()
            while q:
                chunk = q.popleft()
                if chunk.published and self.held_bytes > budget:
                    self.shed += 1
                    self._tiers[ti].meter.error("shed")
                    self._copy_done(chunk)
                else:
                    keep.append(chunk)
            self._queues[ti] = keep

    def drop_staged(self) -> int:
        """Give up every chunk and copy not issued yet (close ran out of time); a chunk that
        no tier holds misses later. Buffers are handed back (``on_done``)."""
        n = len(self._staged)
        self._repairs.clear()  # re-made when the chunks are next read
        while self._staged:
            self._drop(self._staged.popleft())
        for q in self._queues:
            while q:
                self._copy_done(q.popleft())
        return n

    def _drop(self, chunk: StagedChunk) -> None:
        self.dropped += 1
        self._end(chunk)

    def _start(self, chunk: StagedChunk) -> None:
        plen = chunk.payload_len
        xxh = fmt.payload_checksum(payload_views(chunk.buf, plen))
        chunk.hdr = self._slab.get()
        chunk.header = fmt.Header(plen, xxh, chunk.meta)
        fmt.encode_header(chunk.hdr[1], chunk.digest, plen, xxh, chunk.meta)
        chunk.segs = segments(chunk.buf, plen)
        padded = fmt.padded(plen)
        if len(chunk.segs) == 1 and chunk.buf.capacity >= padded:
            chunk.segs = [(chunk.segs[0][0], padded)]  # writes the buffer's slack as padding
        for ti, rt in enumerate(self._tiers):
            if not rt.tier.up or rt.tier.has(chunk.digest):
                continue  # every healthy tier that lacks the chunk gets it
            self._queues[ti].append(chunk)
            chunk.pending += 1
        if chunk.pending == 0:
            if not any(rt.tier.up and rt.tier.has(chunk.digest) for rt in self._tiers):
                self.failed += 1
            self._end(chunk)

    def _issue(self, ti: int, chunk: StagedChunk) -> None:
        rt = self._tiers[ti]
        if not rt.tier.up:
            self._copy_done(chunk)
            return
        assert chunk.hdr is not None and chunk.header is not None
        rt.io.write(WriteJob(ti, chunk, chunk.digest, chunk.hdr[0], chunk.segs, chunk.header))
        self._inflight[ti] += 1

    def _copy_done(self, chunk: StagedChunk) -> None:
        chunk.pending -= 1
        if chunk.pending == 0:
            if not chunk.published:
                self.failed += 1
            self._end(chunk)

    def finished(self, job: WriteJob) -> None:
        chunk: StagedChunk = job.chunk  # type: ignore[assignment]
        rt = self._tiers[job.tier]
        self._inflight[job.tier] -= 1
        if job.ok:
            rt.meter.write_bytes += job.moved
        elif job.errno:
            rt.meter.error(files.errname(job.errno))
            if job.errno != errno.EFAULT:  # EFAULT is the buffer's fault, never the tier's
                self._tier_down(job.tier, f"write: {os.strerror(job.errno)}")
        if job.ok and not chunk.published:
            chunk.published = True
            self.published += 1
            if chunk.on_published is not None:
                call_safely(chunk.on_published, chunk.key)
        self._copy_done(chunk)

    def _end(self, chunk: StagedChunk) -> None:
        if chunk.hdr is not None:
            self._slab.put(chunk.hdr)
        with self._lock:
            self._writing.discard(chunk.digest)
            self.held_bytes -= chunk.payload_len
        if chunk.on_done is not None:
            call_safely(chunk.on_done)
