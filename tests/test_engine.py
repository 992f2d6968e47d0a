"""The engine over real directories with real io_uring / thread-pool I/O (no mocks)."""

from __future__ import annotations

import glob
import multiprocessing as mp
import os
import shutil
import subprocess
import time

import pytest

from kvstream_backend import format as fmt
from kvstream_backend.config import EmulateConfig
from kvstream_backend.engine import ReadRequest
from kvstream_backend.io.memory import AlignedBuffer
from kvstream_backend.tiers import rates
from kvstream_backend.tiers.emulate import serial_seconds, tier_throttle

from .conftest import engine_config, requires_uring
from .helpers import check_all, payload, read_all, write_all
from .helpers import eventually as _eventually

KB = 1024


def _files(root: str, pattern: str = "*.kvs") -> list[str]:
    return glob.glob(os.path.join(root, "kvs1", "**", pattern), recursive=True)



@pytest.mark.parametrize("io,direct", [pytest.param("uring", "on", marks=requires_uring),
                                       ("threads", "off"), ("threads", "on")])
def test_thousands_of_chunks_round_trip_on_every_tier(tier_dirs, make_engine, io, direct):
    opts = [{"io": io, "direct": direct}] * 2
    e = make_engine(tier_dirs, tier_opts=opts)
    st = e.stats()
    assert [(t.io, t.direct) for t in st.tiers] == [(io, direct == "on")] * 2
    keys = [f"model@1@0@{i:x}@bfloat16" for i in range(2000)]
    size = 12 * KB + 17  # deliberately not a multiple of the block size
    write_all(e, keys, size)
    for t in e.tiers:  # replication: every tier holds every chunk
        assert all(t.has(fmt.key_digest(k)) for k in keys)
        assert len(_files(t.root)) == len(keys)
        assert _files(t.root, "*.tmp") == []
    check_all(e, keys, size)
    rep = e.steps[-1]
    assert rep.chunks == len(keys) and rep.misses == 0
    assert sum(t.chunks for t in rep.tiers) == len(keys)
    assert all(t.chunks > 0 for t in rep.tiers), "both tiers should serve part of the pool"


def test_the_completion_loop_survives_an_error_outside_its_turn(tier_dirs, make_engine, kvlog):
    """An exception while the loop decides how long to sleep (here the router's stall
    deadline, which an A/B against an older routing module lacked) is logged, and the loop
    goes on serving; its thread once died there and every later get hung."""
    e = make_engine(tier_dirs)
    router = e._reads.router
    real, failures = router.next_stall, []

    def failing(now: float) -> float | None:
        if len(failures) < 3:
            failures.append(now)
            raise RuntimeError("next_stall failed")
        return real(now)

    router.next_stall = failing
    keys = [f"model@1@0@{i:x}@bfloat16" for i in range(64)]
    write_all(e, keys, 8 * KB)
    check_all(e, keys, 8 * KB)
    assert len(failures) == 3 and e._loop.alive
    assert kvlog.text.count("unexpected error in the completion loop") == 3


def test_files_and_directories_are_private(tier_dirs, make_engine):
    e = make_engine(tier_dirs)
    write_all(e, ["secret-prompt"], 4 * KB)
    (path,) = _files(e.tiers[0].root)
    assert os.stat(path).st_mode & 0o777 == 0o600
    assert os.stat(os.path.dirname(path)).st_mode & 0o777 == 0o700
    assert "secret" not in path


def test_restart_serves_everything_published(tier_dirs, make_engine):
    keys = [f"r{i}" for i in range(300)]
    e = make_engine(tier_dirs)
    write_all(e, keys, 8 * KB)
    e.close()
    e2 = make_engine(tier_dirs)
    assert [len(t) for t in e2.tiers] == [300, 300]
    check_all(e2, keys, 8 * KB)


def _writer(dirs: list[str], keys: list[str], size: int, go) -> None:
    from kvstream_backend.engine import Engine

    from .conftest import engine_config
    from .helpers import write_all

    e = Engine(engine_config(dirs))
    go.wait()
    write_all(e, keys, size)
    e.close()


