"""The KVStream engine: a thin facade over the read pool, the writer and the tier workers, and
the one completion loop that drives them.

Threads: callers (LMCache's lookup, forward and event-loop threads) only post commands and wait
on handles. One thread, ``kvstream-io``, owns the router, the pool and the staging queue, so
none of that state needs a lock; it never touches a file system. Each tier has its own worker
thread (:mod:`kvstream_backend.tiers.worker`) that does that tier's opens, submissions, closes,
publishing and verification, so no tier's slowness stalls another's reads.

Who owns what crosses threads (nothing else does, and nothing relies on the GIL):

* Commands and finished jobs into the loop, and what each turn leaves for waiters:
  :class:`~kvstream_backend.engine.loop.CompletionLoop` (its docstring says how).
* The lookup table (:class:`~kvstream_backend.engine.lookups.Lookups`), the writer's set of chunks
  being written and the read pool's count of chunks being read: each under its own lock,
  asked by callers and by tier workers making room (``_evictable``).
* Tier indexes: :class:`~kvstream_backend.tiers.tier.Tier` (its own lock). A tier's health
  (``up``, ``down_reason``) is written on the loop only, by
  :class:`~kvstream_backend.tiers.runtime.Health`, and read anywhere as single attribute loads.

Call protocol (keys are the adapters' key strings; an *owner* names a lookup, see
:mod:`kvstream_backend.engine.lookups`):

* ``lookup(key)`` -> :class:`ChunkInfo` or None (index, then the file system for chunks another
  process published).
* ``lookup_and_pin(owner, keys, read=...)`` pins, then looks up, each key for ``owner`` (so
  nothing evicts it in between; a miss is unpinned). With ``read`` the hits are read at once,
  as the open pool of the next step (:mod:`kvstream_backend.policy.routing`), and held for the owner
  until a get takes them (``take``), the owner releases them (``release``), or their
  time-to-live passes.
* ``read(requests)`` returns one :class:`ReadHandle` per :class:`ReadRequest`, immediately: the
  chunks a get waits for (``take`` hands over a lookup's handle, ``demand`` marks it waited
  for). Buffer ownership: see :mod:`kvstream_backend.handles`.
* ``write(...)`` stages a chunk and returns at once (False if the key is already being
  written); see :mod:`kvstream_backend.engine.writer`.
* ``close()`` drains staged writes (bounded) and stops the loop and the workers.
"""

from __future__ import annotations

import collections
import logging
import threading
import time
from collections.abc import Callable, Iterator, Sequence

import msgspec

from .. import format as fmt
from ..config import KVStreamConfig
from ..handles import Alloc, Buffer, ChunkInfo, ReadHandle, ReadRequest, payload_view
from ..io import files
from ..io.memory import SlabPool
from ..io.probe import QueueFactory, make_queue
from ..io.threads import Workers
from ..stats import EngineStats, StepReport
from ..tiers import rates
from ..tiers.accounting import StepMeter
from ..tiers.jobs import Job, ReadJob, WriteJob
from ..tiers.runtime import Health, TierRuntime, open_tier, tier_infos
from ..tiers.tier import Tier
from .lookups import Lookups, Owner
from .loop import CompletionLoop, Settled
from .readpool import ReadPool
from .writer import Writer

__all__ = ["Alloc", "Buffer", "ChunkInfo", "Engine", "ReadHandle", "ReadRequest", "payload_view"]

log = logging.getLogger("kvstream")

IO_DRAIN_S = 120.0  # how long close waits for reads and writes already issued
MEMO_SAVE_S = 5.0  # how long close waits for the read-rate memos to be written


