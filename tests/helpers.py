"""Test helpers: deterministic payloads and write/read round trips through an engine."""

from __future__ import annotations

import os
import socket
import subprocess
import time
import urllib.request

from kvstream_backend.engine import Engine, ReadHandle, ReadRequest
from kvstream_backend.io.memory import AlignedBuffer
from kvstream_backend.soak import payload  # deterministic, key-specific bytes

__all__ = ["payload", "write_all", "read_all", "check_all", "eventually", "free_port",
           "chunk_files", "wait_serving"]


def write_all(engine: Engine, keys: list[str], size: int, timeout: float = 120) -> None:
    bufs = []
    for k in keys:
        b = AlignedBuffer(size)
        b.view[:size] = payload(k, size)
        bufs.append(b)
        assert engine.write(k, b, size, k.encode()[:64])
    assert engine.flush(timeout), "writes did not drain"
    for b in bufs:
        b.release()


def read_all(engine: Engine, keys: list[str]) -> list[ReadHandle]:
    reqs = []
    for k in keys:
        info = engine.lookup(k)
        assert info is not None, f"{k} not found"
        reqs.append(ReadRequest(info, AlignedBuffer(info.payload_len), AlignedBuffer))
    return engine.read(reqs)


def check_all(engine: Engine, keys: list[str], size: int, timeout: float = 60) -> None:
    """Read ``keys`` in one pool and assert every chunk comes back byte-identical."""
    for h in read_all(engine, keys):
        buf = h.wait(timeout)
        assert buf is not None, f"{h.key}: miss ({h.reason})"
        assert bytes(buf.view[:size]) == payload(h.key, size), f"{h.key}: wrong bytes"
        buf.release()


def eventually(pred, timeout: float = 10.0) -> bool:
    """Poll ``pred`` until it holds or ``timeout`` passes; its last value."""
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        if pred():
            return True
        time.sleep(0.02)
    return pred()


def free_port() -> int:
    """A TCP port free on 127.0.0.1 now (for servers the tests start)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def chunk_files(root: str) -> list[str]:
    """The published chunk files under a tier root."""
    return [os.path.join(d, f) for d, _, fs in os.walk(os.path.join(root, "kvs1", "chunks"))
            for f in fs if f.endswith(".kvs")]


def wait_serving(proc: subprocess.Popen, url: str, timeout: float) -> str:
    """Poll ``url`` until the server ``proc`` answers: "" then, else why not (it exited, or
    it did not answer within ``timeout`` seconds)."""
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        if proc.poll() is not None:
            return f"exited {proc.returncode} at start"
        try:
            urllib.request.urlopen(url, timeout=2)
            return ""
        except OSError:
            time.sleep(0.5)
    return f"not up after {timeout:.0f} s"