def test_two_processes_writing_the_same_keys(tier_dirs, make_engine):
    keys = [f"shared{i}" for i in range(150)]
    ctx = mp.get_context("spawn")
    go = ctx.Event()
    procs = [ctx.Process(target=_writer, args=(tier_dirs, keys, 16 * KB, go)) for _ in range(2)]
    for p in procs:
        p.start()
    time.sleep(2.0)  # both engines up before the race starts
    go.set()
    for p in procs:
        p.join(120)
        assert p.exitcode == 0
    for d in tier_dirs:
        assert len(_files(d)) == len(keys), "exactly one file per key per tier"
        assert _files(d, "*.tmp") == []
    check_all(make_engine(tier_dirs), keys, 16 * KB)


def _damage(path: str, how: str, other: str, outside: str) -> None:
    if how == "payload-bitflip":
        with open(path, "r+b") as f:
            f.seek(fmt.HEADER_SIZE + 100)
            b = f.read(1)
            f.seek(fmt.HEADER_SIZE + 100)
            f.write(bytes([b[0] ^ 1]))
    elif how == "header-bitflip":
        with open(path, "r+b") as f:
            f.seek(33)
            b = f.read(1)
            f.seek(33)
            f.write(bytes([b[0] ^ 4]))
    elif how == "truncated":
        os.truncate(path, fmt.HEADER_SIZE + 10)
    elif how == "zero-length":
        os.truncate(path, 0)
    elif how == "foreign-key":
        shutil.copyfile(other, path)
    elif how == "huge-header":
        buf = bytearray(fmt.HEADER_SIZE)
        digest = bytes.fromhex(os.path.basename(path)[:32])
        fmt.encode_header(memoryview(buf), digest, 1 << 50, 0, b"")
        with open(path, "r+b") as f:
            f.write(buf)
    elif how == "symlink-out":
        shutil.copyfile(path, outside)  # a *valid* copy, but outside the tier root
        os.unlink(path)
        os.symlink(outside, path)
    elif how == "directory":
        os.unlink(path)
        os.mkdir(path)


DAMAGE = ["payload-bitflip", "header-bitflip", "truncated", "zero-length", "foreign-key",
          "huge-header", "symlink-out", "directory"]


@pytest.mark.parametrize("how", DAMAGE)
@pytest.mark.parametrize("restart", [False, True])
def test_damaged_single_copy_is_a_miss_never_data(tier_dirs, make_engine, tmp_path, how, restart):
    size = 16 * KB
    e = make_engine(tier_dirs[:1], max_chunk_mb=1)
    write_all(e, ["victim", "other"], size)
    t = e.tiers[0]
    _damage(t.chunk_path(fmt.key_digest("victim")), how,
            t.chunk_path(fmt.key_digest("other")), str(tmp_path / "outside.kvs"))
    if restart:
        e.close()
        e = make_engine(tier_dirs[:1], max_chunk_mb=1)
    info = e.lookup("victim")
    if info is not None:  # header intact: the damage must be caught when the payload is read
        (h,) = e.read([ReadRequest(info, AlignedBuffer(info.payload_len), None)])
        assert h.wait(10) is None
    assert e.lookup("victim") is None
    check_all(e, ["other"], size)  # the neighbour is untouched
    # A non-file at a chunk path is skipped by the start-up scan (refused, not indexed); every
    # other damage is found on lookup or read, moved aside and counted.
    quarantined = sum(e.stats().tiers[0].quarantined.values())
    assert quarantined == (0 if restart and how in ("symlink-out", "directory") else 1)
    assert len(os.listdir(os.path.join(e.tiers[0].base, "quarantine"))) == quarantined
    if how == "symlink-out":
        assert os.path.exists(tmp_path / "outside.kvs"), "a link target outside must be left alone"


@pytest.mark.parametrize("how", ["payload-bitflip", "header-bitflip", "truncated", "foreign-key"])
def test_damaged_copy_is_served_from_the_other_tier(tier_dirs, make_engine, tmp_path, how):
    size = 16 * KB
    e = make_engine(tier_dirs)
    write_all(e, ["victim", "other"], size)
    t0 = e.tiers[0]
    _damage(t0.chunk_path(fmt.key_digest("victim")), how,
            t0.chunk_path(fmt.key_digest("other")), str(tmp_path / "o"))
    check_all(e, ["victim"], size)
    assert _eventually(lambda: sum(e.stats().tiers[0].quarantined.values()) == 1)
    assert os.listdir(os.path.join(t0.base, "quarantine"))


