"""The KVStream engine: one read pool, one completion loop, a deferred replicated writer.

Threads: callers (LMCache's lookup, forward and event-loop threads) only post commands and wait
on per-chunk handles; a single thread, ``kvstream-io``, owns the router, the rings, the pool and
the staging queue, so none of that state needs a lock. Ring/queue submission, completion,
verification, publishing and accounting all happen there.

Call protocol:

* ``lookup(key)`` -> :class:`ChunkInfo` or None (index, then the file system for chunks another
  process published). ``pin``/``unpin`` protect a chunk from eviction on every tier.
* ``read(requests)`` admits chunks to the current pool and returns one :class:`ReadHandle` per
  request, immediately. The engine owns each request's buffer from then on: a handle delivers a
  buffer with the verified payload (possibly a hedge's buffer) or None (miss) and the engine has
  released every other buffer. ``handle.wait(timeout)`` blocks; ``handle.discard()`` gives up.
* ``write(...)`` stages a chunk and returns at once (False if the key is already being written);
  staged chunks are written to every healthy tier while no read is outstanding, or anyway once
  the staging budget is exceeded (counted as write-during-read overlap). ``on_published(key)``
  fires when the first copy is visible, ``on_done()`` when every copy is finished.
* ``close()`` drains staged writes and stops the loop.
"""

from __future__ import annotations

import collections
import ctypes
import errno
import heapq
import logging
import os
import select
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Protocol

from . import format as fmt
from .config import KVStreamConfig
from .emulate import Throttle
from .io import files
from .io.memory import SlabPool
from .io.ops import IoOp, IoQueue, Waker
from .io.probe import IoPath, make_queue, probe
from .routing import DEAD, DONE, ClaimRouter, StaticSplitRouter
from .stats import EngineStats, StepReport, TierInfo, TierStep
from .tier import Tier

log = logging.getLogger("kvstream")


class Buffer(Protocol):
    """Memory a chunk is read into or written from: ``capacity`` bytes at ``addr``."""

    addr: int
    capacity: int

    def release(self) -> None: ...


Alloc = Callable[[int], "Buffer | None"]


@dataclass(frozen=True)
class ChunkInfo:
    digest: bytes
    payload_len: int
    meta: bytes


def payload_view(addr: int, n: int) -> memoryview:
    """A temporary read-only view of ``n`` bytes at ``addr`` (for checksums)."""
    return memoryview((ctypes.c_ubyte * n).from_address(addr)).cast("B")


_PENDING, _DONE, _ABANDONED = 0, 1, 2


class ReadHandle:
    """Completion of one pooled chunk read; safe to wait on from any thread."""

    __slots__ = (
        "key", "info", "buffer", "alloc", "result", "reason", "_state", "_lock", "_event",
        "_callbacks",
    )

    def __init__(self, key: str, info: ChunkInfo, buffer: Buffer, alloc: Alloc | None) -> None:
        self.key = key
        self.info = info
        self.buffer = buffer  # the request's own buffer; owned by the engine until delivery
        self.alloc = alloc  # extra buffers for hedged reads (None: no hedging for this chunk)
        self.result: Buffer | None = None
        self.reason = ""
        self._state = _PENDING
        self._lock = threading.Lock()
        self._event = threading.Event()
        self._callbacks: list[Callable[[ReadHandle], None]] = []

    def add_done_callback(self, fn: Callable[[ReadHandle], None]) -> None:
        """Call ``fn(handle)`` once the chunk is delivered (at once if it already is).

        Callbacks run on the completion loop and must only hand off (e.g. to an event loop).
        """
        with self._lock:
            if self._state == _PENDING:
                self._callbacks.append(fn)
                return
        fn(self)

    def done(self) -> bool:
        return self._event.is_set()

    def wait(self, timeout: float | None = None) -> Buffer | None:
        """The verified buffer, or None on a miss or when ``timeout`` passes (then abandoned)."""
        if self._event.wait(timeout):
            return self.result
        with self._lock:
            if self._state == _DONE:
                return self.result
            self._state = _ABANDONED
            self.reason = "timeout"
        return None

    def discard(self) -> None:
        """Give the chunk up; its buffer is released now or when its read ends."""
        with self._lock:
            if self._state == _DONE and self.result is not None:
                self.result.release()
                self.result = None
            self._state = _ABANDONED
            callbacks, self._callbacks = self._callbacks, []
        for fn in callbacks:
            _safe(fn, self)

    def _deliver(self, buf: Buffer | None, reason: str = "") -> None:
        with self._lock:
            if self._state == _ABANDONED:
                if buf is not None:
                    buf.release()
                return
            self.result = buf
            self.reason = reason
            self._state = _DONE
            callbacks, self._callbacks = self._callbacks, []
        self._event.set()
        for fn in callbacks:
            _safe(fn, self)


