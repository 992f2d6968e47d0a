"""Small plain file functions used by tiers; every path they get is already confined to a tier.

None of them follows a symlink at the final path component (``O_NOFOLLOW``), so a link planted
where a chunk should be is refused rather than read or written through.
"""

from __future__ import annotations

import contextlib
import errno
import mmap
import os
import re
import socket
import stat
import threading
import uuid

_RD = os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC | os.O_NONBLOCK  # never block on a FIFO
_WR = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC


def open_read(path: str, direct: bool) -> int:
    """Open a chunk file for reading; anything but a regular file raises ``EISDIR``/``ELOOP``."""
    try:
        fd = os.open(path, _RD | (os.O_DIRECT if direct else 0))
    except OSError as e:  # O_DIRECT on a directory is EINVAL: report what is really wrong
        if e.errno == errno.EINVAL and not stat.S_ISREG(os.lstat(path).st_mode):
            raise OSError(errno.EISDIR, "not a regular file", path) from None
        raise
    if not stat.S_ISREG(os.fstat(fd).st_mode):
        os.close(fd)
        raise OSError(errno.EISDIR, "not a regular file", path)
    return fd


_OCTAL = re.compile(r"\\([0-7]{3})")
MEMORY_FS = frozenset({"tmpfs", "ramfs"})  # every read is a copy out of memory


def fs_type(path: str) -> str:
    """The type of the file system ``path`` is on (``tmpfs``, ``ext4``, ``fuse.glusterfs``...),
    from the longest mount point above it in ``/proc/self/mountinfo`` (the last mounted, where
    several share it); "" if unknown."""
    target = os.path.realpath(path)
    best, kind = -1, ""
    try:
        with open("/proc/self/mountinfo", encoding="utf-8", errors="replace") as f:
            for line in f:
                fields = line.split()
                if "-" not in fields[6:]:
                    continue
                sep = fields.index("-", 6)
                point = _OCTAL.sub(lambda m: chr(int(m[1], 8)), fields[4])  # "\040": space
                inside = target == point or target.startswith(point.rstrip("/") + "/")
                if inside and len(point) >= best and sep + 1 < len(fields):
                    best, kind = len(point), fields[sep + 1]
    except OSError:
        return ""
    return kind


def memory_backed(path: str) -> bool:
    """Whether ``path`` is on a file system in memory (tmpfs, ramfs): a read there is a copy
    by the CPU that runs it, so it scales with cores, not with a device's queue."""
    return fs_type(path) in MEMORY_FS


def read_head(path: str, n: int, direct: bool) -> bytes:
    """The first ``n`` (aligned) bytes of a chunk file, without readahead or cache pollution."""
    fd = open_read(path, direct)
    try:
        if not direct:
            os.posix_fadvise(fd, 0, n, os.POSIX_FADV_RANDOM)
            return os.pread(fd, n, 0)
        buf = mmap.mmap(-1, n)
        try:
            got = os.preadv(fd, [buf], 0)
            return bytes(buf[:got])
        finally:
            buf.close()
    finally:
        close(fd, drop_pages=not direct)


# Temporary files are named HOST.PID.UUID.tmp, so a process can tell its own dead writers' files
# (same host, PID not running) from live writers' on a tier shared with other processes/nodes.
HOST = socket.gethostname().replace(".", "_")


def temp_owner(name: str) -> tuple[str, int | None]:
    """``(host, pid)`` of a temporary file name (pid None if the name is not ours)."""
    host, _, rest = name.partition(".")
    pid = rest.partition(".")[0]
    return host, int(pid) if pid.isdigit() else None


def create_temp(tmp_dir: str, mode: int, direct: bool) -> tuple[int, str]:
    """Create a new, exclusive temporary file under ``tmp_dir``; return ``(fd, path)``."""
    path = os.path.join(tmp_dir, f"{HOST}.{os.getpid()}.{uuid.uuid4().hex}.tmp")
    fd = os.open(path, _WR | (os.O_DIRECT if direct else 0), mode)
    return fd, path


def copy(src: int, dst: int, size: int, block: int) -> int:
    """Copy ``size`` bytes from ``src`` to ``dst`` (in the kernel where it can); return the
    bytes copied (fewer only if ``src`` is shorter)."""
    done = 0
    while done < size:
        try:
            n = os.copy_file_range(src, dst, min(block, size - done), done, done)
        except OSError as e:
            if e.errno not in (errno.EXDEV, errno.EINVAL, errno.EOPNOTSUPP, errno.ENOSYS):
                raise
            data = os.pread(src, min(block, size - done), done)
            n = os.pwrite(dst, data, done) if data else 0
        if n == 0:
            break
        done += n
    return done


def publish(tmp_path: str, final_path: str) -> bool:
    """Hard-link ``tmp_path`` to ``final_path`` and drop the temporary name.

    Returns True if this call published the file, False if another writer got there first
    (first writer wins; readers only ever see a complete file under the final name).
    """
    try:
        os.link(tmp_path, final_path)
        won = True
    except FileExistsError:
        won = False
    finally:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp_path)
    return won


def close(fd: int, *, drop_pages: bool) -> int:
    """Close ``fd`` (with ``drop_pages``, first evict its pages from the cache).

    Never raises: returns 0, or the errno ``close`` reported (a dead network mount reports
    ENOTCONN or EIO here). Linux releases the descriptor either way; for a write the error
    means the data may not have reached the file system.
    """
    if drop_pages:
        with contextlib.suppress(OSError):
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    try:
        os.close(fd)
    except OSError as e:
        return e.errno or errno.EIO
    return 0


def unlink_quiet(path: str) -> None:
    with contextlib.suppress(FileNotFoundError):
        os.unlink(path)


def replace_whole(path: str, data: bytes, mode: int) -> None:
    """Make ``path`` hold ``data``, whole or not at all: written to a temporary name beside it
    (this process's and thread's), then renamed over it. On failure the temporary file is
    removed and the error raised."""
    tmp = f"{path}.{os.getpid()}.{threading.get_ident()}.tmp"
    try:
        with open(os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW
                          | os.O_CLOEXEC, mode), "wb") as f:
            f.write(data)
        os.replace(tmp, path)
    except OSError:
        with contextlib.suppress(OSError):  # missing, or the mount that failed the write
            os.unlink(tmp)
        raise


def errname(code: int) -> str:
    """``ENOENT`` for 2: the name counters and logs use for an errno."""
    return errno.errorcode.get(code, f"errno{code}")


# errno values that mean "this file is gone or is not ours", as opposed to "the tier is sick".
FILE_LEVEL_ERRNOS = frozenset({errno.ENOENT, errno.ELOOP, errno.EISDIR, errno.ENOTDIR})


def drop_caches() -> bool:
    """Drop the page cache if allowed (root; benchmarks between phases); False when not."""
    try:
        os.sync()
        with open("/proc/sys/vm/drop_caches", "w") as f:
            f.write("3\n")
        return True
    except OSError:
        return False
