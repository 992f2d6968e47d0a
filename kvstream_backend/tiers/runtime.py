"""A tier at run time: its directory, probed I/O path, worker thread, meter and health.

Health: a tier that errors is marked down (reads fail over, writes skip it); every
``reprobe_interval_s`` a probe thread checks it (same file system as at start, or a remount that
still holds the layout; never the empty mount point of a dead mount) and it is re-admitted.
"""

from __future__ import annotations

import errno
import functools
import logging
import os
import threading
from collections.abc import Callable

import msgspec

from ..config import KVStreamConfig, TierConfig
from ..io import files
from ..io.ops import IoQueue, Waker
from ..io.probe import IoPath, QueueFactory, probe
from ..io.threads import Workers
from ..stats import TierInfo
from .accounting import TierMeter
from .jobs import Job
from .tier import Tier
from .worker import TierWorker

log = logging.getLogger("kvstream")


class TierRuntime:
    """A tier and its mechanism. ``worker`` is None while the tier has never been opened (its
    root was missing at start); :meth:`start` creates it once a probe succeeds."""

    def __init__(self, tier: Tier, path: IoPath,
                 make_worker: Callable[[IoPath], TierWorker]) -> None:
        self.tier = tier
        self.path = path
        self.worker: TierWorker | None = None
        self._make_worker = make_worker
        self.meter = TierMeter(tier.name)
        self.dev: int | None = None  # the root's file system, once it was opened
        self.next_probe = 0.0
        self.probing = False

    @property
    def direct(self) -> bool:
        return self.path.direct

    @property
    def setup(self) -> str:
        """What a read rate measured on this tier depends on besides the device: the I/O path
        and an emulated bandwidth (see :mod:`kvstream_backend.tiers.rates`)."""
        emulate = self.tier.cfg.emulate
        return (f"{self.path.kind},{'direct' if self.path.direct else 'buffered'},"
                f"{msgspec.json.encode(emulate).decode() if emulate else 'real'}")

    @property
    def io(self) -> TierWorker:
        """The worker of a tier that is up (an up tier has always been started)."""
        assert self.worker is not None, f"tier {self.tier.name} was never started"
        return self.worker

    def start(self, path: IoPath) -> None:
        """Run the tier on ``path``: remember its file system and start its worker."""
        self.path = path
        self.tier.direct = path.direct
        self.dev = os.stat(self.tier.root).st_dev
        if self.worker is None:
            self.worker = self._make_worker(path)


def open_tier(index: int, tc: TierConfig, cfg: KVStreamConfig, queues: QueueFactory,
              deliver: Callable[[Job], None], evictable: Callable[[bytes], bool],
              verify: Workers) -> TierRuntime:
    """Open a tier's directory, probe its I/O path and start its worker.

    A tier whose root is missing (a file system not mounted yet) starts *down* and is probed
    again later; its root is never created, so nothing lands on the file system underneath.
    """
    tier = Tier(tc, file_mode=cfg.file_mode, dir_mode=cfg.dir_mode,
                negative_ms=cfg.negative_cache_ms)

    def make_worker(path: IoPath) -> TierWorker:
        readers, cpus = cfg.io_threads, None
        if path.kind == "threads" and files.memory_backed(tier.root):
            # a read from memory is a copy by its reader thread (which also hashes it): one
            # reader per core by default (on a 16-core host, tmpfs with 4 readers: 0.30x the
            # plain limit; with 8: 0.53x; with 16: 0.54-0.71x; docs/benchmarks.md). Sixteen
            # copying on 16 cores also slow LMCache's host->GPU scatters: fifteen kept off
            # one core spared them, twelve anywhere did not make the step faster (stops 39,
            # 41), so ``copy_threads`` and ``spare_cores`` are left to the user
            readers, cpus = cfg.memory_readers, cfg.copy_cpus

        def make(waker: Waker) -> tuple[IoQueue, IoQueue]:
            rq = queues(path.kind, cfg.read_queue_depth, readers, waker, f"{tc.name}-r", cpus)
            try:
                wq = queues(path.kind, cfg.write_queue_depth, cfg.io_threads, waker,
                            f"{tc.name}-w")
            except BaseException:
                rq.close()
                raise
            return rq, wq

        return TierWorker(index, tier, path.direct, cfg, make, deliver, evictable, verify)

    try:
        tier.open()
    except FileNotFoundError:
        log.error("kvstream tier %s: root %s is missing; the tier is DOWN until it appears "
                  "(it is never created)", tc.name, tier.root)
        rt = TierRuntime(tier, IoPath("threads", False, "tier root missing"),
                         make_worker)
        tier.mark_down("tier root missing")
        return rt
    path = probe(tier.tmp_dir, tc.io, tc.direct, cfg.file_mode)
    log.info("kvstream tier %s (%s): capacity %.1f GB, io=%s direct=%s (%s); %s%s", tc.name,
             tier.root, tc.capacity_bytes / 2**30, path.kind, path.direct, path.reason,
             path.inline_issue, " EMULATED bandwidth" if tc.emulate else "")
    rt = TierRuntime(tier, path, make_worker)
    rt.start(path)
    return rt