@dataclass
class _Chunk:
    handle: ReadHandle
    primary_free: bool = True  # the handle's own buffer is not under an attempt


@dataclass
class _ReadAttempt:
    idx: int
    tier: int
    buf: Buffer
    primary: bool
    hedge: bool
    hdr: tuple[int, memoryview]


@dataclass
class _WriteJob:
    key: str
    digest: bytes
    buf: Buffer
    payload_len: int
    meta: bytes
    on_published: Callable[[str], None] | None
    on_done: Callable[[], None] | None
    hdr: tuple[int, memoryview] | None = None
    header: fmt.Header | None = None
    pending: int = 0
    published: bool = False


@dataclass
class _WriteAttempt:
    job: _WriteJob
    tier: int
    tmp: str
    size: int


class _TierRuntime:
    """A tier plus its mechanism: queues, I/O path, emulation and busy-time accounting."""

    def __init__(self, tier: Tier, path: IoPath, rq: IoQueue, wq: IoQueue,
                 rthrottle: Throttle | None, wthrottle: Throttle | None, dev: int) -> None:
        self.tier = tier
        self.path = path
        self.rq = rq
        self.wq = wq
        self.rthrottle = rthrottle
        self.wthrottle = wthrottle
        self.dev = dev
        self.reads_inflight = 0
        self.busy_since = 0.0
        self.read_bytes = 0
        self.write_bytes = 0
        self.errors: collections.Counter[str] = collections.Counter()
        self.next_probe = 0.0
        self.probing = False
        self.step = TierStep(tier.name)


def _errname(code: int) -> str:
    return errno.errorcode.get(code, f"errno{code}")


