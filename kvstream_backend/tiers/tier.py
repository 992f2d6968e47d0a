"""A storage tier: one directory, its chunk index, its byte capacity and its health.

Layout under the tier root (content-addressed; no key text ever appears in a path)::

    kvs1/chunks/ab/cd/<32 hex digest>.kvs   published chunks (0600, directories 0700)
    kvs1/tmp/<host>.<pid>.<uuid>.tmp        writes in progress (published by hard link)
    kvs1/quarantine/<digest>.<reason>       files that failed validation, moved aside
    kvs1/rates/<host>-<hash>.json           read rates measured here (:mod:`.rates`), a hint

Invariants: a path is only ever derived from a 16-byte digest; the index holds only regular
files found under ``chunks/`` (never through a symlink); ``used`` is the sum of indexed file
sizes; eviction is LRU and never removes an entry for which ``evictable(digest)`` is False.
Thread-safe: index operations take the tier lock; file I/O is done by callers outside it.
"""

from __future__ import annotations

import collections
import contextlib
import os
import stat
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from ..config import TierConfig
from ..format import HEADER_SIZE, CorruptChunk, Header, decode_header
from ..io import files

LAYOUT = "kvs1"
SUFFIX = ".kvs"
STALE_TEMP_S = 3600.0


@dataclass
class Entry:
    size: int  # bytes on disk
    header: Header | None = None  # loaded lazily (entries found by a scan or another process)


@dataclass
class TierCounters:
    quarantined: dict[str, int] = field(default_factory=lambda: collections.defaultdict(int))
    evicted: int = 0
    discovered: int = 0
    temp_cleaned: int = 0
    capacity_skips: int = 0


