"""The benchmark's LMCache side: model-shaped chunks, StorageManagers, and one serving step.

A *step* is what LMCache does for R requests of C matched chunks each, in its own order:
``batched_contains(keys, pin=True)`` for every request (the lookup server), then per request
``get_block_mapping`` + ``batched_get`` (``start_load_kv`` -> ``retrieve``), then the unpins.
The step time runs from the first lookup to the last get returning.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, NamedTuple

import torch
from lmcache.utils import CacheEngineKey
from lmcache.v1.config import LMCacheEngineConfig
from lmcache.v1.event_manager import EventManager
from lmcache.v1.metadata import LMCacheMetadata
from lmcache.v1.storage_backend.storage_manager import StorageManager

from ..stats import StepReport

DTYPE = torch.bfloat16


@dataclass(frozen=True)
class Shape:
    """A model's per-rank KV layout: ``layers`` x ``hidden`` (heads*head_dim), bf16, K and V."""

    layers: int
    hidden: int
    world_size: int
    model: str = "bench-32b-gqa"

    @classmethod
    def from_bytes_per_token(cls, bpt: int, layers: int, world_size: int) -> Shape:
        hidden, rem = divmod(bpt, 2 * layers * DTYPE.itemsize)
        if rem or hidden <= 0:
            raise ValueError(f"--kv-bytes-per-token {bpt} is not a multiple of "
                             f"2 x {layers} layers x {DTYPE.itemsize} bytes")
        return cls(layers, hidden, world_size)

    @property
    def chunk_bytes(self) -> int:
        return 2 * self.layers * 256 * self.hidden * DTYPE.itemsize

    def metadata(self) -> LMCacheMetadata:
        return LMCacheMetadata(
            model_name=self.model, world_size=self.world_size,
            local_world_size=self.world_size, worker_id=0, local_worker_id=0, kv_dtype=DTYPE,
            kv_shape=(self.layers, 2, 256, 1, self.hidden), role="worker",
        )

    def key(self, i: int) -> CacheEngineKey:
        return CacheEngineKey(self.model, self.world_size, 0, 0xC0FFEE000 + i, DTYPE)


def fill(t: torch.Tensor, i: int) -> None:
    """Deterministic, chunk-specific content (cheap: one random row, tiled)."""
    g = torch.Generator().manual_seed(i)
    row = torch.randn(t.shape[-1], generator=g).to(DTYPE)
    t.copy_(row.expand_as(t))
    t.view(-1)[0] = float(i % 251)


def lmcache_config(backend: dict[str, Any], cpu_gb: float) -> LMCacheEngineConfig:
    doc = {"chunk_size": 256, "local_cpu": False, "max_local_cpu_size": cpu_gb, **backend}
    return LMCacheEngineConfig.from_dict(doc)


def kvstream_backend(tiers: list[dict[str, Any]], **keys: Any) -> dict[str, Any]:
    extra = {
        "storage_plugin.kvstream.module_path": "kvstream_backend",
        "storage_plugin.kvstream.class_name": "KVStreamBackend",
        "kvstream.tiers": tiers,
        **{f"kvstream.{k}": v for k, v in keys.items()},
    }
    return {"storage_plugins": ["kvstream"], "extra_config": extra}


def local_disk_backend(path: str, size_gb: float) -> dict[str, Any]:
    return {"local_disk": f"file://{path}/", "max_local_disk_size": size_gb,
            "extra_config": {"use_odirect": True}}


def open_manager(backend: dict[str, Any], shape: Shape, cpu_gb: float) -> StorageManager:
    sm = StorageManager(lmcache_config(backend, cpu_gb), shape.metadata(), EventManager())
    if len(sm.storage_backends) < 2:
        sm.close()
        raise RuntimeError(f"LMCache did not create the storage backend: {backend}")
    engine = getattr(sm.storage_backends[location(sm)], "engine", None)
    if engine is not None:  # a restarted server has warmed its index long before requests
        engine.wait_warm(60)
    return sm


def location(sm: StorageManager) -> str:
    return [n for n in sm.storage_backends if n != "LocalCPUBackend"][0]


def put(sm: StorageManager, shape: Shape, idx: list[int]) -> None:
    """Store chunks through LMCache's batched_put (what ``wait_for_save`` does)."""
    sm.batched_put(*chunks(sm, shape, idx))


def chunks(sm: StorageManager, shape: Shape,
           idx: list[int]) -> tuple[list[CacheEngineKey], list[Any]]:
    """Keys and filled MemoryObjs for ``idx``, ready for ``batched_put``."""
    size = torch.Size([2, shape.layers, 256, shape.hidden])
    keys, objs = [], []
    for i in idx:
        obj = sm.allocate(size, DTYPE, busy_loop=True)
        assert obj is not None and obj.tensor is not None
        fill(obj.tensor, i)
        keys.append(shape.key(i))
        objs.append(obj)
    return keys, objs


def wait_puts(sm: StorageManager, shape: Shape, idx: list[int], timeout: float = 600) -> None:
    """Wait until the backend has every chunk (kvstream: flush; LocalDisk: its put tasks)."""
    backend = sm.storage_backends[location(sm)]
    engine = getattr(backend, "engine", None)
    if engine is not None:
        engine.flush(timeout)
        return
    deadline = time.monotonic() + timeout
    keys = [shape.key(i) for i in idx]
    while any(backend.exists_in_put_tasks(k) or not backend.contains(k) for k in keys):
        if time.monotonic() > deadline:
            raise TimeoutError("LocalDiskBackend did not persist the chunks")
        time.sleep(0.01)


