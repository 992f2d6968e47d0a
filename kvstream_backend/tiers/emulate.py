"""Bandwidth emulation for tests and benchmarks (the per-tier ``emulate`` option).

Off by default and kept apart from the real path: the engine asks a :class:`Throttle` *when*
an op that really completed may be reported complete. The tier is modelled as one device that
moves bytes serially at a (fluctuating) rate, so a claim of ``m`` parallel reads takes ``m``
times as long as one, as on a bandwidth-bound network file system. A throttle's rates are a
function of its seed and of the time since its first op, so :func:`serial_seconds` replays the
emulated device's limit for given bytes (what fio would measure, if it could see the throttle).
"""

from __future__ import annotations

import math
import random
from collections.abc import Iterable

from ..config import EmulateConfig

MIB = 1 << 20


class Throttle:
    def __init__(self, mbps: float, cfg: EmulateConfig, salt: int = 0) -> None:
        self.rate = mbps * MIB
        self.cfg = cfg
        self._rng = random.Random(cfg.seed * 1000003 + salt)
        self._busy_until = 0.0
        self._high = True
        self._switch_at = 0.0
        self._t0: float | None = None  # the first op's start: the rates' time origin

    def rate_at(self, now: float) -> float:
        """Bytes per second the emulated tier delivers at ``now``."""
        if self._t0 is None:
            self._t0 = now
        now -= self._t0
        j, c = self.cfg.jitter, self.cfg
        if c.pattern == "periodic":
            return self.rate * (1 + j * math.sin(2 * math.pi * now / c.period_s))
        if c.pattern == "bursty":
            while now >= self._switch_at:
                self._high = not self._high
                self._switch_at = max(now, self._switch_at) + self._rng.expovariate(1 / c.period_s)
            return self.rate * (1 + j if self._high else 1 - j)
        return self.rate * (1 + j * self._rng.uniform(-1, 1))

    def release_at(self, t_submit: float, t_done: float, nbytes: int) -> float:
        """When an op of ``nbytes`` submitted at ``t_submit`` (really done at ``t_done``) ends."""
        start = max(t_submit, self._busy_until)
        end = max(t_done, start + nbytes / self.rate_at(start))
        self._busy_until = end
        return end


def tier_throttle(cfg: EmulateConfig, index: int, write: bool) -> Throttle | None:
    """The throttle of tier ``index``'s writes (or reads); None where that direction runs free.
    Each tier and direction draws from its own random stream, the same for the same arguments."""
    mbps = cfg.write_mbps if write else cfg.read_mbps
    return Throttle(mbps, cfg, 2 * index + write) if mbps else None


def serial_seconds(throttle: Throttle, sizes: Iterable[int]) -> float:
    """Seconds a fresh ``throttle``'s device takes to move ops of ``sizes`` back to back: the
    emulated tier's limit for those bytes, whatever the file system under it does."""
    t = 0.0
    for n in sizes:
        t = throttle.release_at(t, t, n)
    return t
