"""``kvstream soak``: mixed writes and pooled reads over two tiers while faults are injected.

Faults hit one copy (one tier) at a time: a payload bit flip, a header bit flip, truncation,
deletion, another key's file swapped in, a symlink planted to a valid copy outside the tier,
a directory planted at a chunk path, and a whole-tier outage (the tier directory vanishes for
a few seconds, as a dead mount does, then comes back). Every chunk read is checked byte for byte
against its key's deterministic payload.

At the end the faults stop, every tier is restored and re-admitted, and every chunk whose write
was acknowledged (its publish callback fired) is read once more. ``lost`` counts those that are
not served although an undamaged copy exists; ``wrong_bytes`` counts chunks served with bytes
that differ from what was written. Both must be 0.
"""

from __future__ import annotations

import functools
import hashlib
import os
import random
import shutil
import tempfile
import threading
import time
from collections import Counter
from collections.abc import Callable
from typing import Any

import msgspec

from . import format as fmt
from .config import parse_config
from .engine import Engine, ReadRequest, payload_view
from .io.memory import AlignedBuffer

FAULTS = ["payload-bitflip", "header-bitflip", "truncate", "delete", "swap", "symlink-out",
          "directory", "tier-outage"]


class SoakReport(msgspec.Struct):
    seconds: float
    operations: dict[str, int]
    faults: dict[str, int]
    chunks_acknowledged: int
    misses_during_run: int
    final_misses_expected: int  # acknowledged chunks whose every copy a fault destroyed
    lost: int
    wrong_bytes: int
    leaked_buffers: int  # read buffers the engine never gave back
    quarantined: dict[str, int]
    tier_errors: dict[str, int]


class _Tracked(AlignedBuffer):
    """An AlignedBuffer that counts how many are alive (allocated and not released)."""

    live = 0
    _lock = threading.Lock()

    def __init__(self, size: int) -> None:
        super().__init__(size)
        with _Tracked._lock:
            _Tracked.live += 1

    def release(self) -> None:
        with _Tracked._lock:
            _Tracked.live -= 1
        super().release()


