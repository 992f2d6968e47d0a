"""The read state machine: handles -> router ids -> claims -> tier jobs -> verified delivery.

Runs on the completion loop. It owns the router, the unresolved handles and the buffers of
reads in flight; the tier workers do the file-system calls and the verification. One thing is
asked from other threads: whether a chunk is being read (:meth:`ReadPool.being_read`, by tier
workers making room); that count is kept under its own lock. Everything else is the loop's.

Buffer rules (see :mod:`kvstream_backend.handles`): a read job owns the buffer it reads into
until it comes back. A job whose chunk was already resolved (a hedge lost, the handle was
discarded) releases its buffer; a failed primary read leaves the handle's own buffer for the next
attempt; a miss releases the handle's own buffer unless a read into it is still in flight.

Lookup-time reads: a chunk a lookup registered gets its buffer when a tier claims it, not when
it is registered, and such buffers not yet demanded by a get are bounded by
``prefetch_max_gb``; past it, or when an allocation fails, tiers claim only chunks a get waits
for, and the others wait their turn. How long a lookup's reads are kept is the engine's lookup
table's business (:mod:`kvstream_backend.engine.lookups`).
"""

from __future__ import annotations

import collections
import errno
import os
import threading
from collections.abc import Callable, Iterable

from ..config import KVStreamConfig
from ..handles import ReadHandle
from ..io import files
from ..io.memory import SlabPool
from ..policy.routing import ClaimRouter, StaticSplitRouter
from ..tiers.accounting import StepMeter
from ..tiers.jobs import ReadJob
from ..tiers.runtime import TierRuntime

ALLOC_RETRY_S = 0.02
NOT_THE_TIER = frozenset({errno.EAGAIN, errno.EFAULT})