def wait_visible(sm: StorageManager, shape: Shape, idx: list[int],
                 timeout: float = 600) -> float | None:
    """Seconds until every chunk has a first published copy (kvstream only; else None),
    counted from the call; the puts were issued just before it."""
    engine = getattr(sm.storage_backends[location(sm)], "engine", None)
    if engine is None:
        return None
    t0 = time.perf_counter()
    keys = [shape.key(i).to_string() for i in idx]
    while not all(engine.lookup(k) is not None for k in keys):
        if time.perf_counter() - t0 > timeout:
            raise TimeoutError("kvstream did not publish the chunks")
        time.sleep(0.005)
    return time.perf_counter() - t0


class TierReads(NamedTuple):
    """What one kvstream tier read during a bench step, its prefetches included."""

    name: str
    bytes: int
    busy_s: float
    reads: int
    lost: int  # good copies another tier's copy beat
    read_s: float  # latencies, summed


@dataclass
class StepResult:
    time_s: float
    lookup_s: float
    bytes: int
    engine_steps: list[StepReport] = field(default_factory=list)  # demanded pools in the step
    tiers: list[TierReads] = field(default_factory=list)


def step(sm: StorageManager, shape: Shape, requests: list[list[int]], verify: bool,
         after_lookups: Callable[[], None] | None = None,
         between_gets: Callable[[int], None] | None = None) -> StepResult:
    """One serving step in LMCache's order; raises if any chunk is missing or wrong.

    ``after_lookups`` runs between the lookups and the gets (inside the timed step): the
    previous step's puts arriving while this step's reads are in flight, as in vLLM.
    ``between_gets(r)`` runs after request ``r``'s get: the next requests' lookups arriving
    while the step retrieves (vLLM's scheduler looks up while the workers load).
    """
    backend = sm.storage_backends[location(sm)]
    engine = getattr(backend, "engine", None)
    before = engine.stats() if engine is not None else None
    keys = [[shape.key(i) for i in r] for r in requests]
    t0 = time.perf_counter()
    for ks in keys:
        hits, _ = sm.batched_contains(ks, pin=True)
        if hits != len(ks):
            raise RuntimeError(f"lookup hit {hits} of {len(ks)} chunks")
    t_lookup = time.perf_counter() - t0
    if after_lookups is not None:
        after_lookups()
    held: list[tuple[int, Any]] = []
    for r, ks in zip(requests, keys, strict=True):
        infos = [(k, j * 256, (j + 1) * 256) for j, k in enumerate(ks)]
        for loc, blocks in sm.get_block_mapping(infos).items():
            objs = sm.batched_get([k for k, _, _ in blocks], location=loc)
            if any(o is None for o in objs):
                raise RuntimeError("a looked-up chunk could not be retrieved")
            held.extend(zip(r, objs, strict=True))
        if between_gets is not None:
            between_gets(len(held) // len(r) - 1)
    t = time.perf_counter() - t0
    for ks in keys:
        sm.batched_unpin(ks, [location(sm)])
    if verify:
        ref = torch.empty(2, shape.layers, 256, shape.hidden, dtype=DTYPE)
        for i, obj in held:
            fill(ref, i)
            if not torch.equal(obj.tensor, ref):
                raise RuntimeError(f"chunk {i} came back with wrong bytes")
    for _, obj in held:
        obj.ref_count_down()
    reps: list[StepReport] = []
    tiers: list[TierReads] = []
    if engine is not None and before is not None:
        engine.wait_idle(60)
        after = engine.stats()
        new = after.steps - before.steps
        reps = list(engine.steps)[-new:] if new else []
        tiers = [TierReads(b.name, a.read_bytes - b.read_bytes, a.read_busy_s - b.read_busy_s,
                           a.reads - b.reads, a.lost_reads - b.lost_reads, a.read_s - b.read_s)
                 for b, a in zip(before.tiers, after.tiers, strict=True)]
    return StepResult(t, t_lookup, sum(len(r) for r in requests) * shape.chunk_bytes, reps,
                      tiers)


def uses_page_cache(sm: StorageManager) -> bool:
    """True if the backend reads through the page cache (a kvstream tier without O_DIRECT)."""
    engine = getattr(sm.storage_backends[location(sm)], "engine", None)
    return engine is not None and not all(t.direct for t in engine.stats().tiers)


def lookups(sm: StorageManager, shape: Shape, idx: list[int]) -> None:
    """A request's lookup as LMCache's lookup server does it (pins its hits)."""
    hits, _ = sm.batched_contains([shape.key(i) for i in idx], pin=True)
    if hits != len(idx):
        raise RuntimeError(f"lookup hit {hits} of {len(idx)} chunks")


def unpin(sm: StorageManager, shape: Shape, idx: list[int]) -> None:
    sm.batched_unpin([shape.key(i) for i in idx], [location(sm)])


def remove(sm: StorageManager, shape: Shape, idx: list[int]) -> None:
    backend = sm.storage_backends[location(sm)]
    for i in idx:
        backend.remove(shape.key(i))