def payload(key: str, size: int) -> bytes:
    seed = hashlib.blake2b(key.encode(), digest_size=32).digest()
    return (seed * (size // 32 + 1))[:size]


class Soak:
    def __init__(self, root: str, seed: int, chunk_bytes: int) -> None:
        self.rng = random.Random(seed)
        self.size = chunk_bytes
        self.dirs = [os.path.join(root, "t0"), os.path.join(root, "t1")]
        self.outside = os.path.join(root, "outside")
        os.makedirs(self.outside, exist_ok=True)
        cfg = parse_config({
            "kvstream.tiers": [{"name": f"t{i}", "path": d, "max_size_gb": 64}
                               for i, d in enumerate(self.dirs)],
            "kvstream.reprobe_interval_s": 0.5,
            "kvstream.negative_cache_ms": 0,
            "kvstream.max_chunk_mb": max(1, 2 * chunk_bytes >> 20),
        })
        self.engine = Engine(cfg)
        self.ops: Counter[str] = Counter()
        self.faults: Counter[str] = Counter()
        self.acked: set[str] = set()
        self.damaged: set[tuple[str, int]] = set()  # (key, tier) copies a fault destroyed
        self.lock = threading.Lock()
        self.misses = 0
        self.wrong = 0
        self.seq = 0
        self.pending = 0
        self.away: list[tuple[float, int]] = []  # (restore time, tier) for outages
        self.next_outage = 0.0

    # ---- operations -----------------------------------------------------------------------
    def write_burst(self) -> None:
        if self.pending > 256:  # backpressure, as LMCache's bounded CPU memory would apply
            self.engine.flush(60)
        bufs = []
        for _ in range(self.rng.randint(1, 8)):
            key = f"soak-{self.seq}"
            self.seq += 1
            buf = AlignedBuffer(self.size)
            buf.view[: self.size] = payload(key, self.size)
            bufs.append(buf)
            with self.lock:
                self.pending += 1
            self.engine.write(key, buf, self.size, b"soak", on_published=self._acked,
                              on_done=functools.partial(self._written, buf))
        self.ops["write"] += len(bufs)

    def _acked(self, key: str) -> None:
        with self.lock:
            self.acked.add(key)

    def _written(self, buf: AlignedBuffer) -> None:
        buf.release()
        with self.lock:
            self.pending -= 1

    def read_step(self, keys: list[str] | None = None) -> int:
        """Read ``keys`` (default: a random sample) in one pool; return the misses."""
        with self.lock:
            pool = sorted(self.acked)
        if keys is None:
            keys = self.rng.sample(pool, min(len(pool), self.rng.randint(1, 32)))
        reqs, misses = [], 0
        for k in keys:
            info = self.engine.lookup(k)
            if info is None:
                misses += 1
                continue
            reqs.append(ReadRequest(info, _Tracked(info.payload_len), _Tracked))
        for h in self.engine.read(reqs):
            buf = h.wait(60)
            if buf is None:
                misses += 1
                continue
            if bytes(payload_view(buf.addr, self.size)) != payload(h.key, self.size):
                self.wrong += 1
            buf.release()
        self.ops["read"] += len(keys)
        self.misses += misses
        return misses

    # ---- faults ---------------------------------------------------------------------------
    def inject(self) -> None:
        kind = self.rng.choice(FAULTS)
        t = self.rng.randrange(2)
        if kind == "tier-outage":
            if self.away or time.monotonic() < self.next_outage:
                return  # one outage at a time (a copy stays reachable), then a quiet spell
            os.rename(self.dirs[t], self.dirs[t] + ".away")
            back = time.monotonic() + self.rng.uniform(0.3, 1.5)
            self.away.append((back, t))
            self.next_outage = back + 5.0
            self.faults[kind] += 1
            return
        if any(tier == t for _, tier in self.away):
            return
        with self.lock:
            candidates = [k for k in self.acked if (k, 0) not in self.damaged
                          and (k, 1) not in self.damaged]
        if len(candidates) < 2:
            return
        key, other = self.rng.sample(candidates, 2)
        twin = self.engine.tiers[1 - t].chunk_path(fmt.key_digest(key))
        if not os.path.isfile(twin):
            return  # only one copy exists (its twin's tier was down): keep it intact
        path = self.engine.tiers[t].chunk_path(fmt.key_digest(key))
        try:
            self._damage(kind, path,
                         self.engine.tiers[t].chunk_path(fmt.key_digest(other)))
        except FileNotFoundError:
            return  # not written to this tier (e.g. it was down at the time)
        with self.lock:
            self.damaged.add((key, t))
        self.faults[kind] += 1

    def _damage(self, kind: str, path: str, other: str) -> None:
        if kind in ("payload-bitflip", "header-bitflip"):
            off = fmt.HEADER_SIZE + self.rng.randrange(self.size) if kind[0] == "p" else \
                self.rng.randrange(56)
            with open(path, "r+b") as f:
                f.seek(off)
                b = f.read(1)
                f.seek(off)
                f.write(bytes([b[0] ^ (1 << self.rng.randrange(8))]))
        elif kind == "truncate":
            os.truncate(path, self.rng.randrange(os.path.getsize(path)))
        elif kind == "delete":
            os.unlink(path)
        elif kind == "swap":
            shutil.copyfile(other, path + ".swap")
            os.replace(path + ".swap", path)
        elif kind == "symlink-out":
            dst = os.path.join(self.outside, os.path.basename(path))
            shutil.copyfile(path, dst)
            os.unlink(path)
            os.symlink(dst, path)
        elif kind == "directory":
            os.unlink(path)
            os.mkdir(path)

    def restore_due(self, force: bool = False) -> None:
        now = time.monotonic()
        for when, t in list(self.away):
            if force or when <= now:
                os.rename(self.dirs[t] + ".away", self.dirs[t])
                self.away.remove((when, t))

    # ---- driver ---------------------------------------------------------------------------
    def run(self, seconds: float,
            progress: Callable[[float], None] | None = None) -> SoakReport:
        t0 = time.monotonic()
        while time.monotonic() - t0 < seconds:
            self.restore_due()
            r = self.rng.random()
            if r < 0.45:
                self.write_burst()
            elif r < 0.9:
                self.read_step()
            else:
                self.inject()
            if progress is not None:
                progress(time.monotonic() - t0)
        self.restore_due(force=True)
        self.engine.flush(120)
        deadline = time.monotonic() + 30
        while not all(t.up for t in self.engine.tiers) and time.monotonic() < deadline:
            time.sleep(0.1)
        with self.lock:
            acked = sorted(self.acked)
            destroyed = {k for k in acked if (k, 0) in self.damaged and (k, 1) in self.damaged}
        lost = 0
        for i in range(0, len(acked), 64):
            batch = [k for k in acked[i : i + 64] if k not in destroyed]
            lost += self.read_step(batch)
        self.engine.wait_idle(60)
        st = self.engine.stats()
        self.engine.close()
        quarantined: Counter[str] = Counter()
        errors: Counter[str] = Counter()
        for t in st.tiers:
            quarantined.update(t.quarantined)
            errors.update(t.errors)
        return SoakReport(
            round(time.monotonic() - t0, 1), dict(self.ops), dict(self.faults), len(acked),
            self.misses - lost, len(destroyed), lost, self.wrong, _Tracked.live,
            dict(quarantined), dict(errors),
        )


def main(minutes: float, seed: int, chunk_kb: int, json_out: str | None, workdir: str) -> int:
    from rich.console import Console
    from rich.progress import Progress

    console = Console()
    root = tempfile.mkdtemp(prefix="kvstream-soak-", dir=workdir)
    try:
        soak = Soak(root, seed, chunk_kb << 10)
        with Progress(console=console, transient=True) as prog:
            task = prog.add_task("soak", total=minutes * 60)
            rep = soak.run(minutes * 60, lambda s: prog.update(task, completed=s))
    finally:
        shutil.rmtree(root, ignore_errors=True)
    render(rep, seed, console)
    if json_out:
        with open(json_out, "wb") as f:
            f.write(msgspec.json.format(msgspec.json.encode(rep)))
    ok = rep.lost == 0 and rep.wrong_bytes == 0 and rep.leaked_buffers == 0
    console.print("[green]PASS[/]: nothing lost, no wrong bytes" if ok else "[red]FAIL[/]")
    return 0 if ok else 1


def render(rep: SoakReport, seed: int, console: Any) -> None:
    from .tables import table

    t = table(f"kvstream soak: {rep.seconds:.0f} s, seed {seed}", "count", "value")
    for k, v in rep.operations.items():
        t.add_row(f"operations: {k}", str(v))
    for k in FAULTS:
        t.add_row(f"faults: {k}", str(rep.faults.get(k, 0)))
    for k, v in (("acknowledged chunks", rep.chunks_acknowledged),
                 ("misses during the run", rep.misses_during_run),
                 ("chunks whose every copy a fault destroyed", rep.final_misses_expected),
                 ("chunks lost", rep.lost), ("wrong bytes (chunks)", rep.wrong_bytes),
                 ("leaked read buffers", rep.leaked_buffers)):
        t.add_row(k, str(v))
    t.add_row("quarantined", str(sum(rep.quarantined.values())))
    console.print(t)