def test_tier_removed_mid_step_then_readmitted(tier_dirs, make_engine):
    size = 64 * KB
    keys = [f"d{i}" for i in range(120)]
    slow = {"emulate": {"read_mbps": 20, "write_mbps": 400}}
    e = make_engine(tier_dirs, tier_opts=[{}, slow], reprobe_interval_s=0.2)
    write_all(e, keys, size)
    handles = read_all(e, keys)
    time.sleep(0.05)
    shutil.rmtree(tier_dirs[1])  # the second tier vanishes while the pool is being read
    more = [f"n{i}" for i in range(20)]
    write_all(e, more, size)  # staged behind the reads, then written to the survivor
    for h in handles:
        buf = h.wait(30)
        assert buf is not None and bytes(buf.view[:size]) == payload(h.key, size)
    assert e.tiers[1].up is False
    assert all(e.tiers[0].has(fmt.key_digest(k)) for k in more)
    check_all(e, more, size)
    os.makedirs(tier_dirs[1])
    assert _eventually(lambda: e.tiers[1].up), "tier not re-admitted after it came back"
    write_all(e, ["after"], size)
    assert e.tiers[1].has(fmt.key_digest("after"))


@pytest.fixture
def small_tmpfs(tmp_path):
    mnt = tmp_path / "small"
    mnt.mkdir()
    r = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=1m", "tmpfs", str(mnt)],
                       capture_output=True, text=True)
    if r.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here (needs root): {r.stderr.strip()}")
    yield str(mnt)
    subprocess.run(["umount", "-l", str(mnt)], check=False)


def test_full_disk_and_read_only_tier(tier_dirs, make_engine, small_tmpfs):
    size = 128 * KB
    dirs = [tier_dirs[0], os.path.join(small_tmpfs, "kv")]
    e = make_engine(dirs, reprobe_interval_s=60)  # capacity says 1 GB; the file system has 1 MB
    keys = [f"f{i}" for i in range(24)]
    write_all(e, keys, size)  # ENOSPC on the small tier part-way through
    st = e.stats().tiers[1]
    assert not e.tiers[1].up and ("ENOSPC" in st.errors or "ENOSPC" in e.tiers[1].down_reason
                                  or "space" in e.tiers[1].down_reason)
    assert all(e.tiers[0].has(fmt.key_digest(k)) for k in keys)
    check_all(e, keys, size)
    assert _files(dirs[1], "*.tmp") == []


def test_read_only_tier(tier_dirs, make_engine, small_tmpfs):
    dirs = [tier_dirs[0], os.path.join(small_tmpfs, "kv")]
    e = make_engine(dirs, reprobe_interval_s=60)
    write_all(e, ["before"], 16 * KB)
    subprocess.run(["mount", "-o", "remount,ro", small_tmpfs], check=True)
    write_all(e, ["after"], 16 * KB)
    assert not e.tiers[1].up
    assert e.tiers[0].has(fmt.key_digest("after"))
    check_all(e, ["before", "after"], 16 * KB)


def test_capacity_and_lru(tier_dirs, make_engine):
    size = 60 * KB
    fsize = fmt.file_size(size)
    cap_gb = 10 * fsize / (1 << 30)
    e = make_engine(tier_dirs[:1], cap0=cap_gb)
    t = e.tiers[0]
    write_all(e, [f"c{i}" for i in range(10)], size)
    assert len(t) == 10
    assert e.lookup_and_pin("test", ["c1"], expires=False) == [e.lookup("c1")]
    for i in range(10, 40):
        check_all(e, ["c0"], size)  # c0 is read before every write: never the LRU victim
        write_all(e, [f"c{i}"], size)
        assert t.used <= t.capacity + fsize
        assert len(_files(t.root)) <= 10
    present = {k for k in [f"c{i}" for i in range(40)] if t.has(fmt.key_digest(k))}
    # LRU keeps the chunk read all along (FIFO would have evicted it first), the pinned one,
    # and the most recent writes; nothing else
    assert present == {"c0", "c1"} | {f"c{i}" for i in range(32, 40)}, sorted(present)
    assert e.release("test", ["c1"]) == 1 and e.pinned() == 0


