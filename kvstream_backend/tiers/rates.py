"""Each tier's read rate as the last process on this host measured it, kept in the tier.

A fresh engine knows nothing of its tiers' speeds: until the first reads complete, the order the
tiers are listed in decides which one claims the front of the pool, and a slow tier listed first
holds the first requests' chunks through the first step of every process. The router's rate and
chunk-size estimates at close are written here and seed the next engine's router, so after the
first run on a host the order in the YAML does not matter from the first step on.

Layout: ``kvs1/rates/<host>-<set-up hash>.json`` under the tier root, one file per host (a tier
on a shared file system is read at a different rate by each node) and I/O set-up (the I/O path,
an emulated rate: :attr:`~kvstream_backend.tiers.runtime.TierRuntime.setup`), written to a
temporary name and renamed into place; never through a symlink. The memo is a hint: a missing,
torn or nonsensical file is ignored (logged unless missing), and a stale one is corrected by the
router's first measurements like any wrong estimate.
"""

from __future__ import annotations

import contextlib
import errno
import logging
import math
import os
import stat

import msgspec
import xxhash

from ..io import files

log = logging.getLogger("kvstream")

DIR = "rates"
PRUNE_S = 30 * 86400.0  # memos of any host not rewritten for this long are removed on save
MAX_BYTES = 4096  # a memo is a few hundred bytes; more is not one


class RateMemo(msgspec.Struct, forbid_unknown_fields=True, frozen=True):
    """One host's measurement of one tier: read throughput (bytes/s, with the reads it kept in
    flight) and mean chunk size (bytes); ``setup`` names what the rate depends on besides the
    device (the I/O path, an emulation), and ``saved_unix`` when it was written."""

    read_bps: float
    chunk_bytes: float
    setup: str
    saved_unix: float


def memo_path(base: str, setup: str) -> str:
    """This host's memo file for ``setup`` under a tier's layout directory ``base``
    (``<root>/kvs1``)."""
    return os.path.join(base, DIR, f"{files.HOST}-{xxhash.xxh32_hexdigest(setup.encode())}.json")


def load(base: str, setup: str) -> RateMemo | None:
    """This host's memo for the tier under ``setup``, if there is a usable one."""
    path = memo_path(base, setup)
    try:
        with open(os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC), "rb") as f:
            memo = msgspec.json.decode(f.read(MAX_BYTES), type=RateMemo)
    except FileNotFoundError:
        return None
    except (OSError, msgspec.DecodeError) as e:
        log.warning("kvstream: ignoring the read-rate memo %s: %s", path, e)
        return None
    if memo.setup != setup or not (_usable(memo.read_bps) and _usable(memo.chunk_bytes)):
        log.warning("kvstream: ignoring the read-rate memo %s: it holds %s", path, memo)
        return None
    return memo


def _usable(x: float) -> bool:
    return 0 < x < math.inf


def save(base: str, memo: RateMemo, dir_mode: int, file_mode: int) -> None:
    """Write this host's memo atomically; prune memos nobody rewrote for :data:`PRUNE_S`. A
    failure (full disk, a read-only or dead mount) is logged: the memo is only a hint."""
    d = os.path.join(base, DIR)
    path = memo_path(base, memo.setup)
    try:
        with contextlib.suppress(FileExistsError):
            os.mkdir(d, dir_mode)
        if not stat.S_ISDIR(os.lstat(d).st_mode):  # never through a symlink
            raise NotADirectoryError(errno.ENOTDIR, "not a directory", d)
        files.replace_whole(path, msgspec.json.encode(memo), file_mode)
        _prune(d, memo.saved_unix)
    except OSError as e:
        log.warning("kvstream: cannot save the read-rate memo %s: %s", path, e)


def _prune(d: str, now: float) -> None:
    with os.scandir(d) as it:
        for de in it:
            with contextlib.suppress(OSError):
                if now - de.stat(follow_symlinks=False).st_mtime > PRUNE_S:
                    files.unlink_quiet(de.path)
