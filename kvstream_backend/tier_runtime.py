"""A tier at run time: its directory, probed I/O path, worker thread, meter and health.

Health: a tier that errors is marked down (reads fail over, writes skip it); every
``reprobe_interval_s`` a probe thread checks it (same file system as at start, or a remount that
still holds the layout; never the empty mount point of a dead mount) and it is re-admitted.
"""

from __future__ import annotations

import errno
import logging
import os
import threading
from collections.abc import Callable

from .accounting import TierMeter
from .config import KVStreamConfig, TierConfig
from .io.ops import IoQueue, Waker
from .io.probe import IoPath, QueueFactory, probe
from .tier import Tier
from .tier_worker import Job, TierWorker

log = logging.getLogger("kvstream")


class TierRuntime:
    def __init__(self, index: int, tier: Tier, path: IoPath, worker: TierWorker) -> None:
        self.index = index
        self.tier = tier
        self.path = path
        self.worker = worker
        self.meter = TierMeter(tier.name)
        self.dev = os.stat(tier.root).st_dev
        self.next_probe = 0.0
        self.probing = False

    @property
    def direct(self) -> bool:
        return self.path.direct


def open_tier(index: int, tc: TierConfig, cfg: KVStreamConfig, queues: QueueFactory,
              deliver: Callable[[Job], None], evictable: Callable[[bytes], bool]) -> TierRuntime:
    """Open a tier's directory, probe its I/O path and start its worker."""
    tier = Tier(tc, file_mode=cfg.file_mode, dir_mode=cfg.dir_mode,
                negative_ms=cfg.negative_cache_ms)
    tier.open()
    path = probe(tier.tmp_dir, tc.io, tc.direct, cfg.file_mode)
    tier.direct = path.direct
    log.info("kvstream tier %s (%s): io=%s direct=%s (%s); %s%s", tc.name, tier.root, path.kind,
             path.direct, path.reason, path.inline_issue,
             " EMULATED bandwidth" if tc.emulate else "")

    def make(waker: Waker) -> tuple[IoQueue, IoQueue]:
        rq = queues(path.kind, cfg.read_queue_depth, cfg.io_threads, waker, f"{tc.name}-r")
        try:
            wq = queues(path.kind, cfg.write_queue_depth, cfg.io_threads, waker, f"{tc.name}-w")
        except BaseException:
            rq.close()
            raise
        return rq, wq

    worker = TierWorker(index, tier, path.direct, cfg, make, deliver, evictable)
    return TierRuntime(index, tier, path, worker)


def probe_again(rt: TierRuntime, cfg: KVStreamConfig, done: Callable[[bool], None]) -> None:
    """Probe a down tier on a thread of its own; ``done(ok)`` is called from that thread."""

    def run() -> None:
        ok = False
        try:
            # Same file system as at start, or a remount that still holds our layout; never
            # the empty mount point of a dead mount (that would fill the disk underneath).
            if os.stat(rt.tier.root).st_dev != rt.dev and not os.path.isdir(rt.tier.base):
                raise OSError(errno.ENODEV, "tier root is an empty, different file system")
            rt.tier.open()
            probe(rt.tier.tmp_dir, rt.path.kind, "on" if rt.path.direct else "off",
                  cfg.file_mode)
            ok = True
        except Exception as e:  # noqa: BLE001 - any failure keeps the tier down
            log.info("kvstream: tier %s still down: %s", rt.tier.name, e)
        done(ok)

    threading.Thread(target=run, daemon=True, name=f"kvstream-probe-{rt.tier.name}").start()