def test_chunk_being_read_is_not_evicted(tier_dirs, make_engine):
    size = 256 * KB
    fsize = fmt.file_size(size)
    slow = {"emulate": {"read_mbps": 1}}
    e = make_engine(tier_dirs[:1], tier_opts=[slow], cap0=4 * fsize / (1 << 30),
                    staging_budget_mb=1)
    write_all(e, ["hot"] + [f"x{i}" for i in range(3)], size)  # "hot" is the LRU victim
    (h,) = read_all(e, ["hot"])  # ~0.26 s on the emulated tier
    published: list[str] = []
    bufs = [AlignedBuffer(size) for _ in range(6)]
    for i, b in enumerate(bufs):  # 1.5 MB staged > 1 MB budget: some are written right away
        assert e.write(f"y{i}", b, size, b"", on_published=published.append)
    assert _eventually(lambda: len(published) >= 2, 5)
    assert not h.done(), "the read should still be in flight"
    assert e.tiers[0].has(fmt.key_digest("hot")), "evicted while being read"
    assert e.tiers[0].used <= e.tiers[0].capacity + fsize
    buf = h.wait(30)
    assert buf is not None and bytes(buf.view[:size]) == payload("hot", size)
    assert e.flush(30)


def test_writes_wait_for_reads(tier_dirs, make_engine):
    size = 64 * KB
    slow = {"emulate": {"read_mbps": 10}}
    e = make_engine(tier_dirs, tier_opts=[slow, slow])
    keys = [f"w{i}" for i in range(30)]
    write_all(e, keys, size)
    handles = read_all(e, keys)  # ~0.2 s of reads
    buf = AlignedBuffer(size)
    buf.view[:size] = payload("late", size)
    published = []
    assert e.write("late", buf, size, b"", on_published=published.append)
    time.sleep(0.05)
    assert e.writing("late") and not published, "write issued while reads were outstanding"
    for h in handles:
        assert h.wait(30) is not None
    assert e.flush(30) and published == ["late"]
    assert e.steps[-1].write_overlap_bytes == 0


def test_staging_budget_bounds_the_deferral(tier_dirs, make_engine):
    size = 1024 * KB
    slow = {"emulate": {"read_mbps": 5}}
    e = make_engine(tier_dirs, tier_opts=[slow, slow], staging_budget_mb=1)
    write_all(e, ["a", "b", "c", "d"], size)
    handles = read_all(e, ["a", "b", "c", "d"])
    big = [AlignedBuffer(size) for _ in range(3)]
    for i, b in enumerate(big):
        assert e.write(f"big{i}", b, size, b"")
    assert e.flush(30), "writes past the staging budget must not wait for the reads"
    for h in handles:
        assert h.wait(30) is not None
    assert e.stats().write_overlap_bytes > 0


def test_second_process_finds_chunks_on_a_shared_tier(tier_dirs, make_engine):
    """A chunk published by another engine after start is found through the file system."""
    a = make_engine(tier_dirs)
    b = make_engine([tier_dirs[1], tier_dirs[0] + "-b"], negative_cache_ms=0)
    assert b.lookup("late") is None
    write_all(a, ["late"], 8 * KB)
    check_all(b, ["late"], 8 * KB)


def test_temp_files_of_dead_writers_are_cleaned(tier_dirs):
    cfg = engine_config(tier_dirs)
    tmp = os.path.join(tier_dirs[0], "kvs1", "tmp")
    os.makedirs(tmp)
    from kvstream_backend.io.files import HOST

    dead = os.path.join(tmp, f"{HOST}.999999999.x.tmp")
    open(dead, "w").close()
    from kvstream_backend.engine import Engine

    e = Engine(cfg)
    assert not os.path.exists(dead)
    e.close()