class ReadPool:
    def __init__(self, cfg: KVStreamConfig, tiers: list[TierRuntime], slab: SlabPool,
                 steps: StepMeter, tier_down: Callable[[int, str], None],
                 served: Callable[[bytes, int], None]) -> None:
        self._cfg = cfg
        self._tiers = tiers
        self._slab = slab
        self._steps = steps
        self._tier_down = tier_down
        self._served = served  # (digest, tier) of every delivered chunk: replication upkeep
        window = None if cfg.read_window == "auto" else cfg.read_window
        target_s, most = cfg.read_target_ms / 1000, cfg.read_queue_depth
        self.router = (
            ClaimRouter(len(tiers), cfg.claim_batch, hedge=cfg.hedge, window=window,
                        target_s=target_s, max_window=most)
            if cfg.static_split is None
            else StaticSplitRouter(len(tiers), cfg.claim_batch, cfg.static_split,
                                   window=window, target_s=target_s, max_window=most)
        )
        self._handles: dict[int, ReadHandle] = {}  # unresolved, by router id
        self._primary_busy: set[int] = set()  # ids whose own buffer is under a read
        self._undemanded: dict[int, ReadHandle] = {}  # prefetches (resolved or not)
        self._held: dict[int, int] = {}  # prefetch buffers allocated, not yet demanded: bytes
        self._held_bytes = 0
        self._prefetch_max = int(cfg.prefetch_max_gb * (1 << 30))
        self._alloc_retry_at = 0.0
        # digest -> unresolved handles (never evicted): written by the loop, read by tier
        # workers, under _reading_lock
        self._reading: dict[bytes, int] = {}
        self._reading_lock = threading.Lock()
        self.chunks_read = 0
        self.misses: collections.Counter[str] = collections.Counter()
        self.prefetch_hits = 0  # demanded chunks whose prefetch had already landed
        self.prefetch_dropped = 0  # prefetches given up (released, expired, cancelled)

    def being_read(self, digest: bytes) -> bool:
        """Whether a read of ``digest`` is unresolved (any thread)."""
        with self._reading_lock:
            return digest in self._reading

    # ---- commands from the engine's API -------------------------------------------------
    def admit(self, handles: Iterable[ReadHandle], now: float) -> None:
        for h in handles:
            d = h.info.digest
            holders = [i for i, rt in enumerate(self._tiers) if rt.tier.up and rt.tier.has(d)]
            rid = self.router.add(holders, h.info.payload_len, lookup=not h.demanded)
            h.rid = rid
            self._handles[rid] = h
            with self._reading_lock:
                self._reading[d] = self._reading.get(d, 0) + 1
            if h.demanded:
                self._steps.opened(now)
                self._steps.joined()
            else:
                self._undemanded[rid] = h
            if not holders:
                self.router.cancel(rid)
                self._resolve(rid, None, "no-tier", now)

    def demand(self, handles: Iterable[ReadHandle], now: float) -> None:
        """Promote prefetches a get now waits for into the step's pool."""
        for h in handles:
            if h.demanded or h.abandoned:
                continue
            h.demanded = True
            self._undemanded.pop(h.rid, None)
            self._unhold(h.rid)
            if h.rid in self._handles:
                self._steps.opened(now)
                self._steps.joined()
                self.router.demand(h.rid)
            else:
                self.prefetch_hits += h.result is not None

    def cancel(self, h: ReadHandle, now: float) -> None:
        """``h`` was discarded: drop it from the pool (a pending read's buffer comes back later)."""
        rid = h.rid
        self._unhold(rid)
        if self._undemanded.pop(rid, None) is not None:
            self.prefetch_dropped += 1
        if rid in self._handles:
            self.router.cancel(rid)
            self._resolve(rid, None, "abandoned" if h.demanded else "", now)

    # ---- claims ---------------------------------------------------------------------------
    def dispatch(self, now: float) -> None:
        """Let every healthy tier with room claim (demanded first, then prefetches)."""
        for ti, rt in enumerate(self._tiers):
            if not rt.tier.up:
                continue
            while self.router.has_room(ti):
                ahead = self._held_bytes < self._prefetch_max and now >= self._alloc_retry_at
                rids = self.router.claim(ti, now, ahead=ahead)
                if not rids:
                    break
                if not all([self._start(ti, rid, now) for rid in rids]):
                    break

    def _start(self, ti: int, rid: int, now: float) -> bool:
        """Issue tier ``ti``'s read of chunk ``rid``; False if it had to be given back."""
        rt, h = self._tiers[ti], self._handles[rid]
        plen = h.info.payload_len
        primary = rid not in self._primary_busy
        buf = h.buffer if primary else None
        if buf is None and not h.demanded and self._held_bytes + plen > self._prefetch_max:
            self.router.abandon(ti, rid)  # the prefetch memory bound is reached
            return False
        if buf is None:
            buf = h.alloc(plen) if h.alloc is not None else None
            if buf is None:
                self.router.abandon(ti, rid)
                if primary and h.demanded:
                    self.router.cancel(rid)
                    self._resolve(rid, None, "no-memory", now)
                elif primary:
                    self._alloc_retry_at = now + ALLOC_RETRY_S
                return False
            if primary:
                h.buffer = buf
                if not h.demanded:
                    self._hold(rid, plen)
        if buf.capacity < plen:  # (an unaligned one is bounced by the tier worker)
            if not primary:
                buf.release()
                self.router.abandon(ti, rid)
                return False
            rt.meter.error("small-buffer")
            if self.router.fail(ti, rid):
                self._resolve(rid, None, "small-buffer", now)
            return True
        if primary:
            self._primary_busy.add(rid)
        rt.meter.started(now)
        rt.io.read(ReadJob(ti, rid, h, buf, primary, self._slab.get(), now))
        return True

    # ---- completions ----------------------------------------------------------------------
    def finished(self, job: ReadJob, now: float) -> None:
        rt, rid = self._tiers[job.tier], job.rid
        self._slab.put(job.hdr)
        rt.meter.ended(now, job.moved, hedge=not job.primary, started_at=job.t_start)
        if job.primary:
            self._primary_busy.discard(rid)
        won = dead = False
        why = job.reason or (files.errname(job.errno) if job.errno else "lost")
        if job.ok:
            won = self.router.complete(job.tier, rid, now)
            if not won:  # a good copy, beaten by another tier's (a hedge's loser)
                rt.meter.lost += 1
        else:
            rt.meter.error(why)
            # a bad copy was quarantined by the worker: the other tiers may hold good ones
            # EFAULT is the buffer's fault (memory the caller freed), never the tier's
            if not job.reason and job.errno not in files.FILE_LEVEL_ERRNOS | NOT_THE_TIER:
                self._tier_down(job.tier, f"read: {os.strerror(job.errno)}")
            dead = self.router.fail(job.tier, rid)
        h = self._handles.get(rid)
        if h is None:  # resolved already: a hedge lost, or the handle was discarded
            job.buf.release()
            return
        if won:
            rt.meter.chunks += 1
            for other in self._tiers:  # recency on every tier holding it, not only this one
                other.tier.touch(h.info.digest)
            self._served(h.info.digest, job.tier)
            if job.primary:
                h.buffer = None  # delivered below
            elif rid not in self._primary_busy and h.buffer is not None:
                h.buffer.release()  # a hedge won while the request's own buffer sat idle
                h.buffer = None
            self._resolve(rid, job.buf, "", now)
            return
        if not job.primary:
            job.buf.release()
        if dead:
            self._resolve(rid, None, why, now)

    def _resolve(self, rid: int, buf: object, reason: str, now: float) -> None:
        h = self._handles.pop(rid)
        d = h.info.digest
        with self._reading_lock:
            left = self._reading[d] - 1
            if left:
                self._reading[d] = left
            else:
                del self._reading[d]
        if buf is None:
            self._unhold(rid)
            self._undemanded.pop(rid, None)
            if h.buffer is not None and rid not in self._primary_busy:
                h.buffer.release()
                h.buffer = None
            if reason:
                self.misses[reason] += 1
            if h.demanded:
                self._steps.missed(now)
        else:
            self.chunks_read += 1
            if h.demanded:
                self._steps.delivered(h.info.payload_len, now)
        h.deliver(buf, reason)  # type: ignore[arg-type]

    def drop_tier(self, ti: int, now: float) -> None:
        for rid in self.router.drop_tier(ti):
            self._resolve(rid, None, "tier-down", now)

    # ---- prefetch memory ----------------------------------------------------------------
    def _hold(self, rid: int, n: int) -> None:
        self._held[rid] = n
        self._held_bytes += n

    def _unhold(self, rid: int) -> None:
        self._held_bytes -= self._held.pop(rid, 0)

    @property
    def held_bytes(self) -> int:
        return self._held_bytes
