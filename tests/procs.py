"""Worker processes for the reliability tests (``python -m tests.procs ROLE ...``).

``crash-writer D0 D1 FIRST``: writes bursts of chunks to two tiers forever, printing
``BURST n`` when a burst is staged and ``PUB key`` when a chunk's first copy is published (the
acknowledgement), until it is killed.

``share D0 SHARED ID N ROUNDS``: one of several "nodes" sharing tier SHARED: writes the same N
keys as the others and reads them back repeatedly; prints ``RESULT reads wrong misses``.
"""

from __future__ import annotations

import sys
import threading

from kvstream_backend.config import parse_config
from kvstream_backend.engine import Engine, ReadRequest, payload_view
from kvstream_backend.engine import core as engine_mod
from kvstream_backend.io import files
from kvstream_backend.io.memory import AlignedBuffer

from .helpers import payload

SIZE = 64 * 1024
CRASH_BURST = 16  # chunks per burst of the crash writer


def _engine(dirs: list[str]) -> Engine:
    return Engine(parse_config({
        "kvstream.tiers": [{"name": f"t{i}", "path": d, "max_size_gb": 4}
                           for i, d in enumerate(dirs)],
        "kvstream.negative_cache_ms": 0,
    }))


def crash_writer(d0: str, d1: str, first: int) -> None:
    e = _engine([d0, d1])
    out = sys.stdout
    n, burst = first, 0
    while True:
        for _ in range(CRASH_BURST):
            key = f"crash-{n}"
            n += 1
            buf = AlignedBuffer(SIZE)
            buf.view[:SIZE] = payload(key, SIZE)
            e.write(key, buf, SIZE, b"", on_published=lambda k: (out.write(f"PUB {k}\n"),
                                                                  out.flush()))
        burst += 1
        out.write(f"BURST {burst}\n")
        out.flush()
        e.flush(30)


def share(d0: str, shared: str, ident: int, n: int, rounds: int) -> None:
    e = _engine([d0, shared])
    keys = [f"shared-{i}" for i in range(n)]
    bufs = []
    for k in keys[ident::2] + keys[(ident + 1) % 2::2]:  # overlapping, in different orders
        b = AlignedBuffer(SIZE)
        b.view[:SIZE] = payload(k, SIZE)
        bufs.append(b)
        e.write(k, b, SIZE, b"")
    e.flush(60)  # own writes published; the other nodes may still be writing theirs
    reads = wrong = misses = 0
    for _ in range(rounds):
        reqs = []
        for k in keys:
            info = e.lookup(k)
            if info is None:
                misses += 1
                continue
            reqs.append(ReadRequest(info, AlignedBuffer(SIZE), None))
        for h in e.read(reqs):
            buf = h.wait(60)
            reads += 1
            if buf is None:
                misses += 1
            elif bytes(payload_view(buf.addr, SIZE)) != payload(h.key, SIZE):
                wrong += 1
    e.flush(60)
    e.close()
    print(f"RESULT {reads} {wrong} {misses}", flush=True)


def hung_exit(d0: str, hung: str) -> None:
    create_temp = files.create_temp

    def blocking(tmp_dir: str, *args: object) -> tuple[int, str]:
        if tmp_dir.startswith(hung):
            print("HUNG", flush=True)
            threading.Event().wait()  # as open(2) in D state on a dead hard mount
        return create_temp(tmp_dir, *args)  # type: ignore[arg-type]

    e = _engine([d0, hung])  # (its start-up probe writes a file: hang only after it)
    files.create_temp = blocking
    engine_mod.IO_DRAIN_S = 1.0
    buf = AlignedBuffer(SIZE)
    buf.view[:SIZE] = payload("hung-0", SIZE)
    e.write("hung-0", buf, SIZE, b"", on_published=lambda k: print(f"PUB {k}", flush=True))
    e.close(timeout=1.0)
    print("CLOSED", flush=True)


if __name__ == "__main__":
    role, *args = sys.argv[1:]
    if role == "crash-writer":
        crash_writer(args[0], args[1], int(args[2]))
    elif role == "hung-exit":
        hung_exit(args[0], args[1])
    else:
        share(args[0], args[1], int(args[2]), int(args[3]), int(args[4]))