def test_a_tier_root_missing_at_start_is_down_never_created_and_joins_later(tier_dirs):
    """An unmounted PFS at boot: the engine starts on the other tier, never creates the
    missing root (that would put the "PFS" tier on the root file system), and takes the tier
    in once the directory appears."""
    from kvstream_backend.config import parse_config
    from kvstream_backend.engine import Engine

    # on the same file system as tier 0, so that the probe owes both the same I/O path
    missing = os.path.join(os.path.dirname(tier_dirs[0]), "pfs-not-mounted-yet")
    cfg = parse_config({"kvstream.tiers": [
        {"name": "t0", "path": tier_dirs[0], "max_size_gb": 1},
        {"name": "t1", "path": missing, "max_size_gb": 1},
    ], "kvstream.reprobe_interval_s": 0.2}, check_paths=False)
    e = Engine(cfg)
    try:
        assert not e.tiers[1].up and "missing" in e.tiers[1].down_reason
        write_all(e, ["k0", "k1"], 8 * KB)
        check_all(e, ["k0", "k1"], 8 * KB)
        time.sleep(0.5)  # a few probe rounds
        assert not os.path.exists(missing), "a missing tier root was created"
        os.makedirs(missing)  # the file system is mounted
        assert _eventually(lambda: e.tiers[1].up), "the tier did not join"
        write_all(e, ["k2"], 8 * KB)
        assert e.tiers[1].has(fmt.key_digest("k2"))
        # probed when it joined: the path (io_uring or threads, O_DIRECT or not) the same
        # file system got at start
        io = [(t.io, t.direct) for t in e.stats().tiers]
        assert io[1] == io[0], io
    finally:
        e.close()


def test_replication_is_kept_a_lost_copy_returns_when_read_and_reads_refresh_every_tier(
        tier_dirs, make_engine):
    e = make_engine(tier_dirs, hedge=False)
    keys = [f"rep{i}" for i in range(6)]
    write_all(e, keys, 16 * KB)
    lost = fmt.key_digest("rep0")
    assert e.tiers[1].remove(lost)  # tier 1 evicted it (or was down when it was written)
    assert e.stats().tiers[1].replica_fraction == pytest.approx(5 / 6)
    check_all(e, ["rep0"], 16 * KB)  # served by tier 0, the only holder
    assert _eventually(lambda: e.tiers[1].has(lost)), "the lost copy was not re-made"
    src, dst = e.tiers[0].chunk_path(lost), e.tiers[1].chunk_path(lost)
    with open(src, "rb") as a, open(dst, "rb") as b:
        assert a.read() == b.read()
    st = e.stats()
    assert st.tiers[1].repaired == 1 and st.tiers[1].replica_fraction == 1.0
    # a read served by one tier refreshes the chunk's recency on every tier that holds it
    check_all(e, ["rep3"], 16 * KB)
    assert e.wait_idle(10)
    assert e.tiers[1].digests()[-1] == fmt.key_digest("rep3")
    assert e.tiers[0].digests()[-1] == fmt.key_digest("rep3")


def test_chunks_written_during_an_outage_return_to_the_tier_when_read(tier_dirs, make_engine):
    e = make_engine(tier_dirs, reprobe_interval_s=0.2)
    shutil.rmtree(tier_dirs[1])
    write_all(e, ["before-down"], 8 * KB)  # the failed write marks tier 1 down
    assert _eventually(lambda: not e.tiers[1].up)
    missed = [f"out{i}" for i in range(5)]
    write_all(e, missed, 8 * KB)  # tier 0 only
    os.makedirs(tier_dirs[1])
    assert _eventually(lambda: e.tiers[1].up), "tier not re-admitted"
    assert not any(e.tiers[1].has(fmt.key_digest(k)) for k in missed)
    check_all(e, missed, 8 * KB)
    assert _eventually(lambda: all(e.tiers[1].has(fmt.key_digest(k)) for k in missed))


def test_a_slow_tier_never_holds_back_the_fast_tiers_copies(tier_dirs, make_engine):
    slow = {"emulate": {"write_mbps": 0.25}}  # 64 KiB copies take 0.25 s each
    e = make_engine(tier_dirs, tier_opts=[{}, slow], write_queue_depth=2)
    keys = [f"v{i}" for i in range(16)]
    published: list[str] = []
    bufs = []
    for k in keys:
        b = AlignedBuffer(64 * KB)
        b.view[:] = payload(k, 64 * KB)
        bufs.append(b)
        assert e.write(k, b, 64 * KB, b"m", on_published=published.append)
    assert _eventually(lambda: len(published) == 16, timeout=3), published
    assert len(e.tiers[1]) < 8, "the slow tier should still be writing"
    assert e.flush(30)
    assert len(e.tiers[1]) == 16  # and it does get every chunk
    for b in bufs:
        b.release()


