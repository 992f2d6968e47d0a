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
job back until the emulated device would have finished it.

O_DIRECT needs page-aligned memory. A caller's buffer that is not (an L1 pool configured with
``--l1-align-bytes`` below 4096, a MemoryObj without padding) goes through a page-aligned
bounce buffer: a copy, never an ``EINVAL`` that would mark the tier down.
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
from collections.abc import Callable
from typing import Any

from . import format as fmt
from .config import KVStreamConfig
from .emulate import Throttle, tier_throttle
from .handles import Buffer, ReadHandle, Segment, payload_views, segments
from .io import files
from .io.memory import AlignedBuffer
from .io.ops import IoOp, IoQueue, Waker
from .io.threads import Workers
from .tier import Tier

log = logging.getLogger("kvstream")


class ReadJob:
    """One read of one chunk copy from one tier (a primary read or a hedge)."""

    __slots__ = ("tier", "rid", "handle", "buf", "primary", "hdr", "errno", "reason", "moved",
                 "t_start", "bounce")

    def __init__(self, tier: int, rid: int, handle: ReadHandle, buf: Buffer, primary: bool,
                 hdr: tuple[int, memoryview], t_start: float) -> None:
        self.tier = tier
        self.rid = rid
        self.handle = handle
        self.buf = buf
        self.primary = primary  # ``buf`` is the handle's own buffer (else a hedge's)
        self.hdr = hdr  # a header slot owned by the loop's slab pool
        self.errno = 0
        self.reason = ""  # a corruption tag ("bad-payload-checksum", ...) if the copy is bad
        self.moved = 0
        self.t_start = t_start
        self.bounce: AlignedBuffer | None = None  # read here, then copied into ``buf``

    @property
    def ok(self) -> bool:
        return not self.errno and not self.reason


class WriteJob:
    """One tier's copy of one staged chunk: reserve, write a temp file, publish it."""

    __slots__ = ("tier", "chunk", "digest", "hdr_addr", "segs", "size", "header",
                 "errno", "reason", "moved", "published", "bounce")

    def __init__(self, tier: int, chunk: object, digest: bytes, hdr_addr: int,
                 segs: list[Segment], header: fmt.Header) -> None:
        self.tier = tier
        self.chunk = chunk  # the writer's per-chunk record
        self.digest = digest
        self.hdr_addr = hdr_addr
        self.segs = segs  # the payload's memory (padded when the buffer allows)
        self.size = fmt.file_size(header.payload_len)
        self.header = header
        self.errno = 0
        self.reason = ""  # "capacity" when the tier could not make room
        self.moved = 0
        self.published = False  # this call published the file (False: another writer won)
        self.bounce: AlignedBuffer | None = None  # an aligned copy of the payload, if needed

    @property
    def ok(self) -> bool:
        return not self.errno and not self.reason


class RepairJob:
    """Copy a published chunk file from another tier to this one (re-replication)."""

    __slots__ = ("tier", "digest", "src_path", "errno", "reason", "moved")

    def __init__(self, tier: int, digest: bytes, src_path: str) -> None:
        self.tier = tier
        self.digest = digest
        self.src_path = src_path
        self.errno = 0
        self.reason = ""  # "capacity", or "source-gone" when the source copy vanished
        self.moved = 0

    @property
    def ok(self) -> bool:
        return not self.errno and not self.reason


