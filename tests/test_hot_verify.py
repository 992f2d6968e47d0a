"""Checksums taken while a read lands (the thread path hashes each piece on the thread that read
it) and taken afterwards (a queue that cannot, as io_uring's): the same bytes and the same
verdicts, for payloads across piece boundaries, scattered buffers and damaged copies."""

from __future__ import annotations

import errno
import os
import threading

import pytest
import xxhash

from kvstream_backend import config
from kvstream_backend import format as fmt
from kvstream_backend.engine import Engine, ReadRequest
from kvstream_backend.handles import Regions
from kvstream_backend.io import files, threads
from kvstream_backend.io.memory import AlignedBuffer
from kvstream_backend.io.ops import IoOp, Waker
from kvstream_backend.io.threads import HASH_PIECE, ThreadQueue, transfer

from .conftest import engine_config
from .helpers import check_all, payload, write_all

PIECE = HASH_PIECE
PAGE = fmt.ALIGN


@pytest.fixture(params=["native", "python"])
def hash_loop(request, monkeypatch):
    """The read-and-hash loop: in C where the package was built with it (``_kvstream_native``,
    which the tox environments install), else in Python; both are checked."""
    if request.param == "native":
        native = pytest.importorskip("_kvstream_native", reason="built without a C compiler")
        monkeypatch.setattr(threads, "_native", native)
    else:
        monkeypatch.setattr(threads, "_native", None)
    return request.param