def test_an_emulated_tier_writes_at_its_throttle_replayed(tier_dirs, make_engine):
    """The bench's emulated write limit is the tier's throttle replayed over the chunk files
    (``emulate.serial_seconds``); the engine's copies draw the same rates (the throttle's time
    origin is its first op), so they take at least that long, and not much longer."""
    em = {"write_mbps": 4, "jitter": 0.35, "pattern": "bursty", "period_s": 0.2, "seed": 3}
    e = make_engine(tier_dirs, tier_opts=[{}, {"emulate": em}])
    size, n = 128 * KB, 16  # 2 MiB: ~0.5 s at 4 MiB/s
    replay = serial_seconds(tier_throttle(EmulateConfig(**em), 1, write=True),
                            [fmt.HEADER_SIZE + size] * n)
    t0 = time.monotonic()
    write_all(e, [f"t{i}" for i in range(n)], size)
    took = time.monotonic() - t0
    assert replay <= took <= 1.3 * replay + 0.1, (replay, took)


def test_staging_memory_is_bounded_shedding_lagging_copies_first(tier_dirs, make_engine):
    slow = {"emulate": {"write_mbps": 0.5}}
    e = make_engine(tier_dirs, tier_opts=[{}, slow], staging_budget_mb=1, write_queue_depth=2)
    size, n = 128 * KB, 32  # 4 MiB staged at once against a 1 MiB budget
    keys = [f"b{i}" for i in range(n)]
    bufs = []
    for k in keys:
        b = AlignedBuffer(size)
        b.view[:] = payload(k, size)
        bufs.append(b)
        assert e.write(k, b, size, b"m")  # never blocks, whatever the budget
    assert _eventually(lambda: e.stats().staged_bytes <= 2 << 20, timeout=1)
    assert e.flush(60)
    st = e.stats()
    # the lagging tier's copies are shed first; whole chunks are dropped only if the fast
    # tier too falls behind (how many depends on its speed, so no count is asserted)
    assert st.replicas_shed > 0
    assert st.writes_published + st.writes_dropped == n and st.writes_failed == 0
    kept = [k for k in keys if e.tiers[0].has(fmt.key_digest(k))]
    assert len(kept) == st.writes_published
    check_all(e, kept, size)  # everything acknowledged as published is whole
    assert st.tiers[1].replica_fraction < 1  # shed copies: re-made when read
    assert _eventually(lambda: e.stats().tiers[1].replica_fraction == 1.0, timeout=60)
    for b in bufs:
        b.release()


@pytest.mark.parametrize("step", ["create_temp", "publish"])
def test_an_unexpected_error_in_a_file_step_fails_that_copy_only(tier_dirs, make_engine,
                                                                 monkeypatch, step):
    """A copy's file steps run on its tier's file threads: an error nobody expected there
    (not an OSError) must still hand the copy back, or flush and close would wait forever."""
    from kvstream_backend.io import files

    real = getattr(files, step)

    def broken(*args, **kw):
        if tier_dirs[1] in str(args[0]):
            raise RuntimeError(f"injected failure in {step}")
        return real(*args, **kw)

    e = make_engine(tier_dirs)
    monkeypatch.setattr(files, step, broken)
    keys = [f"f{i}" for i in range(8)]
    write_all(e, keys, 20 * KB, timeout=30)  # drains: every copy came back
    assert all(e.tiers[0].has(fmt.key_digest(k)) for k in keys)
    assert not any(e.tiers[1].has(fmt.key_digest(k)) for k in keys)
    assert e.tiers[1].used == 0, "the failed copies' reservations were returned"
    assert not _files(tier_dirs[1], "*.tmp") and not _files(tier_dirs[1])
    check_all(e, keys, 20 * KB)
    t = time.monotonic()
    e.close()
    assert time.monotonic() - t < 10