class Tier:
    def __init__(self, cfg: TierConfig, *, file_mode: int, dir_mode: int, negative_ms: int):
        self.cfg = cfg
        self.name = cfg.name
        self.capacity = cfg.capacity_bytes
        self.file_mode = file_mode
        self.dir_mode = dir_mode
        self.root = os.path.realpath(cfg.path)
        self.base = os.path.join(self.root, LAYOUT)
        self.chunks_dir = os.path.join(self.base, "chunks")
        self.tmp_dir = os.path.join(self.base, "tmp")
        self.quarantine_dir = os.path.join(self.base, "quarantine")
        self._negative_s = negative_ms / 1000.0
        self._lock = threading.Lock()
        self._index: collections.OrderedDict[bytes, Entry] = collections.OrderedDict()
        self._negative: dict[bytes, float] = {}
        self._made_dirs: set[str] = set()
        self.used = 0
        self.direct = False  # read headers with O_DIRECT (set once the I/O path is probed)
        self.up = True
        self.down_reason = ""
        self.counters = TierCounters()

    # ---- start-up -------------------------------------------------------------------------
    def open(self) -> None:
        """Create the layout, clean temp files of dead writers and rebuild the index.

        The tier root itself must exist: it is never created here, so a vanished mount point
        is an error rather than a fresh directory on the file system underneath.
        """
        if not os.path.isdir(self.root):
            raise FileNotFoundError(2, "tier root is missing", self.root)
        for d in (self.base, self.chunks_dir, self.tmp_dir, self.quarantine_dir):
            self._mkdir(d)
        self._made_dirs.clear()
        self._clean_temps()
        self.rescan()

    def _mkdir(self, path: str) -> None:
        with contextlib.suppress(FileExistsError):
            os.mkdir(path, self.dir_mode)

    def _clean_temps(self) -> None:
        now = time.time()
        with os.scandir(self.tmp_dir) as it:
            for de in it:
                host, pid = files.temp_owner(de.name)
                mine_dead = host == files.HOST and pid is not None and not _pid_alive(pid)
                try:
                    stale = now - de.stat(follow_symlinks=False).st_mtime > STALE_TEMP_S
                except FileNotFoundError:
                    continue
                if mine_dead or stale or not de.is_file(follow_symlinks=False):
                    files.unlink_quiet(de.path)
                    self.counters.temp_cleaned += 1

    def rescan(self) -> None:
        """Rebuild the index from the files under ``chunks/`` (LRU order = mtime order)."""
        found: list[tuple[float, bytes, int]] = []
        for d1 in _subdirs(self.chunks_dir):
            for d2 in _subdirs(d1):
                with os.scandir(d2) as it:
                    for de in it:
                        digest = _digest_of(de.name)
                        if digest is None or not de.is_file(follow_symlinks=False):
                            continue
                        st = de.stat(follow_symlinks=False)
                        found.append((st.st_mtime, digest, st.st_size))
        found.sort()
        with self._lock:
            self._index.clear()
            self.used = 0
            for _, digest, size in found:
                self._index[digest] = Entry(size)
                self.used += size

    # ---- paths ----------------------------------------------------------------------------
    def chunk_path(self, digest: bytes) -> str:
        h = digest.hex()
        return os.path.join(self.chunks_dir, h[:2], h[2:4], h + SUFFIX)

    def ensure_parent(self, digest: bytes) -> str:
        """Return the chunk path, creating its two fan-out directories (``dir_mode``) if needed.

        Only those two levels are ever created: if ``chunks/`` is gone, this raises.
        """
        path = self.chunk_path(digest)
        parent = os.path.dirname(path)
        if parent not in self._made_dirs:
            self._mkdir(os.path.dirname(parent))
            self._mkdir(parent)
            self._made_dirs.add(parent)
        return path

    # ---- index ----------------------------------------------------------------------------
    def has(self, digest: bytes) -> bool:
        with self._lock:
            return digest in self._index

    def get(self, digest: bytes) -> Entry | None:
        """Index lookup; on a miss, look for a file another process published (cached misses)."""
        with self._lock:
            e = self._index.get(digest)
            if e is not None:
                return e
            exp = self._negative.get(digest)
            if exp is not None and exp > time.monotonic():
                return None
        path = self.chunk_path(digest)
        try:
            st = os.lstat(path)
        except OSError:
            st = None
        ok = st is not None and stat.S_ISREG(st.st_mode) and _confined(path, self.root)
        with self._lock:
            if not ok:
                if self._negative_s > 0:
                    if len(self._negative) > 100_000:
                        self._negative.clear()
                    self._negative[digest] = time.monotonic() + self._negative_s
                return None
            assert st is not None
            e = self._index.get(digest)
            if e is None:
                e = self._index[digest] = Entry(st.st_size)
                self.used += st.st_size
                self.counters.discovered += 1
            return e

    def load_header(self, digest: bytes, entry: Entry, max_payload: int) -> Header | None:
        """Make sure ``entry.header`` is loaded and valid; quarantine and return None if not."""
        if entry.header is not None:
            return entry.header
        try:
            buf = files.read_head(self.chunk_path(digest), HEADER_SIZE, self.direct)
        except FileNotFoundError:
            self.discard(digest)
            return None
        except OSError:
            buf = b""
        try:
            header = decode_header(buf, digest, max_payload)
            if entry.size < HEADER_SIZE + header.payload_len:
                raise CorruptChunk("truncated", f"file {entry.size} bytes")
        except CorruptChunk as e:
            self.quarantine(digest, e.reason)
            return None
        entry.header = header
        return header

    def touch(self, digest: bytes) -> None:
        with self._lock:
            if digest in self._index:
                self._index.move_to_end(digest)

    def discard(self, digest: bytes) -> bool:
        """Forget ``digest`` (its file vanished or was moved aside); True if it was indexed."""
        with self._lock:
            e = self._index.pop(digest, None)
            if e is not None:
                self.used -= e.size
        return e is not None

    def quarantine(self, digest: bytes, reason: str) -> None:
        """Move a file that failed validation aside (never served again) and count it.

        Only the caller that removes the index entry acts, and it moves the file before a
        concurrent lookup can rediscover it, so concurrent detections of the same bad file (a
        lookup and the header warm-up) count it once.
        """
        dst = os.path.join(self.quarantine_dir, f"{digest.hex()}.{reason}.{os.getpid()}")
        with self._lock:
            e = self._index.pop(digest, None)
            if e is None:
                return
            self.used -= e.size
            self.counters.quarantined[reason] += 1
            try:
                os.rename(self.chunk_path(digest), dst)
            except OSError:
                files.unlink_quiet(self.chunk_path(digest))
            if self._negative_s > 0:
                self._negative[digest] = time.monotonic() + self._negative_s

    def reserve(self, size: int, evictable: Callable[[bytes], bool]) -> bool:
        """Account ``size`` bytes for a write in progress, evicting LRU entries to make room.

        Returns False (nothing evicted, nothing reserved) if the room cannot be made without
        evicting an entry for which ``evictable`` is False (pinned or being read). Every True
        must be followed by :meth:`commit` or :meth:`unreserve` of the same size, so ``used``
        never exceeds the capacity by more than the file being published.
        """
        victims: list[bytes] = []
        with self._lock:
            need = self.used + size - self.capacity
            if need > 0:
                for digest, e in self._index.items():
                    if evictable(digest):
                        victims.append(digest)
                        need -= e.size
                        if need <= 0:
                            break
                if need > 0:
                    self.counters.capacity_skips += 1
                    return False
                for digest in victims:
                    self.used -= self._index.pop(digest).size
            self.used += size
        for digest in victims:
            files.unlink_quiet(self.chunk_path(digest))
        self.counters.evicted += len(victims)
        return True

    def unreserve(self, size: int) -> None:
        with self._lock:
            self.used -= size

    def commit(self, digest: bytes, size: int, header: Header | None) -> None:
        """Index a file published under a reservation of ``size`` bytes."""
        with self._lock:
            old = self._index.pop(digest, None)
            if old is not None:
                self.used -= old.size
            self._index[digest] = Entry(size, header)
            self._negative.pop(digest, None)

    def remove(self, digest: bytes) -> bool:
        """Delete ``digest``'s file; True if it was indexed."""
        with self._lock:
            e = self._index.pop(digest, None)
            if e is not None:
                self.used -= e.size
        files.unlink_quiet(self.chunk_path(digest))
        return e is not None

    def digests(self) -> list[bytes]:
        with self._lock:
            return list(self._index)

    def cold(self) -> list[tuple[bytes, Entry]]:
        """Indexed entries whose header is not loaded yet, most recently used first."""
        with self._lock:
            return [(d, e) for d, e in reversed(self._index.items()) if e.header is None]

    def __len__(self) -> int:
        with self._lock:
            return len(self._index)

    # ---- health ---------------------------------------------------------------------------
    def mark_down(self, reason: str) -> None:
        self.up = False
        self.down_reason = reason

    def mark_up(self) -> None:
        self.up = True
        self.down_reason = ""


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _subdirs(path: str) -> list[str]:
    try:
        with os.scandir(path) as it:
            return [de.path for de in it if de.is_dir(follow_symlinks=False) and len(de.name) == 2]
    except FileNotFoundError:
        return []


def _digest_of(name: str) -> bytes | None:
    if len(name) != 32 + len(SUFFIX) or not name.endswith(SUFFIX):
        return None
    with contextlib.suppress(ValueError):
        return bytes.fromhex(name[:32])
    return None


def _confined(path: str, root: str) -> bool:
    """True if ``path`` resolves (all symlinks followed) to itself under ``root``."""
    return os.path.realpath(path) == path and path.startswith(root + os.sep)
