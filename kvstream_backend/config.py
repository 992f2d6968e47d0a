"""Configuration of the KVStream engine and plugin, decoded and validated with msgspec.

Every key lives under the ``kvstream.`` prefix of LMCache's ``extra_config``. Errors are raised
as :class:`ConfigError` and always name the offending key (``kvstream.tiers[1].path``), so a
user can fix the YAML without reading this file.
"""

from __future__ import annotations

import json
import os
import re
from typing import Annotated, Any, Literal

import msgspec
from msgspec import Meta

PREFIX = "kvstream."

PositiveInt = Annotated[int, Meta(ge=1)]
PositiveFloat = Annotated[float, Meta(gt=0)]
Fraction = Annotated[float, Meta(ge=0, le=1)]


class ConfigError(ValueError):
    """A ``kvstream.*`` key (or an L2 adapter's ``adapter_params`` key) is missing, unknown or
    has a bad value; the message names it."""


class EmulateConfig(msgspec.Struct, forbid_unknown_fields=True, frozen=True):
    """Bandwidth emulation of one tier, for tests and benchmarks only (off unless given).

    ``read_mbps``/``write_mbps`` cap the tier's throughput in MiB/s; ``jitter`` is the relative
    amplitude of the fluctuation; ``pattern`` picks its shape: ``steady`` (i.i.d. per operation),
    ``periodic`` (a sine of period ``period_s``) or ``bursty`` (random switches between
    ``1+jitter`` and ``1-jitter`` of the nominal rate, dwelling ``period_s`` on average).
    """

    read_mbps: PositiveFloat | None = None
    write_mbps: PositiveFloat | None = None
    jitter: Annotated[float, Meta(ge=0, lt=1)] = 0.0
    pattern: Literal["steady", "periodic", "bursty"] = "steady"
    period_s: PositiveFloat = 2.0
    seed: int = 0


class TierConfig(msgspec.Struct, forbid_unknown_fields=True, frozen=True):
    """One storage tier: a directory with a byte capacity.

    ``io`` selects the I/O path (``auto`` probes io_uring first, then falls back to a thread
    pool); ``direct`` selects O_DIRECT (``auto`` uses it where the file system accepts it and
    falls back to buffered I/O with the pages dropped after use).
    """

    name: Annotated[str, Meta(pattern=r"^[A-Za-z0-9_.-]{1,64}$")]
    path: Annotated[str, Meta(min_length=1)]
    max_size_gb: PositiveFloat
    io: Literal["auto", "uring", "threads"] = "auto"
    direct: Literal["auto", "on", "off"] = "auto"
    emulate: EmulateConfig | None = None

    @property
    def capacity_bytes(self) -> int:
        return int(self.max_size_gb * (1 << 30))


class KVStreamConfig(msgspec.Struct, forbid_unknown_fields=True, frozen=True):
    """All ``kvstream.*`` keys with their defaults (README documents each one)."""

    tiers: Annotated[list[TierConfig], Meta(min_length=1)]
    claim_batch: PositiveInt = 4
    read_window: Literal["auto"] | PositiveInt = "auto"
    read_target_ms: PositiveFloat = 50.0
    hedge: bool = True
    static_split: Fraction | None = None
    read_queue_depth: PositiveInt = 64
    write_queue_depth: PositiveInt = 8
    io_threads: PositiveInt = 4
    verify_threads: Annotated[int, Meta(ge=0)] = 0  # 0: one per core, at most 8
    copy_threads: Literal["auto"] | PositiveInt = "auto"
    spare_cores: Annotated[int, Meta(ge=0)] = 0
    staging_budget_mb: PositiveInt = 2048
    verify_checksums: bool = True
    warm_headers: bool = True
    remember_rates: bool = True
    max_chunk_mb: PositiveInt = 512
    file_mode: Annotated[int, Meta(ge=0, le=0o777)] = 0o600
    dir_mode: Annotated[int, Meta(ge=0, le=0o777)] = 0o700
    negative_cache_ms: Annotated[int, Meta(ge=0)] = 200
    reprobe_interval_s: PositiveFloat = 5.0
    prefetch_max_gb: PositiveFloat = 4.0
    prefetch_timeout_s: PositiveFloat = 30.0
    get_timeout_s: PositiveFloat = 60.0
    close_timeout_s: Annotated[float, Meta(ge=0)] = 20.0
    metrics_port: Annotated[int, Meta(ge=0, le=65535)] = 0
    stats_file: str = ""  # where close() writes the engine's counters as JSON ("" = nowhere)

    @property
    def max_chunk_bytes(self) -> int:
        return self.max_chunk_mb << 20

    @property
    def staging_budget_bytes(self) -> int:
        return self.staging_budget_mb << 20

    @property
    def memory_readers(self) -> int:
        """Readers of a tier on tmpfs or ramfs, where a read is a copy by its thread (which also
        hashes it): ``copy_threads``, or with ``auto`` one per core the process may run on, less
        ``spare_cores`` (at least ``io_threads``)."""
        if self.copy_threads != "auto":
            return self.copy_threads
        return max(self.io_threads, cores() - self.spare_cores)

    @property
    def copy_cpus(self) -> frozenset[int] | None:
        """The CPUs those readers run on: the process's affinity less its ``spare_cores``
        lowest-numbered CPUs, which they leave to the serving engine's own threads (LMCache's
        host->GPU scatter); ``None`` (anywhere) when ``spare_cores`` is 0."""
        if not self.spare_cores:
            return None
        return frozenset(sorted(os.sched_getaffinity(0))[self.spare_cores:])

    @property
    def verify_workers(self) -> int:
        """Threads that verify checksums (shared by every tier; xxhash releases the GIL)."""
        return self.verify_threads or min(8, cores())


