"""Fault injection: writers killed with SIGKILL, nodes sharing a tier, a short soak."""

from __future__ import annotations

import glob
import os
import random
import subprocess
import sys
import threading
import time
from pathlib import Path

from kvstream_backend import format as fmt
from kvstream_backend.soak import Soak

from .conftest import engine_config
from .helpers import payload
from .procs import CRASH_BURST, SIZE

REPO = Path(__file__).resolve().parent.parent


def _spawn(*args: str) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", "tests.procs", *args], cwd=REPO,
                            stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)


def _chunk_files(d: str) -> list[str]:
    return glob.glob(os.path.join(d, "kvs1", "chunks", "*", "*", "*.kvs"))


def test_sigkilled_writer_loses_nothing_acknowledged(tier_dirs) -> None:
    """>= 20 writers killed with SIGKILL at random points, over >= 200 write bursts."""
    from kvstream_backend.engine import Engine

    from .helpers import check_all

    rng = random.Random(11)
    acked: set[str] = set()
    known: dict[bytes, str] = {}  # every key a killed writer may have staged
    bursts = kills = 0
    while bursts < 200 or kills < 20:
        first = kills * 100_000
        p = _spawn("crash-writer", *tier_dirs, str(first))
        lines: list[str] = []
        reader = threading.Thread(target=lines.extend, args=(p.stdout,), daemon=True)
        reader.start()
        time.sleep(rng.uniform(0.3, 1.0))  # startup is ~0.3 s: the kill lands mid-bursts
        p.kill()
        p.wait()
        reader.join(10)
        kills += 1
        done = sum(1 for x in lines if x.startswith("BURST"))
        bursts += done
        acked |= {x.split()[1] for x in lines if x.startswith("PUB")}
        known |= {fmt.key_digest(f"crash-{n}"): f"crash-{n}"
                  for n in range(first, first + (done + 1) * CRASH_BURST)}
        e = Engine(engine_config(tier_dirs))
        try:
            for d in tier_dirs:  # the dead writer's temp files are gone
                assert glob.glob(os.path.join(d, "kvs1", "tmp", "*")) == []
            check_all(e, sorted(acked), SIZE)  # every acknowledged chunk is still served
            visible = {bytes.fromhex(os.path.basename(f)[:32]) for d in tier_dirs
                       for f in _chunk_files(d)}
            assert visible <= set(known), "a file that no writer could have published"
            # published but not yet acknowledged when the writer died: whole and valid too
            check_all(e, [known[d] for d in visible if known[d] not in acked], SIZE)
        finally:
            e.close()
    assert len(acked) > 0


def test_a_hung_file_step_does_not_hold_process_exit(tier_dirs) -> None:
    """A copy whose file creation never returns (a dead hard mount) costs the close its bounded
    wait; the process still exits, and the other tier's copy was published."""
    p = _spawn("hung-exit", *tier_dirs)
    try:
        out, _ = p.communicate(timeout=60)
    except subprocess.TimeoutExpired:
        p.kill()
        out, _ = p.communicate()
        raise AssertionError(f"the process did not exit: {out!r}") from None
    assert p.returncode == 0, out
    lines = out.split()
    assert "HUNG" in lines and "CLOSED" in lines and "hung-0" in lines, out
    assert len(_chunk_files(tier_dirs[0])) == 1 and not _chunk_files(tier_dirs[1])


def test_four_nodes_share_a_tier(tmp_path, tier_dirs) -> None:
    shared = tier_dirs[1]
    n = 120
    procs = [_spawn("share", str(tmp_path / f"node{i}"), shared, str(i), str(n), "6")
             for i in range(4)]
    for p in procs:
        out, _ = p.communicate(timeout=300)
        assert p.returncode == 0, out
        _, reads, wrong, _misses = out.strip().splitlines()[-1].split()
        assert int(reads) > 0 and int(wrong) == 0
    files = _chunk_files(shared)
    assert len(files) == n, "exactly one file per key on the shared tier"
    assert glob.glob(os.path.join(shared, "kvs1", "tmp", "*")) == []
    keys = {fmt.key_digest(f"shared-{i}"): f"shared-{i}" for i in range(n)}
    for f in files:  # and each one is complete, valid and holds its key's bytes
        data = Path(f).read_bytes()
        digest = bytes.fromhex(os.path.basename(f)[:32])
        h = fmt.decode_header(data[: fmt.HEADER_SIZE], digest, 1 << 20)
        body = data[fmt.HEADER_SIZE : fmt.HEADER_SIZE + SIZE]
        fmt.verify_payload(h, [memoryview(body)])
        assert body == payload(keys[digest], SIZE)


def test_short_soak(tmp_path) -> None:
    rep = Soak(str(tmp_path), seed=3, chunk_bytes=64 * 1024).run(25)
    assert rep.wrong_bytes == 0 and rep.lost == 0 and rep.leaked_buffers == 0
    assert sum(rep.faults.values()) >= 10 and rep.chunks_acknowledged > 100
    assert sum(rep.quarantined.values()) > 0


def test_files_mode_is_configurable(tier_dirs) -> None:
    from kvstream_backend.engine import Engine

    from .helpers import write_all

    e = Engine(engine_config(tier_dirs, file_mode=0o640, dir_mode=0o750))
    try:
        write_all(e, ["m"], 4096)
        (f,) = _chunk_files(tier_dirs[0])
        assert os.stat(f).st_mode & 0o777 == 0o640
        assert os.stat(os.path.dirname(f)).st_mode & 0o777 == 0o750
    finally:
        e.close()