def probe_again(rt: TierRuntime, cfg: KVStreamConfig,
                done: Callable[[IoPath | None], None]) -> None:
    """Probe a down tier on a thread of its own; ``done(path or None)`` is called from it."""

    def run() -> None:
        path = None
        try:
            # Same file system as at start, or a remount that still holds our layout; never
            # the empty mount point of a dead mount (that would fill the disk underneath).
            if (rt.dev is not None and os.stat(rt.tier.root).st_dev != rt.dev
                    and not os.path.isdir(rt.tier.base)):
                raise OSError(errno.ENODEV, "tier root is an empty, different file system")
            rt.tier.open()
            tc = rt.tier.cfg
            io, direct = tc.io, tc.direct
            if rt.worker is not None:  # keep the path the worker runs
                io, direct = rt.path.kind, "on" if rt.path.direct else "off"
            path = probe(rt.tier.tmp_dir, io, direct, cfg.file_mode)
        except Exception as e:  # noqa: BLE001 - any failure keeps the tier down
            log.info("kvstream: tier %s still down: %s", rt.tier.name, e)
        done(path)

    threading.Thread(target=run, daemon=True, name=f"kvstream-probe-{rt.tier.name}").start()


class Health:
    """Marks tiers down and re-admits them: runs on the completion loop. A down tier is probed
    every ``reprobe_interval_s`` on a thread of its own (:func:`probe_again`), whose outcome
    comes back through ``post``. ``on_down(index, now)`` fails over its reads; ``on_up()`` runs
    when a tier is re-admitted."""

    def __init__(self, tiers: list[TierRuntime], cfg: KVStreamConfig, clock: Callable[[], float],
                 post: Callable[[Callable[[float], None]], None],
                 on_down: Callable[[int, float], None], on_up: Callable[[], None]) -> None:
        self._tiers = tiers
        self._cfg = cfg
        self._clock = clock
        self._post = post
        self._on_down = on_down
        self._on_up = on_up
        self.stopping = False  # set by the engine's close: a late probe re-admits nothing

    def all_up(self) -> bool:
        return all(rt.tier.up for rt in self._tiers)

    def down(self, ti: int, reason: str) -> None:
        rt = self._tiers[ti]
        if not rt.tier.up:
            return
        log.error("kvstream: tier %s marked DOWN (%s); serving from the other tiers",
                  rt.tier.name, reason)
        rt.tier.mark_down(reason)
        now = self._clock()
        rt.next_probe = now + self._cfg.reprobe_interval_s
        self._on_down(ti, now)

    def reprobe(self, now: float) -> None:
        for rt in self._tiers:
            if rt.tier.up or rt.probing or now < rt.next_probe:
                continue
            rt.probing = True
            probe_again(rt, self._cfg, functools.partial(self._probe_done, rt))

    def _probe_done(self, rt: TierRuntime, path: IoPath | None) -> None:
        """Called on the probe's thread: hand the outcome to the loop."""
        self._post(lambda now: self._probed(rt, path, now))

    def _probed(self, rt: TierRuntime, path: IoPath | None, now: float) -> None:
        rt.probing = False
        if path is None or self.stopping:
            rt.next_probe = now + self._cfg.reprobe_interval_s
            return
        if rt.worker is None:
            log.warning("kvstream tier %s: root appeared; io=%s direct=%s", rt.tier.name,
                        path.kind, path.direct)
            rt.start(path)
        rt.tier.mark_up()
        log.warning("kvstream: tier %s is healthy again; re-admitted", rt.tier.name)
        self._on_up()


def tier_infos(tiers: list[TierRuntime], now: float) -> list[TierInfo]:
    """Each tier's state and counters, for :meth:`Engine.stats`."""
    out = []
    held = [set(rt.tier.digests()) for rt in tiers]
    for i, rt in enumerate(tiers):
        t, m = rt.tier, rt.meter
        others = set().union(*(h for j, h in enumerate(held) if j != i))
        out.append(TierInfo(
            t.name, t.root, rt.path.kind, rt.path.direct, rt.path.reason, t.up,
            t.down_reason, len(t), t.used, t.capacity, t.cfg.emulate is not None,
            m.bytes, m.write_bytes, dict(t.counters.quarantined), t.counters.evicted,
            t.counters.capacity_skips, dict(m.error_kinds), rt.path.inline_issue,
            m.snapshot(now).busy_s, m.repaired,
            len(held[i] & others) / len(others) if others else 1.0,
            m.reads, m.lost, m.read_s,
        ))
    return out