def test_clear_removes_every_copy_on_every_tier(tier_dirs, make_engine):
    """SGLang's "flush the storage": every chunk file goes, on every tier, and lookups miss."""
    e = make_engine(tier_dirs)
    keys = [f"c{i}" for i in range(6)]
    write_all(e, keys, 16 * KB)
    paths = [t.chunk_path(fmt.key_digest(k)) for t in e.tiers for k in keys]
    assert all(os.path.exists(p) for p in paths)
    assert e.clear() == len(paths)
    assert not any(os.path.exists(p) for p in paths)
    assert all(e.lookup(k) is None for k in keys) and e.usage() == 0


def test_a_restarted_engine_starts_from_the_rates_its_predecessor_measured(tier_dirs,
                                                                          make_engine):
    """The slow tier listed first: a fresh engine lets it claim the front of its first pool
    (it knows no rates yet), so it starts reads that the fast tier then hedges. The router's
    estimates are kept per tier and host at close (``kvs1/rates/<host>-<hash>.json``); the next
    engine starts from them and gives the slow tier no read the fast one delivers sooner."""
    size = 64 * KB
    keys = [f"r{i}" for i in range(32)]
    slow = {"emulate": {"read_mbps": 1}}  # 64 ms a chunk, against well under 1 ms
    first = make_engine(tier_dirs, tier_opts=[slow, {}])
    write_all(first, keys, size)
    check_all(first, keys, size)
    assert first.wait_idle(10)
    assert first.stats().tiers[0].reads >= 2, "a fresh engine lets the first tier claim"
    first.close()
    memos = [rates.load(t.base, rt.setup) for t, rt in zip(first.tiers, first._tiers,
                                                          strict=True)]
    assert all(m is not None for m in memos), memos
    assert memos[0].read_bps * 10 < memos[1].read_bps  # type: ignore[union-attr]
    again = make_engine(tier_dirs, tier_opts=[slow, {}])
    check_all(again, keys, size)
    assert again.wait_idle(10)
    assert [t.reads for t in again.stats().tiers] == [0, len(keys)]


def test_a_rate_memo_is_only_a_hint(tier_dirs, make_engine, kvlog):
    """A torn memo is ignored (and named in the log), one made under another set-up (here an
    emulated rate) is not used, and ``remember_rates: false`` neither reads nor writes one."""
    size = 16 * KB
    keys = [f"k{i}" for i in range(16)]
    e = make_engine(tier_dirs, hedge=False)
    write_all(e, keys, size)
    check_all(e, keys, size)  # both tiers read (from opposite ends): both measured
    e.close()
    (t0, t1), (rt0, rt1) = e.tiers, e._tiers
    path = rates.memo_path(t0.base, rt0.setup)
    with open(path, "r+b") as f:
        f.truncate(5)
    assert rates.load(t1.base, rt1.setup) is not None
    again = make_engine(tier_dirs, tier_opts=[{}, {"emulate": {"read_mbps": 100}}])
    assert path in kvlog.text and "ignoring the read-rate memo" in kvlog.text
    assert again._reads.router.estimate(0) is None and again._reads.router.estimate(1) is None
    assert again._tiers[1].setup != rt1.setup
    check_all(again, keys, size)
    again.close()
    os.unlink(path)
    off = make_engine(tier_dirs, remember_rates=False)
    assert off._reads.router.estimate(1) is None
    check_all(off, keys, size)
    off.close()
    assert not os.path.exists(path)
    # the emulated engine kept its own memo beside the real one's
    assert len(os.listdir(os.path.dirname(rates.memo_path(t1.base, rt1.setup)))) == 2


def test_a_memo_that_cannot_be_saved_costs_only_the_hint(tier_dirs, make_engine, kvlog):
    """``kvs1/rates`` is not a directory (as a broken or read-only mount would refuse it): the
    close logs the path it could not write and finishes; the chunks are all there."""
    size = 16 * KB
    keys = [f"s{i}" for i in range(8)]
    e = make_engine(tier_dirs)
    write_all(e, keys, size)
    check_all(e, keys, size)
    blocker = os.path.join(e.tiers[0].base, rates.DIR)
    with open(blocker, "w"):
        pass
    e.close()
    assert "cannot save the read-rate memo" in kvlog.text and blocker in kvlog.text
    assert e.stats().writes_published == len(keys)
    again = make_engine(tier_dirs)
    check_all(again, keys, size)
