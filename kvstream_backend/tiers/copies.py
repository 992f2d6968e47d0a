"""The file steps of one tier's I/O, as plain functions: the read of a chunk copy, the check of
what it read, a copy's temp file made, sealed and published, and a copy re-made from another
tier's file. The tier worker (:mod:`kvstream_backend.tiers.worker`) decides which thread runs each
(its own, a file thread, a verify thread); a step touches only the job and the tier it is given.

O_DIRECT needs page-aligned memory. A caller's buffer that is not (an L1 pool configured with
``--l1-align-bytes`` below 4096, a MemoryObj without padding) goes through a page-aligned
bounce buffer: a copy, never an ``EINVAL`` that would mark the tier down.
"""

from __future__ import annotations

import ctypes
import errno
import os
from collections.abc import Callable

from .. import format as fmt
from ..handles import Segment, payload_views, segments
from ..io import files
from ..io.memory import AlignedBuffer
from ..io.ops import IoOp
from .jobs import ReadJob, RepairJob, WriteJob
from .tier import Tier

COPY_BLOCK = 8 << 20  # a repair's copy, block by block


def aligned(segs: list[Segment]) -> bool:
    """True if O_DIRECT can move ``segs`` as they are (every address and length aligned)."""
    return all(not (addr % fmt.ALIGN or n % fmt.ALIGN) for addr, n in segs)


def read_op(job: ReadJob, fd: int, direct: bool, hash_payload: bool) -> IoOp:
    """The read of ``job``'s copy open at ``fd``: the header into its slot, the payload into the
    job's buffer, or into a bounce buffer (``job.bounce``) where O_DIRECT cannot use it.
    ``hash_payload``: the op asks for the payload's digest (a queue that ``hashes_reads``
    hashes its bytes as they land; see :func:`check_read`)."""
    plen = job.handle.info.payload_len
    segs = segments(job.buf, plen)
    if direct:
        need = fmt.padded(plen)
        if len(segs) == 1 and job.buf.capacity >= need:
            segs = [(segs[0][0], need)]  # the padding lands in the buffer's slack
        if not aligned(segs):
            job.bounce = AlignedBuffer(need)
            segs = [(job.bounce.addr, need)]
    op = IoOp(fd, [(job.hdr[0], fmt.HEADER_SIZE), *segs], 0, False, job)
    if hash_payload:
        op.hash_span = (fmt.HEADER_SIZE, fmt.HEADER_SIZE + plen)
    return op


def check_read(job: ReadJob, max_chunk_bytes: int, verify_checksums: bool) -> None:
    """Validate what ``job`` read (length, header, payload checksum) and copy a bounce buffer
    into place. A bad copy sets ``job.reason`` (raises nothing for it). The checksum is
    ``job.payload_xxh`` where the read was hashed as it landed (a header compare, cheap),
    else a pass over the payload's memory (CPU work for a verify thread)."""
    info = job.handle.info
    try:
        if job.moved < fmt.HEADER_SIZE + info.payload_len:
            raise fmt.CorruptChunk("truncated", f"{job.moved} bytes")
        header = fmt.decode_header(job.hdr[1], info.digest, max_chunk_bytes)
        if header.payload_len != info.payload_len:
            raise fmt.CorruptChunk("length-mismatch")
        plen = info.payload_len
        src = job.bounce if job.bounce is not None else job.buf
        if verify_checksums and job.payload_xxh is not None:
            fmt.verify_checksum(header, job.payload_xxh)
        elif verify_checksums:
            fmt.verify_payload(header, payload_views(src, plen))
        if job.bounce is not None:
            at = job.bounce.addr
            for addr, n in segments(job.buf, plen):
                ctypes.memmove(addr, at, n)
                at += n
    except fmt.CorruptChunk as e:
        job.reason = e.reason


def open_copy(job: WriteJob, tier: Tier, file_mode: int, direct: bool) -> IoOp:
    """The copy's temp file and its write op (through an aligned bounce copy of the payload
    where O_DIRECT cannot use the caller's ranges); on failure nothing is left behind."""
    fd, tmp = files.create_temp(tier.tmp_dir, file_mode, direct)
    segs = job.segs
    try:
        if direct and not aligned(segs):
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


def seal_copy(op: IoOp, tier: Tier, direct: bool) -> None:
    """Close a written copy and, if all of it was written, publish it (first writer wins);
    otherwise remove it. The outcome is in the job (``published``, ``moved``, ``errno``)."""
    job, tmp = op.ctx
    err = files.close(op.fd, drop_pages=not direct)
    op.fd = -1
    if op.result == op.length and not err:
        try:
            job.published = files.publish(tmp, tier.ensure_parent(job.digest))
            job.moved = op.result
        except OSError as e:
            job.errno = e.errno or errno.EIO
    else:
        files.unlink_quiet(tmp)
        job.errno = err or (-op.result if op.result < 0 else errno.ENOSPC)


def repair_copy(job: RepairJob, tier: Tier, file_mode: int,
                evictable: Callable[[bytes], bool]) -> None:
    """Copy the source tier's file into a temp file on ``tier`` and publish it (blocking)."""
    try:
        src = files.open_read(job.src_path, direct=False)
    except OSError as e:
        job.reason = "source-gone" if e.errno in files.FILE_LEVEL_ERRNOS else ""
        job.errno = 0 if job.reason else (e.errno or errno.EIO)
        return
    tmp = ""
    try:
        size = os.fstat(src).st_size
        if not tier.reserve(size, evictable):
            job.reason = "capacity"
            return
        try:
            dst, tmp = files.create_temp(tier.tmp_dir, file_mode, False)
            try:
                job.moved = files.copy(src, dst, size, COPY_BLOCK)
            finally:
                close_err = files.close(dst, drop_pages=True)
            if close_err or job.moved != size:
                raise OSError(close_err or errno.EIO, f"copied {job.moved} of {size} bytes")
            files.publish(tmp, tier.ensure_parent(job.digest))
            tmp = ""
            tier.commit(job.digest, size, None)
        except OSError as e:
            job.errno = e.errno or errno.EIO
            tier.unreserve(size)
    finally:
        files.close(src, drop_pages=True)
        if tmp:
            files.unlink_quiet(tmp)
