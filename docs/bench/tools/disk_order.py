"""Does the order of reads change what a plain O_DIRECT reader gets from a disk? (stdlib only)

Usage: ``python disk_order.py DIR [FILES] [MIB] [ROUNDS]`` (defaults 128 x 32 MiB, 2 rounds).
Writes FILES files of MIB MiB into DIR one after another (names are random hex, as kvstream's
chunk digests are), reads them all once, then per round and thread count reads them in three
orders, page cache dropped before each: ``written`` (the order they were written), ``walk``
(``os.walk``'s, as the bench's limit reader lists them) and ``shuffled``. Prints GB/s.
"""

from __future__ import annotations

import mmap
import os
import random
import shutil
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor


def drop_caches() -> None:
    os.sync()
    with open("/proc/sys/vm/drop_caches", "w") as f:
        f.write("3\n")


def read_all(paths: list[str], size: int, threads: int) -> float:
    local = threading.local()

    def one(p: str) -> int:
        buf = getattr(local, "buf", None)
        if buf is None:
            buf = local.buf = mmap.mmap(-1, size)
        fd = os.open(p, os.O_RDONLY | os.O_DIRECT)
        try:
            return os.preadv(fd, [buf], 0)
        finally:
            os.close(fd)

    drop_caches()
    with ThreadPoolExecutor(threads) as pool:
        t0 = time.perf_counter()
        n = sum(pool.map(one, paths))
        return n / (time.perf_counter() - t0) / 1e9


def main() -> None:
    root = sys.argv[1]
    n = int(sys.argv[2]) if len(sys.argv) > 2 else 128
    size = (int(sys.argv[3]) if len(sys.argv) > 3 else 32) << 20
    rounds = int(sys.argv[4]) if len(sys.argv) > 4 else 2
    shutil.rmtree(root, ignore_errors=True)
    os.makedirs(root)
    buf = mmap.mmap(-1, size)
    written = []
    t0 = time.perf_counter()
    for _ in range(n):
        buf[:64] = os.urandom(64)
        p = os.path.join(root, os.urandom(16).hex() + ".kvs")
        fd = os.open(p, os.O_WRONLY | os.O_CREAT | os.O_DIRECT, 0o600)
        os.pwritev(fd, [buf], 0)
        os.fsync(fd)
        os.close(fd)
        written.append(p)
    print(f"wrote {n * size / 1e9:.1f} GB in {time.perf_counter() - t0:.1f} s", flush=True)
    walk = [os.path.join(d, f) for d, _, fs in os.walk(root) for f in fs]
    shuffled = random.Random(0).sample(written, len(written))
    print(f"warm-up pass (written order, 4 threads): {read_all(written, size, 4):.2f} GB/s")
    for r in range(rounds):
        for t in (1, 4, 16):
            got = {name: read_all(paths, size, t) for name, paths in
                   (("written", written), ("walk", walk), ("shuffled", shuffled))}
            print(f"round {r} threads {t:2d}: " + ", ".join(f"{k} {v:.2f}" for k, v in got.items()),
                  flush=True)
    shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    main()