Job = ReadJob | WriteJob | RepairJob
COPY_BLOCK = 8 << 20


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
        info = job.handle.info
        plen = info.payload_len
        try:
            fd = files.open_read(self.tier.chunk_path(info.digest), self.direct)
        except OSError as e:
            self._read_failed(job, e.errno or errno.EIO)
            self._read_done(job)
            return
        segs = segments(job.buf, plen)
        if self.direct:
            need = fmt.padded(plen)
            if len(segs) == 1 and job.buf.capacity >= need:
                segs = [(segs[0][0], need)]  # the padding lands in the buffer's slack
            if not _aligned(segs):
                job.bounce = AlignedBuffer(need)
                segs = [(job.bounce.addr, need)]
        self._submit(IoOp(fd, [(job.hdr[0], fmt.HEADER_SIZE), *segs], 0, False, job))

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
        else:  # checksums on the shared verify threads: one tier thread cannot keep up
            self._verify.submit(self._check, job)

    def _check(self, job: ReadJob) -> None:
        """Verify thread: validate the header and the payload checksum, copy a bounce buffer
        into place; the tier thread then quarantines a bad copy and delivers the job."""
        info = job.handle.info
        try:
            if job.moved < fmt.HEADER_SIZE + info.payload_len:
                raise fmt.CorruptChunk("truncated", f"{job.moved} bytes")
            header = fmt.decode_header(job.hdr[1], info.digest, self._cfg.max_chunk_bytes)
            if header.payload_len != info.payload_len:
                raise fmt.CorruptChunk("length-mismatch")
            plen = info.payload_len
            src = job.bounce if job.bounce is not None else job.buf
            if self._cfg.verify_checksums:
                fmt.verify_payload(header, payload_views(src, plen))
            if job.bounce is not None:
                at = job.bounce.addr
                for addr, n in segments(job.buf, plen):
                    ctypes.memmove(addr, at, n)
                    at += n
        except fmt.CorruptChunk as e:
            job.reason = e.reason
        except Exception:  # noqa: BLE001 - the job must come back, or close() waits for it
            log.exception("kvstream: tier %s: verifying a read failed", self.tier.name)
            job.errno = errno.EAGAIN  # not the tier's fault: another copy is tried
        self._filed_back(self._checked, job)

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
            self._filed_back(self._submit, self._open_temp(job))
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

    def _open_temp(self, job: WriteJob) -> IoOp:
        """The copy's write op; on failure no temp file or descriptor is left behind."""
        fd, tmp = files.create_temp(self.tier.tmp_dir, self._cfg.file_mode, self.direct)
        segs = job.segs
        try:
            if self.direct and not _aligned(segs):
                job.bounce = AlignedBuffer(job.header.payload_len)  # zero-filled past the end
                at, left = job.bounce.addr, job.header.payload_len
                for addr, n in segs:  # the payload only: a buffer's slack is not copied
                    n = min(n, left)
                    ctypes.memmove(at, addr, n)
                    at, left = at + n, left - n
                segs = [(job.bounce.addr, job.bounce.capacity)]
        except BaseException:
            files.close(fd, drop_pages=False)
            files.unlink_quiet(tmp)
            raise
        return IoOp(fd, [(job.hdr_addr, fmt.HEADER_SIZE), *segs], 0, True, (job, tmp))

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
            self._seal_file(op)
        except Exception:  # noqa: BLE001 - the job must come back, or close() waits for it
            log.exception("kvstream: tier %s: publishing a copy failed", self.tier.name)
            job, tmp = op.ctx
            job.errno = errno.EIO
            if op.fd >= 0:
                files.close(op.fd, drop_pages=False)
                op.fd = -1
            files.unlink_quiet(tmp)
        self._filed_back(self._sealed, op)

    def _seal_file(self, op: IoOp) -> None:
        job, tmp = op.ctx
        err = files.close(op.fd, drop_pages=not self.direct)
        op.fd = -1
        if op.result == op.length and not err:
            try:
                job.published = files.publish(tmp, self.tier.ensure_parent(job.digest))
                job.moved = op.result
            except OSError as e:
                job.errno = e.errno or errno.EIO
        else:
            files.unlink_quiet(tmp)
            job.errno = err or (-op.result if op.result < 0 else errno.ENOSPC)

    def _sealed(self, op: IoOp) -> None:
        job, _ = op.ctx
        if job.ok:
            self.tier.commit(job.digest, job.size, job.header)
        else:
            job.moved = 0
            self.tier.unreserve(job.size)
        self._done(job)

    # re-replication
    def _repair(self, job: RepairJob) -> None:
        """Copy the source tier's file into a temp file here and publish it (blocking: repairs
        run only while no read is outstanding, one at a time per tier)."""
        try:
            src = files.open_read(job.src_path, direct=False)
        except OSError as e:
            job.reason = "source-gone" if e.errno in files.FILE_LEVEL_ERRNOS else ""
            job.errno = 0 if job.reason else (e.errno or errno.EIO)
            return
        tmp = ""
        try:
            size = os.fstat(src).st_size
            if not self.tier.reserve(size, self._evictable):
                job.reason = "capacity"
                return
            try:
                dst, tmp = files.create_temp(self.tier.tmp_dir, self._cfg.file_mode, False)
                try:
                    job.moved = files.copy(src, dst, size, COPY_BLOCK)
                finally:
                    close_err = files.close(dst, drop_pages=True)
                if close_err or job.moved != size:
                    raise OSError(close_err or errno.EIO, f"copied {job.moved} of {size} bytes")
                files.publish(tmp, self.tier.ensure_parent(job.digest))
                tmp = ""
                self.tier.commit(job.digest, size, None)
            except OSError as e:
                job.errno = e.errno or errno.EIO
                self.tier.unreserve(size)
        finally:
            files.close(src, drop_pages=True)
            if tmp:
                files.unlink_quiet(tmp)


def _aligned(segs: list[Segment]) -> bool:
    """True if O_DIRECT can move ``segs`` as they are (every address and length aligned)."""
    return all(not (addr % fmt.ALIGN or n % fmt.ALIGN) for addr, n in segs)
