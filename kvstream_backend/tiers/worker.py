"""One thread per tier, and a few file threads of its own: all I/O of one tier runs on them.

Everything that can block on a file system runs on this tier's threads: ``open``, ring
submission, ``close`` and ``fadvise``, the capacity evictions' ``unlink`` and quarantine
``rename``. The payload checksum of what was read is CPU work, not I/O: it runs on the engine's
verify threads, shared by every tier (xxhash releases the GIL, so they verify in parallel; on
one tier thread, verification capped a 20 GB/s tier near 5 GB/s), and the job comes back to the
tier thread to be delivered. A slow or sick tier (a PFS metadata
server, a FUSE mount that issues reads inline, a dead mount) therefore stalls only its own
reads and writes: the completion loop and the other tiers go on.

A copy's file steps (create the temp file; close, ``link`` and ``unlink`` it to publish) run on
the tier's *file threads* (``io_threads`` of them), not on the tier thread: on a network file
system each is a round trip, and run one after another on the tier thread they left the data
queue idle between writes (kvstream wrote GlusterFS at half of fio's rate). The tier thread
keeps the bookkeeping (capacity reservation, the index) and the data queue full.

Protocol: the engine's completion loop is the only caller of :meth:`TierWorker.read` and
:meth:`TierWorker.write`, which queue a job and return at once. Every job comes back exactly
once through the ``deliver`` callback given at construction (called on this thread; it must
only hand off), with ``errno``/``reason``/``moved`` set. :meth:`close` finishes what was queued
and stops the threads. Emulated bandwidth (``emulate``) is applied here, by holding a finished
job back until the emulated device would have finished it. The file steps themselves are plain
functions (:mod:`kvstream_backend.tiers.copies`); this module decides where and when each runs.

Ownership: ``_inbox`` (the loop appends) and ``_filed`` (file and verify threads append) are
deques, thread-safe by contract; a job belongs to one thread at a time; everything else here is
this tier thread's.
"""

from __future__ import annotations

import collections
import errno
import heapq
import logging
import select
import threading
import time
from collections.abc import Callable
from typing import Any

from ..config import KVStreamConfig
from ..io import files
from ..io.ops import IoOp, IoQueue, Waker
from ..io.threads import Workers
from . import copies
from .emulate import Throttle, tier_throttle
from .jobs import Job, ReadJob, RepairJob, WriteJob
from .tier import Tier

log = logging.getLogger("kvstream")


