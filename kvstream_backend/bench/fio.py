"""The device limit: fio reading the very chunk files kvstream wrote (io_uring, O_DIRECT)."""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import subprocess
import tempfile


def available() -> bool:
    return shutil.which("fio") is not None


def read_files(files: list[str], block: int, depth: int, workdir: str) -> tuple[float, int]:
    """Read ``files`` once with fio; return (seconds, bytes).

    fio takes the files through ``--opendir`` on a directory of hard links made in ``workdir``
    (same file system as the files): its ``--filename`` list is limited to 4096 characters and
    ``--opendir`` skips symlinks.
    """
    with tempfile.TemporaryDirectory(prefix="fio-", dir=workdir) as d:
        for i, f in enumerate(files):
            os.link(f, os.path.join(d, f"{i:06d}"))
        cmd = [
            "fio", "--name=kvstream-chunks", "--rw=read", f"--bs={block}", "--direct=1",
            "--ioengine=io_uring", f"--iodepth={depth}", "--output-format=json",
            "--file_service_type=sequential", f"--opendir={d}",
        ]
        out = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
        if out.returncode != 0:
            raise RuntimeError(f"fio failed: {out.stderr.strip()[-500:]}")
    job = json.loads(out.stdout[out.stdout.index("{"):])["jobs"][0]["read"]
    if not job["io_bytes"] or not job["bw_bytes"]:
        raise RuntimeError(f"fio read nothing from {len(files)} files (block {block} bytes)")
    return job["io_bytes"] / job["bw_bytes"], int(job["io_bytes"])


def write_files(workdirs: list[str], size: int, block: int, depth: int) -> list[tuple[float, int]]:
    """Write ``size`` bytes to a new file in each of ``workdirs`` with fio (io_uring, O_DIRECT),
    one job per directory, all at once; return (seconds, bytes) per directory. One directory
    gives its tier's write limit; several give each tier's limit while the others are written
    too (the limit of replication where tiers share CPUs or a disk). The files are removed."""
    with contextlib.ExitStack() as stack:
        cmd = ["fio", "--rw=write", f"--bs={block}", "--direct=1", "--ioengine=io_uring",
               f"--iodepth={depth}", "--output-format=json", f"--size={size}",
               "--end_fsync=1"]
        for i, w in enumerate(workdirs):
            d = stack.enter_context(tempfile.TemporaryDirectory(prefix="fio-w-", dir=w))
            cmd += [f"--name=kvstream-write-{i}", f"--filename={os.path.join(d, 'w')}"]
        out = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
        if out.returncode != 0:
            raise RuntimeError(f"fio failed: {out.stderr.strip()[-500:]}")
    jobs = json.loads(out.stdout[out.stdout.index("{"):])["jobs"]
    return [(j["write"]["io_bytes"] / j["write"]["bw_bytes"], int(j["write"]["io_bytes"]))
            for j in jobs]
