"""The device limit: fio reading the very chunk files kvstream wrote (io_uring, O_DIRECT)."""

from __future__ import annotations

import json
import shutil
import subprocess


def available() -> bool:
    return shutil.which("fio") is not None


def read_files(files: list[str], block: int, depth: int) -> tuple[float, int]:
    """Read ``files`` once with fio; return (seconds, bytes)."""
    cmd = [
        "fio", "--name=kvstream-chunks", "--rw=read", f"--bs={block}", "--direct=1",
        "--ioengine=io_uring", f"--iodepth={depth}", "--output-format=json",
        "--file_service_type=sequential", "--filename=" + ":".join(f.replace(":", "\\:")
                                                                   for f in files),
    ]
    out = subprocess.run(cmd, capture_output=True, text=True, check=True, timeout=600)
    job = json.loads(out.stdout)["jobs"][0]["read"]
    return job["runtime"] / 1000.0, int(job["io_bytes"])