@pytest.mark.parametrize("direct", [False, True])
@pytest.mark.parametrize("seg_sizes, span, file_len", [
    ([PAGE, 3 * PIECE + 2 * PAGE], (PAGE, PAGE + 3 * PIECE + 1000), None),  # header + payload
    ([PAGE, PIECE // 2, PIECE, PAGE * 3], (PAGE, PAGE + PIECE + 7), None),  # scattered
    ([PAGE, 2 * PIECE], (0, 2 * PIECE + PAGE), None),                      # all of it
    ([PAGE, 3 * PIECE], (PAGE, PAGE + 3 * PIECE), PAGE + PIECE + 2 * PAGE),  # file ends early
])
def test_a_hashed_read_feeds_exactly_its_span_in_order(tmp_path, hash_loop, direct, seg_sizes,
                                                       span, file_len):
    total = sum(seg_sizes)
    data = os.urandom(file_len or total)
    path = str(tmp_path / "f")
    with open(path, "wb") as f:
        f.write(data)
    bufs = [AlignedBuffer(n) for n in seg_sizes]
    fd = files.open_read(path, direct)
    try:
        op = IoOp(fd, [(b.addr, n) for b, n in zip(bufs, seg_sizes, strict=True)], 0, False, None)
        op.hash_span = span
        transfer(op)
    finally:
        os.close(fd)
    assert op.result == len(data)
    got = b"".join(bytes(b.view[:n]) for b, n in zip(bufs, seg_sizes, strict=True))
    assert got[:len(data)] == data
    lo, hi = span
    assert op.digest == xxhash.xxh3_64_intdigest(data[lo:min(hi, len(data))])


def test_a_failed_hashed_read_reports_its_errno(tmp_path, hash_loop):
    path = str(tmp_path / "f")
    with open(path, "wb") as f:
        f.write(os.urandom(PIECE))
    buf = AlignedBuffer(PIECE)
    fd = files.open_read(path, False)
    os.close(fd)  # the read gets EBADF
    op = IoOp(fd, [(buf.addr, PIECE)], 0, False, None)
    op.hash_span = (0, PIECE)
    transfer(op)
    buf.release()
    assert op.result == -errno.EBADF


class ColdQueue(ThreadQueue):
    """The thread path, told not to hash as it reads: the engine hashes afterwards, as it does
    behind io_uring (unusable on CPUs without AVX-512, so this stands in for it here)."""

    hashes_reads = False


def cold_factory(kind: str, depth: int, threads: int, waker: Waker, name: str,
                 cpus: frozenset[int] | None = None) -> ThreadQueue:
    return ColdQueue(depth, threads, waker, name)


SIZE = 3 * PIECE + 5 * PAGE + 100  # pieces, pages and a tail that is neither


@pytest.fixture(params=["hot", "cold"])
def engine_of(request, tier_dirs):
    engines: list[Engine] = []

    def make(dirs: list[str]) -> Engine:
        kw = {} if request.param == "hot" else {"queue_factory": cold_factory}
        e = Engine(engine_config(dirs), **kw)
        engines.append(e)
        return e

    yield make
    for e in engines:
        e.close()


@pytest.mark.parametrize("at", [0, PIECE - 1, PIECE, 2 * PIECE + 3, SIZE - 1])
def test_a_flipped_byte_anywhere_is_caught_and_the_other_tier_serves(tier_dirs, engine_of,
                                                                    hash_loop, at):
    e = engine_of(tier_dirs[::-1])  # the tmpfs tier first: its reads are hashed as they land
    write_all(e, ["victim", "other"], SIZE)
    t0 = e.tiers[0]
    with open(t0.chunk_path(fmt.key_digest("victim")), "r+b") as f:
        f.seek(fmt.HEADER_SIZE + at)
        b = f.read(1)
        f.seek(fmt.HEADER_SIZE + at)
        f.write(bytes([b[0] ^ 0x10]))
    check_all(e, ["victim", "other"], SIZE)
    assert e.stats().tiers[0].quarantined == {"bad-payload-checksum": 1}


def test_scattered_buffers_are_hashed_in_payload_order(tier_dirs, engine_of, hash_loop):
    e = engine_of(tier_dirs[1:])  # tmpfs
    write_all(e, ["k"], SIZE)
    info = e.lookup("k")
    assert info is not None
    parts = [AlignedBuffer(n) for n in (PAGE, PIECE + PAGE, SIZE)]  # the last has slack
    regions = Regions([(p.addr, p.capacity) for p in parts])
    (h,) = e.read([ReadRequest(info, regions, None)])
    assert h.wait(30) is regions, h.reason
    got = b"".join(bytes(p.view) for p in parts)[:SIZE]
    assert got == payload("k", SIZE)
    assert not e.stats().tiers[0].quarantined
    for p in parts:
        p.release()



class RecordingQueue(ThreadQueue):
    """The thread path, noting for each read whether it carried a hasher."""

    hashed: dict[str, list[bool]] = {}

    def __init__(self, depth: int, threads: int, waker: Waker, name: str) -> None:
        super().__init__(depth, threads, waker, name)
        self._name = name

    def submit(self, op: IoOp) -> bool:
        if not op.write:
            self.hashed.setdefault(self._name, []).append(op.hash_span is not None)
        return super().submit(op)


def test_only_reads_from_memory_are_hashed_piece_by_piece(tier_dirs):
    if files.fs_type(tier_dirs[0]) in files.MEMORY_FS:
        pytest.skip("the temporary directory is memory-backed here: no device tier to compare")
    RecordingQueue.hashed = {}
    e = Engine(engine_config(tier_dirs, static_split=0.5),
               queue_factory=lambda k, d, t, w, n, c=None: RecordingQueue(d, t, w, n))
    try:
        keys = [f"k{i}" for i in range(8)]
        write_all(e, keys, SIZE)
        check_all(e, keys, SIZE)
    finally:
        e.close()
    # t0 on the local disk (DMA: pieces would serialize it), t1 on tmpfs (a copy from memory)
    assert set(RecordingQueue.hashed["t0-r"]) == {False}
    assert set(RecordingQueue.hashed["t1-r"]) == {True}


@pytest.mark.parametrize("copy_threads,cores,want", [("auto", 7, 7), ("auto", 2, 4),
                                                     (5, 16, 5)])
def test_a_memory_tier_on_the_thread_path_reads_with_a_reader_per_core(
        tier_dirs, monkeypatch, copy_threads, cores, want):
    """A read from tmpfs is a CPU copy: its tier gets ``copy_threads`` readers, by default
    max(io_threads, the cores this process may run on); a tier on a device keeps io_threads
    (its reads wait on the device), and writes keep io_threads."""
    if files.memory_backed(tier_dirs[0]) or not files.memory_backed(tier_dirs[1]):
        pytest.skip("needs the temporary directory on a device and /dev/shm on tmpfs")
    monkeypatch.setattr(config, "cores", lambda: cores)
    queues: dict[str, ThreadQueue] = {}

    def factory(kind: str, depth: int, threads: int, waker: Waker, name: str,
                 cpus: frozenset[int] | None = None) -> ThreadQueue:
        queues[name] = ThreadQueue(depth, threads, waker, name)
        return queues[name]

    e = Engine(engine_config(tier_dirs, copy_threads=copy_threads), queue_factory=factory)
    try:
        write_all(e, ["k"], SIZE)
        check_all(e, ["k"], SIZE)
    finally:
        e.close()
    readers = {n: len(q._pool._threads) for n, q in queues.items()}
    assert readers == {"t0-r": 4, "t0-w": 4, "t1-r": want, "t1-w": 4}


def test_a_memory_tier_takes_the_native_loop_first_where_it_is_built(tier_dirs):
    """With the native read-and-hash loop built, a tmpfs tier in ``io: auto`` takes the thread
    path first (on 16 cores: 0.85x of the plain limit against io_uring's 0.64-0.66x); a tier
    on a device keeps io_uring first."""
    if not threads.NATIVE:
        pytest.skip("the package was built without _kvstream_native (no C compiler)")
    if files.memory_backed(tier_dirs[0]) or not files.memory_backed(tier_dirs[1]):
        pytest.skip("needs the temporary directory on a device and /dev/shm on tmpfs")
    e = Engine(engine_config(tier_dirs))
    try:
        disk, shm = e.stats().tiers
    finally:
        e.close()
    assert shm.io == "threads" and "native loop" in shm.io_reason
    assert "native loop" not in disk.io_reason


def test_spare_cores_keeps_a_memory_tiers_copy_threads_off_the_lowest_cpus(tier_dirs):
    """``spare_cores: 1`` pins a memory tier's readers (one per remaining core) to the CPUs past
    the process's lowest, where LMCache's scatter thread finds a core free of copies (on a
    16-core H100 host, fifteen such readers left the scatter at 12 ms, fifteen unpinned beside a
    GIL holder 18 ms: docs/benchmarks.md, stop 41); the disk tier's threads and every writer
    stay anywhere, and what is read is what was written."""
    if files.memory_backed(tier_dirs[0]) or not files.memory_backed(tier_dirs[1]):
        pytest.skip("needs the temporary directory on a device and /dev/shm on tmpfs")
    allowed = os.sched_getaffinity(0)
    if len(allowed) < 2:
        pytest.skip("needs two CPUs")
    e = Engine(engine_config(tier_dirs, spare_cores=1, io_threads=1))
    try:
        write_all(e, ["k"], SIZE)
        check_all(e, ["k"], SIZE)
        cpus = {t.name: os.sched_getaffinity(t.native_id) for t in threading.enumerate()
                if t.name.startswith("kvs-t") and t.native_id is not None}
    finally:
        e.close()
    rest = set(sorted(allowed)[1:])
    readers = {n: c for n, c in cpus.items() if n.startswith("kvs-t1-r-")}
    assert len(readers) == len(rest)  # copy_threads auto: one per core left to them
    assert all(c == rest for c in readers.values())
    others = {n: c for n, c in cpus.items() if n not in readers}
    assert others and all(c == allowed for c in others.values())
