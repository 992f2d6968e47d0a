"""Shared fixtures. Tests use real files, real io_uring and real LMCache; nothing is mocked."""

from __future__ import annotations

import os

for _k, _v in {
    "LMCACHE_TRACK_USAGE": "false",
    "DO_NOT_TRACK": "1",
    "VLLM_NO_USAGE_STATS": "1",
    "PYTHONHASHSEED": "0",
}.items():
    os.environ.setdefault(_k, _v)

import logging  # noqa: E402
import shutil  # noqa: E402
import subprocess  # noqa: E402
import sys  # noqa: E402
import uuid  # noqa: E402
from collections.abc import Callable, Iterator  # noqa: E402

import pytest  # noqa: E402

from kvstream_backend.config import parse_config  # noqa: E402
from kvstream_backend.engine import Engine  # noqa: E402
from kvstream_backend.io.probe import binding_usable  # noqa: E402

# `tox -e races`: the interpreter switches threads every microsecond instead of every 5 ms,
# so a field that two threads touch without its owner's lock shows up as a failure.
if os.environ.get("KVSTREAM_SWITCH_INTERVAL"):
    sys.setswitchinterval(float(os.environ["KVSTREAM_SWITCH_INTERVAL"]))

URING_OK, URING_WHY = binding_usable()
# The liburing wheel is built with AVX-512 and dies with SIGILL on CPUs without it (the probe
# tries it in a child process); tests that insist on io_uring are then skipped, visibly.
requires_uring = pytest.mark.skipif(not URING_OK, reason=f"io_uring unusable here: {URING_WHY}")

BENCH_GPU = [sys.executable, "-c", "import sys; from kvstream_backend.cli import main; "
             "sys.exit(main(sys.argv[1:]))", "bench", "--gpu"]


@pytest.fixture
def dry_bench(tmp_path) -> Iterator[Callable[..., subprocess.CompletedProcess]]:
    """``run(args, timeout)``: ``kvstream bench --gpu ARGS`` with ``KVSTREAM_GPU_DRY=1`` (a torch
    copy stands in for LMCache's CUDA connector, the one part that needs a GPU), working under
    ``tmp_path``, its memory tier in a /dev/shm folder of its own, removed afterwards."""
    shm = f"/dev/shm/kvs-dry-{os.getpid()}-{uuid.uuid4().hex[:8]}"
    os.makedirs(shm)

    def run(args: list[str], timeout: float = 600) -> subprocess.CompletedProcess:
        return subprocess.run(BENCH_GPU + args + ["--workdir", str(tmp_path), "--gpu-shm", shm],
                              capture_output=True, text=True, timeout=timeout,
                              env={**os.environ, "KVSTREAM_GPU_DRY": "1"})

    yield run
    shutil.rmtree(shm, ignore_errors=True)


@pytest.fixture
def tier_dirs(tmp_path) -> Iterator[list[str]]:
    """Two existing tier roots on independent paths: the local disk and tmpfs (/dev/shm)."""
    shm = f"/dev/shm/kvs-test-{uuid.uuid4().hex[:8]}"
    dirs = [str(tmp_path / "nvme"), shm]
    for d in dirs:  # kvstream never creates a tier root: like a mount, it must be there
        os.makedirs(d)
    yield dirs
    shutil.rmtree(shm, ignore_errors=True)


def engine_config(dirs: list[str], **kw):
    """A parsed config over ``dirs``; ``tier_opts`` (a list of dicts) extends each tier entry."""
    opts = kw.pop("tier_opts", [{}] * len(dirs))
    tiers = [
        {"name": f"t{i}", "path": d, "max_size_gb": kw.pop(f"cap{i}", 1.0), **o}
        for i, (d, o) in enumerate(zip(dirs, opts, strict=True))
    ]
    return parse_config({"kvstream.tiers": tiers, **{f"kvstream.{k}": v for k, v in kw.items()}})


@pytest.fixture
def kvlog(caplog: pytest.LogCaptureFixture) -> Iterator[pytest.LogCaptureFixture]:
    """``caplog`` for the "kvstream" logger at INFO: once LMCache's ``init_logger`` has
    configured it (the plugin and the L2 adapter do at import) it no longer propagates to the
    root logger, where ``caplog`` listens, and ``kvstream bench`` run in-process (the bench
    tests) leaves it at ERROR; a test run after theirs would see nothing. So the handler sits on
    that logger itself, which does not propagate meanwhile (or each record would be caught twice
    where nothing had configured it yet)."""
    logger = logging.getLogger("kvstream")
    propagate = logger.propagate
    logger.addHandler(caplog.handler)
    logger.propagate = False
    try:
        with caplog.at_level(logging.INFO, logger="kvstream"):
            yield caplog
    finally:
        logger.removeHandler(caplog.handler)
        logger.propagate = propagate


@pytest.fixture
def make_engine():
    engines: list[Engine] = []

    def make(dirs: list[str], **kw) -> Engine:
        e = Engine(engine_config(dirs, **kw))
        engines.append(e)
        return e

    yield make
    for e in engines:
        e.close()