class Engine:
    def __init__(self, cfg: KVStreamConfig, *, clock: Callable[[], float] = time.monotonic):
        self.cfg = cfg
        self._clock = clock
        self._waker = Waker()
        self._tiers: list[_TierRuntime] = []
        try:
            for i, tc in enumerate(cfg.tiers):
                self._tiers.append(self._open_tier(i, tc))
        except BaseException:
            self._close_queues()
            self._waker.close()
            raise
        self._router = (
            ClaimRouter(len(self._tiers), cfg.claim_batch, cfg.hedge)
            if cfg.static_split is None
            else StaticSplitRouter(len(self._tiers), cfg.claim_batch, cfg.static_split)
        )
        self._chunks: list[_Chunk] = []
        self._slab = SlabPool()
        self._cmds: collections.deque[Callable[[], None]] = collections.deque()
        self._delayed: list[tuple[float, int, Callable[[], None]]] = []
        self._seq = 0
        self._pins: collections.Counter[bytes] = collections.Counter()
        self._reading: collections.Counter[bytes] = collections.Counter()
        self._wlock = threading.Lock()
        self._writing: set[bytes] = set()
        self._staged: collections.deque[_WriteJob] = collections.deque()
        self._staged_bytes = 0
        self._writes_inflight = 0
        self._idle = threading.Condition()
        # step accounting
        self._step_t0 = 0.0
        self._step_last = 0.0
        self._step_bytes = 0
        self._step_misses = 0
        self._step_overlap = 0
        self.steps: collections.deque[StepReport] = collections.deque(maxlen=1024)
        self._n_steps = 0
        self._chunks_read = 0
        self._misses: collections.Counter[str] = collections.Counter()
        self._writes_staged = 0
        self._writes_published = 0
        self._writes_failed = 0
        self._overlap_total = 0
        self._hedged_total = 0
        self._stopping = False
        self._reads_quiet = True  # written by the loop: no chunk unresolved, no read in flight
        self._thread = threading.Thread(target=self._loop, name="kvstream-io", daemon=True)
        self._thread.start()
        self._warmer: threading.Thread | None = None
        if cfg.warm_headers:
            self._warm()

    # ------------------------------------------------------------------------------------
    # construction
    def _open_tier(self, i: int, tc) -> _TierRuntime:
        c = self.cfg
        tier = Tier(tc, file_mode=c.file_mode, dir_mode=c.dir_mode, negative_ms=c.negative_cache_ms)
        tier.open()
        path = probe(tier.tmp_dir, tc.io, tc.direct, c.file_mode)
        tier.direct = path.direct
        log.info(
            "kvstream tier %s (%s): io=%s direct=%s (%s)%s", tc.name, tier.root, path.kind,
            path.direct, path.reason, " EMULATED bandwidth" if tc.emulate else "",
        )
        rq = make_queue(path.kind, c.read_queue_depth, c.io_threads, self._waker, f"{tc.name}-r")
        wq = make_queue(path.kind, c.write_queue_depth, c.io_threads, self._waker, f"{tc.name}-w")
        em = tc.emulate
        rth = Throttle(em.read_mbps, em, 2 * i) if em and em.read_mbps else None
        wth = Throttle(em.write_mbps, em, 2 * i + 1) if em and em.write_mbps else None
        return _TierRuntime(tier, path, rq, wq, rth, wth, os.stat(tier.root).st_dev)

    # ------------------------------------------------------------------------------------
    # public API (any thread)
    @property
    def tiers(self) -> list[Tier]:
        return [rt.tier for rt in self._tiers]

    def lookup(self, key: str) -> ChunkInfo | None:
        """The chunk's size and metadata if any healthy tier has a valid copy."""
        digest = fmt.key_digest(key)
        for rt in self._tiers:
            if not rt.tier.up:
                continue
            entry = rt.tier.get(digest)
            if entry is None:
                continue
            header = rt.tier.load_header(digest, entry, self.cfg.max_chunk_bytes)
            if header is not None:
                return ChunkInfo(digest, header.payload_len, header.meta)
        return None

    def pin(self, digest: bytes) -> None:
        with self._wlock:
            self._pins[digest] += 1

    def unpin(self, digest: bytes) -> bool:
        with self._wlock:
            if self._pins[digest] <= 0:
                return False
            self._pins[digest] -= 1
            if not self._pins[digest]:
                del self._pins[digest]
            return True

    def read(
        self, requests: Sequence[tuple[str, ChunkInfo, Buffer, Alloc | None]]
    ) -> list[ReadHandle]:
        """Admit chunks to the pool; see the module docstring for buffer ownership."""
        handles = [ReadHandle(k, info, buf, alloc) for k, info, buf, alloc in requests]
        if handles:
            self._reads_quiet = False
            self._post(lambda: self._admit(handles))
        return handles

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
        digest = fmt.key_digest(key)
        job = _WriteJob(key, digest, buf, payload_len, meta, on_published, on_done)
        with self._wlock:
            if digest in self._writing or self._stopping:
                return False
            self._writing.add(digest)
            self._staged_bytes += payload_len
            self._writes_staged += 1
        self._post(lambda: self._staged.append(job))
        return True

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

    def writing(self, key: str) -> bool:
        with self._wlock:
            return fmt.key_digest(key) in self._writing

    def remove(self, key: str) -> bool:
        digest = fmt.key_digest(key)
        removed = [rt.tier.remove(digest) for rt in self._tiers]  # from every tier, no short cut
        return any(removed)

    def flush(self, timeout: float | None = None) -> bool:
        """Wait until every staged write is finished; False on timeout."""
        return self._wait(self._writes_quiet, timeout)

    def wait_idle(self, timeout: float | None = None) -> bool:
        """Wait until no write and no read (hedge losers included) is outstanding."""
        return self._wait(lambda: self._writes_quiet() and self._reads_quiet, timeout)

    def _writes_quiet(self) -> bool:
        with self._wlock:
            return not self._writing

    def _wait(self, pred: Callable[[], bool], timeout: float | None) -> bool:
        deadline = None if timeout is None else time.monotonic() + timeout
        with self._idle:
            while True:
                if pred():
                    return True
                left = None if deadline is None else deadline - time.monotonic()
                if left is not None and left <= 0:
                    return False
                self._waker.wake()
                self._idle.wait(0.05 if left is None else min(left, 0.05))

    def close(self, timeout: float = 120.0) -> None:
        """Drain staged writes (bounded by ``timeout``) and stop; idempotent."""
        if not self._thread.is_alive():
            return
        self.flush(timeout)
        with self._wlock:
            self._stopping = True
        self._post(lambda: None)
        self._thread.join(timeout)
        self._close_queues()
        self._waker.close()

    def stats(self) -> EngineStats:
        tiers = []
        for rt in self._tiers:
            t = rt.tier
            tiers.append(TierInfo(
                t.name, t.root, rt.path.kind, rt.path.direct, rt.path.reason, t.up,
                t.down_reason, len(t), t.used, t.capacity, t.cfg.emulate is not None,
                rt.read_bytes, rt.write_bytes, dict(t.counters.quarantined), t.counters.evicted,
                t.counters.capacity_skips, dict(rt.errors),
            ))
        return EngineStats(
            tiers, self._n_steps, self._chunks_read, dict(self._misses), self._writes_staged,
            self._writes_published, self._writes_failed, self._overlap_total, self._hedged_total,
        )

    # ------------------------------------------------------------------------------------
    # the completion loop (thread kvstream-io)
    def _post(self, cmd: Callable[[], None]) -> None:
        self._cmds.append(cmd)
        self._waker.wake()

    def _later(self, when: float, fn: Callable[[], None]) -> None:
        self._seq += 1
        heapq.heappush(self._delayed, (when, self._seq, fn))

    def _loop(self) -> None:
        poller = select.poll()
        poller.register(self._waker.fd, select.POLLIN)
        while True:
            try:
                self._iterate()
            except Exception:  # noqa: BLE001 - the loop must survive anything a tier throws
                log.exception("kvstream: unexpected error in the completion loop")
            if self._stopping and not self._cmds and not self._busy():
                break
            timeout_ms = -1
            if self._delayed:
                timeout_ms = max(0, int((self._delayed[0][0] - self._clock()) * 1000) + 1)
            if any(not rt.tier.up for rt in self._tiers):
                timeout_ms = 1000 if timeout_ms < 0 else min(timeout_ms, 1000)
            if self._staged:
                timeout_ms = 50 if timeout_ms < 0 else min(timeout_ms, 50)
            if not self._cmds:
                poller.poll(timeout_ms)
            self._waker.clear()
        with self._idle:
            self._idle.notify_all()

    def _busy(self) -> bool:
        return (
            bool(self._staged) or self._writes_inflight > 0 or self._router.busy()
            or bool(self._delayed)
        )

    def _iterate(self) -> None:
        while self._cmds:
            self._cmds.popleft()()
        now = self._clock()
        for rt in self._tiers:
            for op in rt.rq.reap():
                self._read_done(rt, op, now)
            for op in rt.wq.reap():
                self._write_done(rt, op, now)
        while self._delayed and self._delayed[0][0] <= now:
            heapq.heappop(self._delayed)[2]()
        self._dispatch_reads(now)
        self._pump_writes(now)
        for rt in self._tiers:
            rt.rq.flush()
            rt.wq.flush()
        self._maybe_end_step(now)
        self._reprobe(now)
        self._reads_quiet = not self._router.busy() and not self._cmds  # no admission pending
        with self._idle:
            self._idle.notify_all()

    # ---- reads --------------------------------------------------------------------------
    def _admit(self, handles: list[ReadHandle]) -> None:
        """Add chunks to the pool. ``_reading[d]`` counts unresolved pooled chunks of digest d
        (they are not evictable); it is decremented exactly once, in :meth:`_resolve`."""
        now = self._clock()
        self._maybe_end_step(now)
        if not self._chunks:
            self._step_t0 = now
        for h in handles:
            holders = [i for i, rt in enumerate(self._tiers)
                       if rt.tier.up and rt.tier.has(h.info.digest)]
            self._router.add(holders)
            self._chunks.append(_Chunk(h))
            self._reading[h.info.digest] += 1
            if not holders:
                self._resolve(h, None, "no-tier")

    def _resolve(self, h: ReadHandle, buf: Buffer | None, reason: str = "") -> None:
        """Deliver a pooled chunk: its verified buffer, or a miss (its own buffer released)."""
        self._reading[h.info.digest] -= 1
        if buf is None:
            self._misses[reason] += 1
            self._step_misses += 1
            h.buffer.release()
        h._deliver(buf, reason)

    def _dispatch_reads(self, now: float) -> None:
        for ti, rt in enumerate(self._tiers):
            if rt.tier.up and not self._router.outstanding(ti):
                for idx in self._router.claim(ti):
                    self._start_read(ti, idx, now)

    def _start_read(self, ti: int, idx: int, now: float) -> None:
        rt, chunk = self._tiers[ti], self._chunks[idx]
        h = chunk.handle
        plen = h.info.payload_len
        need = fmt.padded(plen) if rt.path.direct else plen
        hedge = not chunk.primary_free
        buf = h.buffer if not hedge else (h.alloc(plen) if h.alloc else None)
        if buf is None or buf.capacity < need:
            if buf is not None and hedge:
                buf.release()
            self._router.abandon(ti, idx) if hedge else self._fail_read(ti, idx, "small-buffer")
            return
        if not hedge:
            chunk.primary_free = False
        try:
            fd = files.open_read(rt.tier.chunk_path(h.info.digest), rt.path.direct)
        except OSError as e:
            self._attempt_failed(_ReadAttempt(idx, ti, buf, not hedge, hedge, (0, memoryview(b""))),
                                 e.errno or errno.EIO)
            return
        hdr = self._slab.get()
        attempt = _ReadAttempt(idx, ti, buf, not hedge, hedge, hdr)
        op = IoOp(fd, [(hdr[0], fmt.HEADER_SIZE), (buf.addr, need)], 0, False, attempt)
        op.t_submit = now
        if not rt.rq.submit(op):  # depth exhausted: count as a transient failure of this tier
            files.close(fd, drop_pages=False)
            self._slab.put(hdr)
            self._attempt_failed(attempt, errno.EAGAIN)
            return
        if rt.reads_inflight == 0:
            rt.busy_since = now
        rt.reads_inflight += 1

    def _read_done(self, rt: _TierRuntime, op: IoOp, now: float) -> None:
        files.close(op.fd, drop_pages=not rt.path.direct)  # an error here loses nothing read
        if rt.rthrottle is not None:
            when = rt.rthrottle.release_at(op.t_submit, now, op.done)
            if when > now:
                self._later(when, lambda: self._finish_read(rt, op, self._clock()))
                return
        self._finish_read(rt, op, now)

    def _finish_read(self, rt: _TierRuntime, op: IoOp, now: float) -> None:
        a: _ReadAttempt = op.ctx
        rt.reads_inflight -= 1
        if rt.reads_inflight == 0:
            rt.step.busy_s += now - rt.busy_since
        h = self._chunks[a.idx].handle
        digest, plen = h.info.digest, h.info.payload_len
        moved = max(op.result, 0)
        rt.read_bytes += moved
        rt.step.bytes += moved
        if a.hedge:
            rt.step.hedged_bytes += moved
            self._hedged_total += moved
        reason = ""
        if op.result < 0:
            self._slab.put(a.hdr)
            self._attempt_failed(a, -op.result)
            return
        try:
            if op.result < fmt.HEADER_SIZE + plen:
                raise fmt.CorruptChunk("truncated", f"{op.result} bytes")
            header = fmt.decode_header(a.hdr[1], digest, self.cfg.max_chunk_bytes)
            if header.payload_len != plen:
                raise fmt.CorruptChunk("length-mismatch")
            if self.cfg.verify_checksums:
                fmt.verify_payload(header, payload_view(a.buf.addr, plen))
        except fmt.CorruptChunk as e:
            reason = e.reason
        self._slab.put(a.hdr)
        if reason:
            log.warning("kvstream: %s copy of a chunk is corrupt (%s); quarantined",
                        rt.tier.name, reason)
            rt.tier.quarantine(digest, reason)
            self._read_failed(a, reason)
            return
        chunk = self._chunks[a.idx]
        if a.primary:
            chunk.primary_free = True
        if self._router.complete(a.tier, a.idx):
            rt.step.chunks += 1
            rt.tier.touch(digest)
            self._chunks_read += 1
            self._step_bytes += plen
            self._step_last = now
            if not a.primary and chunk.primary_free:
                h.buffer.release()  # a hedge won while the request's own buffer sat idle
            self._resolve(h, a.buf)
        else:
            a.buf.release()

    def _attempt_failed(self, a: _ReadAttempt, code: int) -> None:
        rt = self._tiers[a.tier]
        h = self._chunks[a.idx].handle
        if code == errno.ENOENT:
            rt.tier.discard(h.info.digest)  # evicted or removed by another process
        elif code in files.FILE_LEVEL_ERRNOS:
            rt.tier.quarantine(h.info.digest, "not-a-file")  # a symlink or directory planted
        elif code != errno.EAGAIN:
            self._tier_down(a.tier, f"read: {os.strerror(code)}")
        self._read_failed(a, _errname(code))

    def _read_failed(self, a: _ReadAttempt, reason: str) -> None:
        rt = self._tiers[a.tier]
        rt.errors[reason] += 1
        rt.step.errors += 1
        chunk = self._chunks[a.idx]
        resolved = self._router.state(a.idx) in (DONE, DEAD)
        if a.primary and not resolved:
            chunk.primary_free = True  # kept for the next attempt on another tier
        else:
            a.buf.release()  # a hedge's buffer, or the request's own after a hedge won
        if self._router.fail(a.tier, a.idx):
            self._resolve(chunk.handle, None, reason)

    def _fail_read(self, ti: int, idx: int, reason: str) -> None:
        self._tiers[ti].errors[reason] += 1
        if self._router.fail(ti, idx):
            self._resolve(self._chunks[idx].handle, None, reason)

    def _maybe_end_step(self, now: float) -> None:
        if not self._chunks or self._router.busy():
            return
        tiers = []
        for rt in self._tiers:
            tiers.append(rt.step)
            rt.step = TierStep(rt.tier.name)
        t = max(self._step_last - self._step_t0, 1e-9)
        agg = sum(ts.bandwidth for ts in tiers)
        bound = self._step_bytes / agg if agg > 0 else 0.0
        self.steps.append(StepReport(
            chunks=len(self._chunks), misses=self._step_misses, bytes=self._step_bytes,
            time_s=t if self._step_bytes else 0.0, bound_s=bound,
            gap=(t / bound - 1) if bound > 0 else 0.0, write_overlap_bytes=self._step_overlap,
            tiers=tiers,
        ))
        for chunk in self._chunks:
            if self._reading.get(chunk.handle.info.digest, 1) <= 0:
                del self._reading[chunk.handle.info.digest]
        self._n_steps += 1
        self._chunks.clear()
        self._router.reset()
        self._step_bytes = self._step_misses = self._step_overlap = 0

    # ---- writes -------------------------------------------------------------------------
    def _evictable(self, digest: bytes) -> bool:
        return self._reading.get(digest, 0) <= 0 and self._pins.get(digest, 0) <= 0

    def _pump_writes(self, now: float) -> None:
        reads_busy = self._router.busy()
        while self._staged:
            over = self._staged_bytes > self.cfg.staging_budget_bytes
            if reads_busy and not over:
                return
            if any(rt.tier.up and rt.wq.inflight >= self.cfg.write_queue_depth
                   for rt in self._tiers):
                return
            job = self._staged.popleft()
            with self._wlock:
                self._staged_bytes -= job.payload_len
            if reads_busy:
                self._step_overlap += job.payload_len
                self._overlap_total += job.payload_len
            self._start_write(job, now)

    def _start_write(self, job: _WriteJob, now: float) -> None:
        plen = job.payload_len
        xxh = fmt.payload_checksum(payload_view(job.buf.addr, plen))
        job.hdr = self._slab.get()
        job.header = fmt.Header(plen, xxh, job.meta)
        fmt.encode_header(job.hdr[1], job.digest, plen, xxh, job.meta)
        size = fmt.file_size(plen)
        for ti, rt in enumerate(self._tiers):
            if not rt.tier.up:
                continue
            n = fmt.padded(plen) if job.buf.capacity >= fmt.padded(plen) else plen
            if n != fmt.padded(plen) and rt.path.direct:
                rt.errors["unaligned-buffer"] += 1
                continue
            if not rt.tier.reserve(size, self._evictable):
                continue
            try:
                fd, tmp = files.create_temp(rt.tier.tmp_dir, self.cfg.file_mode, rt.path.direct)
            except OSError as e:
                rt.tier.unreserve(size)
                rt.errors[_errname(e.errno or errno.EIO)] += 1
                self._tier_down(ti, f"create: {e.strerror}")
                continue
            op = IoOp(fd, [(job.hdr[0], fmt.HEADER_SIZE), (job.buf.addr, n)], 0, True,
                      _WriteAttempt(job, ti, tmp, size))
            op.t_submit = now
            if not rt.wq.submit(op):
                files.close(fd, drop_pages=False)
                files.unlink_quiet(tmp)
                rt.tier.unreserve(size)
                continue
            job.pending += 1
            self._writes_inflight += 1
        if job.pending == 0:
            self._writes_failed += 1
            self._end_job(job)

    def _write_done(self, rt: _TierRuntime, op: IoOp, now: float) -> None:
        err = files.close(op.fd, drop_pages=not rt.path.direct)
        if err and op.result >= 0:
            op.result = -err  # the data may not have reached the file system
        if rt.wthrottle is not None:
            when = rt.wthrottle.release_at(op.t_submit, now, op.done)
            if when > now:
                self._later(when, lambda: self._finish_write(rt, op))
                return
        self._finish_write(rt, op)

    def _finish_write(self, rt: _TierRuntime, op: IoOp) -> None:
        a: _WriteAttempt = op.ctx
        job = a.job
        self._writes_inflight -= 1
        ok = op.result == op.length
        if ok:
            try:
                files.publish(a.tmp, rt.tier.ensure_parent(job.digest))
                rt.tier.commit(job.digest, a.size, job.header)
                rt.write_bytes += op.result
            except OSError as e:
                ok = False
                rt.errors[_errname(e.errno or errno.EIO)] += 1
                self._tier_down(a.tier, f"publish: {e.strerror}")
        else:
            files.unlink_quiet(a.tmp)
            code = -op.result if op.result < 0 else errno.ENOSPC
            rt.errors[_errname(code)] += 1
            self._tier_down(a.tier, f"write: {os.strerror(code)}")
        if not ok:
            rt.tier.unreserve(a.size)
        job.pending -= 1
        if ok and not job.published:
            job.published = True
            self._writes_published += 1
            if job.on_published is not None:
                _safe(job.on_published, job.key)
        if job.pending == 0:
            if not job.published:
                self._writes_failed += 1
            self._end_job(job)

    def _end_job(self, job: _WriteJob) -> None:
        if job.hdr is not None:
            self._slab.put(job.hdr)
        with self._wlock:
            self._writing.discard(job.digest)
        if job.on_done is not None:
            _safe(job.on_done)

    # ---- health -------------------------------------------------------------------------
    def _tier_down(self, ti: int, reason: str) -> None:
        rt = self._tiers[ti]
        if not rt.tier.up:
            return
        log.error("kvstream: tier %s marked DOWN (%s); serving from the other tiers",
                  rt.tier.name, reason)
        rt.tier.mark_down(reason)
        rt.next_probe = self._clock() + self.cfg.reprobe_interval_s
        for idx in self._router.drop_tier(ti):
            self._resolve(self._chunks[idx].handle, None, "tier-down")

    def _reprobe(self, now: float) -> None:
        for ti, rt in enumerate(self._tiers):
            if rt.tier.up or rt.probing or now < rt.next_probe:
                continue
            rt.probing = True
            threading.Thread(target=self._probe_tier, args=(ti,), daemon=True,
                             name=f"kvstream-probe-{rt.tier.name}").start()

    def _probe_tier(self, ti: int) -> None:
        rt = self._tiers[ti]
        ok = False
        try:
            # Same file system as at start, or a remount that still holds our layout; never
            # the empty mount point of a dead mount (that would fill the disk underneath).
            if os.stat(rt.tier.root).st_dev != rt.dev and not os.path.isdir(rt.tier.base):
                raise OSError(errno.ENODEV, "tier root is an empty, different file system")
            rt.tier.open()
            probe(rt.tier.tmp_dir, rt.path.kind, "on" if rt.path.direct else "off",
                  self.cfg.file_mode)
            ok = True
        except Exception as e:  # noqa: BLE001 - any failure keeps the tier down
            log.info("kvstream: tier %s still down: %s", rt.tier.name, e)

        def done() -> None:
            rt.probing = False
            if ok:
                rt.tier.mark_up()
                log.warning("kvstream: tier %s is healthy again; re-admitted", rt.tier.name)
                if self.cfg.warm_headers:
                    self._warm()
            else:
                rt.next_probe = self._clock() + self.cfg.reprobe_interval_s

        self._post(done)

    def _close_queues(self) -> None:
        for rt in self._tiers:
            rt.rq.close()
            rt.wq.close()


def _safe(fn: Callable, *args: object) -> None:
    try:
        fn(*args)
    except Exception:  # noqa: BLE001 - a caller's callback must not kill the loop
        log.exception("kvstream: callback raised")