class TierWorker:
    """The thread of one tier (see the module doc)."""

    def __init__(self, index: int, tier: Tier, direct: bool, cfg: KVStreamConfig,
                 make_queues: Callable[[Waker], tuple[IoQueue, IoQueue]],
                 deliver: Callable[[Job], None], evictable: Callable[[bytes], bool],
                 verify: Workers) -> None:
        self.tier = tier
        self._verify = verify  # shared by every tier: CPU work, sized to the cores
        self.direct = direct
        self._cfg = cfg
        self._deliver = deliver
        self._evictable = evictable
        self.waker = Waker()
        try:
            self.rq, self.wq = make_queues(self.waker)
        except BaseException:
            self.waker.close()
            raise
        em = tier.cfg.emulate
        self._rthrottle = tier_throttle(em, index, write=False) if em else None
        self._wthrottle = tier_throttle(em, index, write=True) if em else None
        # checksum each piece as it lands only where a read is a copy out of memory: on a
        # device (DMA) or a network file system (FUSE) the pieces serialize the transfer
        self._hash_reads = (cfg.verify_checksums and self.rq.hashes_reads
                            and files.memory_backed(tier.root))
        self._inbox: collections.deque[Job] = collections.deque()
        self._files = Workers(cfg.io_threads, f"kvs-{tier.name}-f")
        # file steps done: the tier thread's continuation and its argument
        self._filed: collections.deque[tuple[Callable[[Any], None], Any]] = collections.deque()
        self._backlog: collections.deque[IoOp] = collections.deque()  # queue was at its depth
        self._held: list[tuple[float, int, IoOp]] = []  # emulation: (release time, seq, op)
        self._seq = 0
        self._active = 0  # jobs accepted and not delivered
        self._stopping = False
        self._thread = threading.Thread(target=self._run, name=f"kvstream-tier-{tier.name}",
                                        daemon=True)
        self._thread.start()

    # ---- the loop thread's side ------------------------------------------------------------
    def read(self, job: ReadJob) -> None:
        self._post(job)

    def write(self, job: WriteJob) -> None:
        self._post(job)

    def repair(self, job: RepairJob) -> None:
        self._post(job)

    def _post(self, job: Job) -> None:
        self._inbox.append(job)
        self.waker.wake()

    def close(self, timeout: float | None = None) -> None:
        """Finish queued and in-flight jobs (bounded by ``timeout``), then stop the thread."""
        self._stopping = True
        self.waker.wake()
        self._thread.join(timeout)
        if not self._thread.is_alive():
            self._files.shutdown()  # idle: every job was delivered
            self.rq.close()
            self.wq.close()
            self.waker.close()

    # ---- this tier's thread ---------------------------------------------------------------
    def _run(self) -> None:
        poller = select.poll()
        poller.register(self.waker.fd, select.POLLIN)
        while not (self._stopping and not self._active and not self._inbox):
            timeout = -1
            if self._held:
                timeout = max(0, int((self._held[0][0] - time.monotonic()) * 1000) + 1)
            if self._stopping:
                timeout = 50 if timeout < 0 else min(timeout, 50)
            if not self._inbox and not self._filed:
                poller.poll(timeout)
            self.waker.clear()
            try:
                self._iterate()
            except Exception:  # noqa: BLE001 - never lose the thread; jobs time out upstream
                log.exception("kvstream: tier %s worker error", self.tier.name)

    def _iterate(self) -> None:
        while self._inbox:
            job = self._inbox.popleft()
            self._active += 1
            if isinstance(job, ReadJob):
                self._start_read(job)
            elif isinstance(job, WriteJob):
                self._start_write(job)
            else:
                self._repair(job)
                self._done(job)
        while self._filed:
            then, x = self._filed.popleft()
            then(x)
        for op in self.rq.reap():
            self._reaped(op, self._rthrottle)
        for op in self.wq.reap():
            self._reaped(op, self._wthrottle)
        now = time.monotonic()
        while self._held and self._held[0][0] <= now:
            self._finish(heapq.heappop(self._held)[2])
        while self._backlog:
            op = self._backlog[0]
            if not (self.wq if op.write else self.rq).submit(op):
                break
            self._backlog.popleft()
        self.rq.flush()
        self.wq.flush()

    def _submit(self, op: IoOp) -> None:
        op.t_submit = time.monotonic()
        if self._backlog or not (self.wq if op.write else self.rq).submit(op):
            self._backlog.append(op)

    def _done(self, job: Job) -> None:
        self._active -= 1
        self._deliver(job)

    # reads
    def _start_read(self, job: ReadJob) -> None:
        try:
            fd = files.open_read(self.tier.chunk_path(job.handle.info.digest), self.direct)
        except OSError as e:
            self._read_failed(job, e.errno or errno.EIO)
            self._read_done(job)
            return
        self._submit(copies.read_op(job, fd, self.direct, self._hash_reads))

    def _reaped(self, op: IoOp, throttle: Throttle | None) -> None:
        if not op.write:  # a copy's file is closed with its publication (file threads)
            files.close(op.fd, drop_pages=not self.direct)
        if throttle is not None:
            now = time.monotonic()
            when = throttle.release_at(op.t_submit, now, op.done)
            if when > now:
                self._seq += 1
                heapq.heappush(self._held, (when, self._seq, op))
                return
        self._finish(op)

    def _finish(self, op: IoOp) -> None:
        if op.write:
            self._finish_write(op)
        else:
            self._finish_read(op)

    def _finish_read(self, op: IoOp) -> None:
        job: ReadJob = op.ctx
        job.moved = max(op.result, 0)
        if op.result < 0:
            self._read_failed(job, -op.result)
            self._read_done(job)
            return
        if job.handle.done() or job.handle.abandoned:
            # another copy was delivered first (a hedge), or nobody waits any more: this copy
            # cannot be served (the read pool drops it), so it is not verified, saving a pass
            # over its memory on the CPUs the winning tier reads with
            self._read_done(job)
            return
        if op.digest is not None:
            job.payload_xxh = op.digest
        if job.payload_xxh is not None and job.bounce is None:
            self._validate(job)  # hashed as it was read: what is left is a header compare
            self._checked(job)
        else:  # a pass over memory, on the shared verify threads: one tier thread can't keep up
            self._verify.submit(self._check, job)

    def _check(self, job: ReadJob) -> None:
        """Verify thread: validate the copy read; the tier thread then quarantines a bad copy
        and delivers the job."""
        self._validate(job)
        self._filed_back(self._checked, job)

    def _validate(self, job: ReadJob) -> None:
        """Check the copy read (a bounce buffer is copied into place); never raises."""
        try:
            copies.check_read(job, self._cfg.max_chunk_bytes, self._cfg.verify_checksums)
        except Exception:  # noqa: BLE001 - the job must come back, or close() waits for it
            log.exception("kvstream: tier %s: verifying a read failed", self.tier.name)
            job.errno = errno.EAGAIN  # not the tier's fault: another copy is tried

    def _checked(self, job: ReadJob) -> None:
        if job.reason:
            self.tier.quarantine(job.handle.info.digest, job.reason)
        self._read_done(job)

    def _read_done(self, job: ReadJob) -> None:
        if job.bounce is not None:
            job.bounce.release()
            job.bounce = None
        self._done(job)

    def _read_failed(self, job: ReadJob, code: int) -> None:
        job.errno = code
        digest = job.handle.info.digest
        if code == errno.ENOENT:
            self.tier.discard(digest)  # evicted or removed by another process
        elif code in files.FILE_LEVEL_ERRNOS:
            self.tier.quarantine(digest, "not-a-file")  # a symlink or directory planted

    # writes: reserve here; create (file thread); write (queue); close + publish (file thread)
    def _start_write(self, job: WriteJob) -> None:
        if not self.tier.reserve(job.size, self._evictable):
            job.reason = "capacity"
            self._done(job)
            return
        self._files.submit(self._open_copy, job)

    def _filed_back(self, then: Callable[[Any], None], x: object) -> None:
        """File thread: have the tier thread continue with ``then(x)``."""
        self._filed.append((then, x))
        self.waker.wake()

    def _open_copy(self, job: WriteJob) -> None:
        """File thread: the copy's temp file, and its aligned bounce copy if one is needed.
        Whatever happens, the job comes back (an unexpected error as ``EIO``)."""
        try:
            self._filed_back(self._submit, copies.open_copy(job, self.tier, self._cfg.file_mode,
                                                            self.direct))
        except OSError as e:
            job.errno = e.errno or errno.EIO
            self._filed_back(self._open_failed, job)
        except Exception:  # noqa: BLE001 - the job must come back, or close() waits for it
            log.exception("kvstream: tier %s: preparing a copy failed", self.tier.name)
            job.errno = errno.EIO
            self._filed_back(self._open_failed, job)

    def _open_failed(self, job: WriteJob) -> None:
        self.tier.unreserve(job.size)
        self._done(job)

    def _finish_write(self, op: IoOp) -> None:
        job, _ = op.ctx
        if job.bounce is not None:
            job.bounce.release()
            job.bounce = None
        self._files.submit(self._seal, op)

    def _seal(self, op: IoOp) -> None:
        """File thread: close the temp file and, if all of it was written, publish it.
        Whatever happens, the op comes back (an unexpected error as ``EIO``)."""
        try:
            copies.seal_copy(op, self.tier, self.direct)
        except Exception:  # noqa: BLE001 - the job must come back, or close() waits for it
            log.exception("kvstream: tier %s: publishing a copy failed", self.tier.name)
            job, tmp = op.ctx
            job.errno = errno.EIO
            if op.fd >= 0:
                files.close(op.fd, drop_pages=False)
                op.fd = -1
            files.unlink_quiet(tmp)
        self._filed_back(self._sealed, op)

    def _sealed(self, op: IoOp) -> None:
        job, _ = op.ctx
        if job.ok:
            self.tier.commit(job.digest, job.size, job.header)
        else:
            job.moved = 0
            self.tier.unreserve(job.size)
        self._done(job)

    # re-replication (blocking: repairs run only while no read is outstanding, one at a time
    # per tier)
    def _repair(self, job: RepairJob) -> None:
        copies.repair_copy(job, self.tier, self._cfg.file_mode, self._evictable)