def cores() -> int:
    """The cores this process may run on (its CPU affinity: a container pinned to a cpuset
    sees the host's count in ``os.cpu_count()``)."""
    return len(os.sched_getaffinity(0)) or 1


_PATH_RE = re.compile(r"at `\$(?P<path>[^`]*)`")


def _key_from_msgspec(err: msgspec.ValidationError, label: str) -> str:
    """Translate msgspec's ``$.tiers[0].path`` into ``<label>.tiers[0].path``."""
    msg = str(err)
    unknown = re.search(r"unknown field `(?P<f>[^`]+)`", msg)
    m = _PATH_RE.search(msg)
    path = m.group("path") if m else ""
    if unknown:
        path = f"{path}.{unknown.group('f')}"
    missing = re.search(r"missing required field `(?P<f>[^`]+)`", msg)
    if missing:
        path = f"{path}.{missing.group('f')}"
    return label + (path if path.startswith((".", "[")) else f".{path}" if path else "")


def parse_config(
    extra_config: dict[str, Any] | None, *, check_paths: bool = True
) -> KVStreamConfig:
    """Decode the ``kvstream.*`` keys of an LMCache ``extra_config`` dict.

    Values may be strings (LMCache's env-var form): ``kvstream.tiers`` may be a JSON string and
    scalars are converted leniently ("4" -> 4). With ``check_paths`` every tier directory is
    created if missing (mode ``dir_mode``) and must be a writable directory.
    """
    raw: dict[str, Any] = {}
    for k, v in (extra_config or {}).items():
        if k.startswith(PREFIX):
            raw[k[len(PREFIX) :]] = v
    return _decode(raw, "kvstream", check_paths)


def parse_params(params: dict[str, Any], *, label: str = "adapter_params",
                 check_paths: bool = False) -> KVStreamConfig:
    """Decode the same keys without the prefix (an L2 adapter's ``adapter_params``, SGLang's
    ``extra_config``); errors name ``<label>.<key>``. ``check_paths`` as for
    :func:`parse_config`; without it a missing tier root is a tier down, never created."""
    if not isinstance(params, dict):
        raise ConfigError(f"{label}: expected a mapping of kvstream options, got "
                          f"{type(params).__name__}")
    return _decode(dict(params), label, check_paths)


REPLACED = {"claim_depth": "read_window (chunks in flight per tier; \"auto\" sizes it to the "
                           "tier's measured bandwidth)"}


def _decode(raw: dict[str, Any], label: str, check_paths: bool) -> KVStreamConfig:
    for old, new in REPLACED.items():
        if old in raw:
            raise ConfigError(f"{label}.{old}: replaced in 0.2 by {label}.{new}")
    if "tiers" not in raw:
        raise ConfigError(f"{label}.tiers is required: a list of {{name, path, max_size_gb}}")
    if isinstance(raw["tiers"], str):
        try:
            raw["tiers"] = json.loads(raw["tiers"])
        except json.JSONDecodeError as e:
            raise ConfigError(f"{label}.tiers: not valid JSON ({e})") from None
    try:
        cfg = msgspec.convert(raw, KVStreamConfig, strict=False)
    except msgspec.ValidationError as e:
        raise ConfigError(f"{_key_from_msgspec(e, label)}: {e}") from None
    _check_semantics(cfg, label, check_paths)
    return cfg


def _check_semantics(cfg: KVStreamConfig, label: str, check_paths: bool) -> None:
    if cfg.static_split is not None and len(cfg.tiers) != 2:
        raise ConfigError(f"{label}.static_split: a static split needs exactly two tiers")
    if cfg.read_window != "auto" and cfg.read_window > cfg.read_queue_depth:
        raise ConfigError(
            f"{label}.read_window: {cfg.read_window} exceeds {label}.read_queue_depth "
            f"({cfg.read_queue_depth}); the reads a tier keeps in flight must fit in its queue"
        )
    if cfg.spare_cores >= cores():
        raise ConfigError(
            f"{label}.spare_cores: {cfg.spare_cores} leaves none of this process's {cores()} "
            "cores to a memory tier's copy threads"
        )
    names: set[str] = set()
    roots: list[tuple[int, str]] = []
    for i, t in enumerate(cfg.tiers):
        key = f"{label}.tiers[{i}]"
        if t.name in names:
            raise ConfigError(f"{key}.name: duplicate tier name {t.name!r}")
        names.add(t.name)
        if not os.path.isabs(t.path):
            raise ConfigError(f"{key}.path: must be an absolute path, got {t.path!r}")
        real = os.path.realpath(t.path)
        for j, other in roots:
            if real == other or real.startswith(other + os.sep) or other.startswith(real + os.sep):
                raise ConfigError(
                    f"{key}.path: {t.path!r} overlaps {label}.tiers[{j}].path; tiers need "
                    "disjoint directories"
                )
        roots.append((i, real))
        if check_paths:
            _check_dir(f"{key}.path", t.path, cfg.dir_mode)


def _check_dir(key: str, path: str, mode: int) -> None:
    try:
        os.makedirs(path, mode=mode, exist_ok=True)
    except OSError as e:
        raise ConfigError(f"{key}: cannot create directory {path!r}: {e.strerror}") from None
    if not os.path.isdir(path):
        raise ConfigError(f"{key}: {path!r} is not a directory")
    if not os.access(path, os.R_OK | os.W_OK | os.X_OK):
        raise ConfigError(f"{key}: directory {path!r} is not readable and writable")