class Engine:
    def __init__(self, cfg: KVStreamConfig, *, clock: Callable[[], float] = time.monotonic,
                 queue_factory: QueueFactory = make_queue) -> None:
        self.cfg = cfg
        self._clock = clock
        self._lookups = Lookups()
        self._expired = 0  # lookup-time reads released because their time-to-live passed
        self._tiers: list[TierRuntime] = []
        self._verify = Workers(cfg.verify_workers, "kvstream-verify")
        try:
            for i, tc in enumerate(cfg.tiers):
                self._tiers.append(open_tier(i, tc, cfg, queue_factory, self._job_done,
                                             self._evictable, self._verify))
        except BaseException:
            for rt in self._tiers:
                if rt.worker is not None:
                    rt.worker.close()
            self._verify.shutdown()
            raise
        self._slab = SlabPool()
        self._steps = StepMeter([rt.meter for rt in self._tiers])
        self.steps: collections.deque[StepReport] = self._steps.reports
        self._health = Health(self._tiers, cfg, clock, self._post,
                              on_down=lambda ti, now: self._reads.drop_tier(ti, now),
                              on_up=self._warm_if_asked)
        self._writer = Writer(cfg, self._tiers, self._slab, self._steps, self._health.down)
        self._reads = ReadPool(cfg, self._tiers, self._slab, self._steps, self._health.down,
                               self._writer.served)
        if cfg.remember_rates:
            self._recall_rates()
        self._stopping = False
        self._loop: CompletionLoop[Job] = CompletionLoop(self._turn, clock, self._next_wake_ms,
                                                         self._busy)
        self._loop.start()
        self._warmer: threading.Thread | None = None
        if cfg.warm_headers:
            self._warm()

    # ------------------------------------------------------------------------------------
    # public API (any thread)
    @property
    def tiers(self) -> list[Tier]:
        """The tiers, for introspection (tests, soak, CLI); adapters use the methods below."""
        return [rt.tier for rt in self._tiers]

    def lookup(self, key: str) -> ChunkInfo | None:
        """The chunk's size and metadata if any healthy tier has a valid copy."""
        return self._lookup(key, fmt.key_digest(key))

    def _lookup(self, key: str, digest: bytes) -> ChunkInfo | None:
        for rt in self._tiers:
            if not rt.tier.up:
                continue
            entry = rt.tier.get(digest)
            if entry is None:
                continue
            header = rt.tier.load_header(digest, entry, self.cfg.max_chunk_bytes)
            if header is not None:
                return ChunkInfo(key, digest, header.payload_len, header.meta)
        return None

    def stored_everywhere(self, key: str) -> bool:
        """True if every healthy tier's index has the chunk (memory only: no I/O)."""
        digest = fmt.key_digest(key)
        up = [rt for rt in self._tiers if rt.tier.up]
        return bool(up) and all(rt.tier.has(digest) for rt in up)

    def lookup_and_pin(
        self, owner: Owner, keys: Sequence[str], *, prefix: bool = True,
        expires: bool = True, read: Callable[[ChunkInfo], Alloc | None] | None = None,
    ) -> list[ChunkInfo | None]:
        """Pin, then look up, each key for ``owner``; a miss is unpinned. ``prefix``: stop at
        the first miss (the result is the leading run of hits). ``expires``: pins and reads
        not released within ``prefetch_timeout_s`` are released then (False: held until
        released). ``read(info)`` gives the allocator of a hit's lookup-time read (None: that
        hit is not read); a key the owner already holds a read of is not read twice."""
        deadline = (self._clock() + self.cfg.prefetch_timeout_s) if expires else float("inf")
        out: list[ChunkInfo | None] = []
        reqs: list[ReadRequest] = []
        for key in keys:
            digest = fmt.key_digest(key)
            self._lookups.pin(owner, digest, deadline)
            info = self._lookup(key, digest)
            if info is None:
                self._lookups.release(owner, [digest])
                if prefix:
                    break
            elif read is not None and not self._lookups.holds_read(owner, digest):
                alloc = read(info)
                if alloc is not None:
                    reqs.append(ReadRequest(info, None, alloc))
            out.append(info)
        for h in self._admit(reqs, demanded=False):
            if not self._lookups.attach(owner, h.info.digest, h):
                h.discard()  # the same key twice in one lookup, or released meanwhile
        return out

    def take(self, owner: Owner, key: str) -> ReadHandle | None:
        """Hand ``owner``'s lookup-time read of ``key`` over to a get (None if it holds none);
        the caller passes it to ``demand``. The pin stays until ``release``."""
        return self._lookups.take(owner, fmt.key_digest(key))

    def release(self, owner: Owner, keys: Sequence[str] | None = None) -> int:
        """Drop one of ``owner``'s pins per key (every pin of the owner's if None) and, with a
        key's last pin, its lookup-time read not taken. Returns the pins dropped."""
        digests = None if keys is None else [fmt.key_digest(k) for k in keys]
        dropped, handles = self._lookups.release(owner, digests)
        for h in handles:
            h.discard()
        return dropped

    def pinned(self) -> int:
        """Chunks pinned now (for leak checks)."""
        return len(self._lookups)

    def read(self, requests: Sequence[ReadRequest]) -> list[ReadHandle]:
        """Read chunks a get waits for, as part of the step being served."""
        return self._admit(requests, demanded=True)

    def _admit(self, requests: Sequence[ReadRequest], demanded: bool) -> list[ReadHandle]:
        handles = [ReadHandle(r, demanded, self._discarded) for r in requests]
        if handles:
            self._post(lambda now: self._reads.admit(handles, now))
        return handles

    def demand(self, handles: Sequence[ReadHandle]) -> None:
        """A get now waits for these lookup-time reads: their pool is the step served."""
        hs = list(handles)
        if hs:
            self._post(lambda now: self._reads.demand(hs, now))

    def _discarded(self, h: ReadHandle) -> None:
        self._post(lambda now: self._reads.cancel(h, now))

    def write(
        self,
        key: str,
        buf: Buffer,
        payload_len: int,
        meta: bytes,
        on_published: Callable[[str], None] | None = None,
        on_done: Callable[[], None] | None = None,
    ) -> bool:
        """Stage ``payload_len`` bytes at ``buf`` for every tier; returns at once.

        ``buf`` must stay valid until ``on_done`` runs. False (nothing staged, no callback) if
        the key is already being written or the engine is closing.
        """
        chunk = self._writer.stage(key, fmt.key_digest(key), buf, payload_len, meta,
                                   on_published, on_done)
        if chunk is None:
            return False
        self._post(lambda now: self._writer.enqueue(chunk))
        return True

    def writing(self, key: str) -> bool:
        return self._writer.writing(fmt.key_digest(key))

    def remove(self, key: str) -> bool:
        """Delete the chunk from every tier; a lookup-time read of it is dropped."""
        return self._remove(fmt.key_digest(key)) > 0

    def clear(self) -> int:
        """Delete every chunk from every tier (their lookup-time reads are dropped); returns
        the copies removed."""
        digests = set().union(*(rt.tier.digests() for rt in self._tiers))
        return sum(self._remove(d) for d in digests)

    def _remove(self, digest: bytes) -> int:
        """Drop the chunk's lookup-time reads and delete it from every tier (no short cut);
        returns the copies removed."""
        for h in self._lookups.drop_reads(digest):
            h.discard()
        return sum(rt.tier.remove(digest) for rt in self._tiers)

    def usage(self) -> int:
        """Bytes stored on the fullest tier (each tier holds a replica of everything)."""
        return max((rt.tier.used for rt in self._tiers), default=0)

    def _warm(self) -> None:
        """Load the headers of indexed chunks in the background (most recent first), so that
        lookups after a restart answer from memory instead of reading the disk."""

        def run() -> None:
            for rt in self._tiers:
                for digest, entry in rt.tier.cold():
                    if self._stopping or not rt.tier.up:
                        break
                    rt.tier.load_header(digest, entry, self.cfg.max_chunk_bytes)

        self._warmer = threading.Thread(target=run, name="kvstream-warm", daemon=True)
        self._warmer.start()

    def wait_warm(self, timeout: float | None = None) -> bool:
        """Wait until the start-up header warm-up is done; False on timeout."""
        if self._warmer is not None:
            self._warmer.join(timeout)
            return not self._warmer.is_alive()
        return True

    def flush(self, timeout: float | None = None) -> bool:
        """Wait until every staged write and queued repair is finished; False on timeout."""
        return self._loop.wait(
            lambda st, _: st.repairs_idle and not self._writer.writing_any(), timeout)

    def wait_idle(self, timeout: float | None = None) -> bool:
        """Wait until no write and no read (hedge losers included) is outstanding."""

        def idle(st: Settled, caught_up: bool) -> bool:
            return (caught_up and st.reads_idle and st.repairs_idle
                    and not self._writer.writing_any())

        return self._loop.wait(idle, timeout)

    def close(self, timeout: float | None = None) -> None:
        """Drain staged writes for up to ``timeout`` (default ``close_timeout_s``), drop the
        ones not issued by then, wait for every read and write already issued, and stop.

        When it returns, no I/O touches a caller's buffer any more: a chunk is either
        published whole or not at all (a later miss). Idempotent.
        """
        if not self._loop.alive:
            return
        timeout = self.cfg.close_timeout_s if timeout is None else timeout
        for h in self._lookups.clear():  # nobody will take them: their buffers come back
            h.discard()
        if not self.flush(timeout):
            log.warning("kvstream: closing with staged writes left after %.0f s", timeout)
        self._writer.stop()
        self._stopping = self._health.stopping = True
        self._post(lambda now: self._drop_staged())
        self._loop.stop()
        if not self._loop.join(IO_DRAIN_S):
            log.error("kvstream: I/O still in flight %.0f s after close; a tier is hung",
                      IO_DRAIN_S)
            return
        for rt in self._tiers:
            if rt.worker is not None:
                rt.worker.close(IO_DRAIN_S)
        self._verify.shutdown()
        if self.cfg.remember_rates:
            self._remember_rates()
        if self.cfg.stats_file:
            self._write_stats(self.cfg.stats_file)

    def _recall_rates(self) -> None:
        """Seed the router with each tier's rate as this host's last engine measured it (before
        the loop starts: the router is the loop's once it runs)."""
        for ti, rt in enumerate(self._tiers):
            if rt.tier.up and (memo := rates.load(rt.tier.base, rt.setup)) is not None:
                self._reads.router.seed(ti, memo.read_bps, memo.chunk_bytes)

    def _remember_rates(self) -> None:
        """Save the router's estimates for the next engine (the loop has stopped). On a thread
        of its own, waited for at most ``MEMO_SAVE_S``: a mount that died since its last read
        must not hold the close."""
        memos = [(rt.tier.base, rates.RateMemo(est[0], est[1], rt.setup, time.time()))
                 for ti, rt in enumerate(self._tiers)
                 if rt.tier.up and (est := self._reads.router.estimate(ti)) is not None]
        if not memos:
            return

        def run() -> None:
            for base, memo in memos:
                rates.save(base, memo, self.cfg.dir_mode, self.cfg.file_mode)

        t = threading.Thread(target=run, name="kvstream-rates", daemon=True)
        t.start()
        t.join(MEMO_SAVE_S)

    def _write_stats(self, path: str) -> None:
        """The final counters as JSON (written to a temp name, then renamed into place), for
        whoever cannot ask the process: a vLLM worker process, a supervisor after SIGTERM."""
        try:
            files.replace_whole(path, msgspec.json.encode(self.stats()), 0o666)
        except OSError as e:
            log.error("kvstream: cannot write stats_file %s: %s", path, e)

    def _drop_staged(self) -> None:
        n = self._writer.drop_staged()
        if n:
            log.warning("kvstream: dropped %d staged chunks at close (never written; LMCache "
                        "recomputes them)", n)

    def stats(self) -> EngineStats:
        r, w = self._reads, self._writer
        return EngineStats(
            tier_infos(self._tiers, self._clock()), self._steps.closed, r.chunks_read,
            dict(r.misses), w.staged_total, w.published, w.failed, w.overlap_bytes,
            sum(rt.meter.hedged_bytes for rt in self._tiers),
            r.prefetch_hits, r.prefetch_dropped, self._expired, r.held_bytes, w.dropped,
            w.shed, w.held_bytes,
        )

    # ------------------------------------------------------------------------------------
    # the completion loop's turn (thread kvstream-io; see :mod:`kvstream_backend.engine.loop`)
    def _post(self, cmd: Callable[[float], None]) -> None:
        self._loop.post(cmd)

    def _job_done(self, job: Job) -> None:
        """Called by tier workers: hand a finished job to the loop."""
        self._loop.deliver(job)

    def _evictable(self, digest: bytes) -> bool:
        """Called by tier workers while they make room: neither being read nor pinned (both
        asked under their owners' locks)."""
        return not self._reads.being_read(digest) and not self._lookups.pinned(digest)

    def _next_wake_ms(self) -> int:
        """How long the loop may sleep: until the next lookup expires or a tier reading would be
        stalled (so that the others claim and hedge its chunks), and at most a second while a
        tier is down (its re-probe) or writes are outstanding."""
        now = self._clock()
        due = [t for t in (self._lookups.next_deadline(), self._reads.router.next_stall(now))
               if t is not None]
        timeout_ms = max(0, int((min(due) - now) * 1000) + 1) if due else -1
        if not self._health.all_up() or self._writer.busy:
            timeout_ms = 1000 if timeout_ms < 0 else min(timeout_ms, 1000)
        return timeout_ms

    def _busy(self) -> bool:
        return self._writer.busy or self._reads.router.busy()

    def _turn(self, now: float, jobs: Iterator[Job]) -> tuple[bool, bool]:
        for job in jobs:
            if isinstance(job, ReadJob):
                self._reads.finished(job, now)
            elif isinstance(job, WriteJob):
                self._writer.finished(job)
            else:
                self._writer.repaired(job)
        for h in self._lookups.expire(now):
            self._expired += 1
            h.discard()  # posts cancel(), run on the next turn
        self._reads.dispatch(now)
        router = self._reads.router
        self._writer.pump(reads_busy=router.busy())
        if self._steps.open and router.step_done():
            self._steps.close(now)
        self._health.reprobe(now)
        return not router.busy(), self._writer.repairs_idle()

    def _warm_if_asked(self) -> None:
        if self.cfg.warm_headers:
            self._warm()
