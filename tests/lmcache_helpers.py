"""Helpers for tests against the real LMCache 0.5.6 on the CPU.

The only stand-ins are for what cannot run here: LMCache's GPU connectors need CUDA, so
:class:`CPUConnector` / :class:`CPULayerwiseConnector` copy between a CPU tensor playing the
paged GPU KV (``kwargs["kv"]``, shape ``[2, layers, tokens, hidden]``) and MemoryObjs; they really
copy, so retrieved bytes can be compared. ``LookupServerStub`` records what LMCache's async
lookup path would send to vLLM's scheduler over ZMQ.

Run as a module (``python -m tests.lmcache_helpers put|get YAML N [SEED]``) it puts or gets N
deterministic chunks through a fresh StorageManager in a new process and prints a JSON report.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path
from typing import Any

import torch
import yaml
from lmcache.utils import CacheEngineKey
from lmcache.v1.config import LMCacheEngineConfig
from lmcache.v1.event_manager import EventManager
from lmcache.v1.gpu_connector.gpu_connectors import (
    GPUConnectorInterface,
    VLLMBufferLayerwiseGPUConnector,
)
from lmcache.v1.metadata import LMCacheMetadata
from lmcache.v1.storage_backend.storage_manager import StorageManager

LAYERS, HEADS, HEAD = 2, 2, 64
HIDDEN = HEADS * HEAD
DTYPE = torch.bfloat16
MODEL = "kvs-test-model"


def metadata(role: str = "worker", worker_id: int = 0, world_size: int = 1) -> LMCacheMetadata:
    return LMCacheMetadata(
        model_name=MODEL, world_size=world_size, local_world_size=world_size,
        worker_id=worker_id, local_worker_id=worker_id, kv_dtype=DTYPE,
        kv_shape=(LAYERS, 2, 256, HEADS, HEAD), role=role,
    )


def write_yaml(path: Path, tier_dirs: list[str], *, local_cpu: bool = False,
               tier_opts: list[dict] | None = None, lmcache: dict | None = None,
               **kvstream: Any) -> Path:
    """An LMCache YAML selecting kvstream over ``tier_dirs``; ``lmcache`` adds top-level keys."""
    opts = tier_opts or [{}] * len(tier_dirs)
    extra: dict[str, Any] = {
        "storage_plugin.kvstream.module_path": "kvstream_backend",
        "storage_plugin.kvstream.class_name": "KVStreamBackend",
        "kvstream.tiers": [
            {"name": f"t{i}", "path": d, "max_size_gb": 1, **o}
            for i, (d, o) in enumerate(zip(tier_dirs, opts, strict=True))
        ],
    }
    extra.update({f"kvstream.{k}": v for k, v in kvstream.items()})
    doc = {
        "chunk_size": 256,
        "local_cpu": local_cpu,
        "max_local_cpu_size": 0.5,
        "storage_plugins": ["kvstream"],
        "extra_config": extra,
        **(lmcache or {}),
    }
    path.write_text(yaml.safe_dump(doc))
    return path


def storage_manager(yaml_path: Path | str, role: str = "worker") -> StorageManager:
    cfg = LMCacheEngineConfig.from_file(str(yaml_path))
    return StorageManager(cfg, metadata(role), EventManager())


def key(i: int, worker_id: int = 0, model: str = MODEL, dtype: torch.dtype = DTYPE,
        world_size: int = 1) -> CacheEngineKey:
    return CacheEngineKey(model, world_size, worker_id, 0x5EED0000 + i, dtype)


def chunk_tensor(i: int, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed * 100_003 + i)
    return torch.randn(metadata().get_shapes(256)[0], generator=g).to(DTYPE)


def put_chunks(sm: StorageManager, idx: list[int], seed: int = 0) -> None:
    shape = metadata().get_shapes(256)[0]
    keys, objs = [], []
    for i in idx:
        obj = sm.allocate(shape, DTYPE)
        assert obj is not None
        obj.tensor.copy_(chunk_tensor(i, seed))
        keys.append(key(i))
        objs.append(obj)
    sm.batched_put(keys, objs)


def active_allocations(sm: StorageManager) -> int:
    return sm.local_cpu_backend.memory_allocator.pin_allocator.num_active_allocations


class CPUConnector(GPUConnectorInterface):
    """Test stand-in for a GPU connector (see module doc); format KV_2LTD."""

    def __init__(self) -> None:
        self.kvcaches = None

    def get_shape(self, num_tokens: int) -> torch.Size:
        return torch.Size([2, LAYERS, num_tokens, HIDDEN])

    def from_gpu(self, memory_obj, start: int, end: int, **kwargs) -> None:
        memory_obj.tensor.copy_(kwargs["kv"][:, :, start:end, :])

    def to_gpu(self, memory_obj, start: int, end: int, **kwargs) -> None:
        kwargs["kv"][:, :, start:end, :].copy_(memory_obj.tensor)

    def batched_from_gpu(self, memory_objs, starts, ends, **kwargs) -> None:
        for o, s, e in zip(memory_objs, starts, ends, strict=True):
            self.from_gpu(o, s, e, **kwargs)

    def batched_to_gpu(self, memory_objs, starts, ends, **kwargs) -> None:
        for o, s, e in zip(memory_objs, starts, ends, strict=True):
            self.to_gpu(o, s, e, **kwargs)


class CPULayerwiseConnector(VLLMBufferLayerwiseGPUConnector):
    """Layerwise test stand-in (LMCache checks the class, so it subclasses a layerwise one).

    Generators follow LMCache's protocol: ``batched_from_gpu`` yields layers + 1 times,
    ``batched_to_gpu`` receives one list of MemoryObjs per layer and yields layers + 2 times.
    """

    def __init__(self) -> None:  # the parent allocates CUDA buffers: not called
        self.num_layers = LAYERS

    def get_shape(self, num_tokens: int) -> torch.Size:
        return torch.Size([2, num_tokens, HIDDEN])

    def batched_from_gpu(self, memory_objs, starts, ends, **kwargs):
        kv = kwargs["kv"]
        for layer, objs in enumerate(memory_objs):
            for o, s, e in zip(objs, starts, ends, strict=True):
                o.tensor.copy_(kv[:, layer, s:e, :])
            yield
        yield

    def batched_to_gpu(self, starts, ends, **kwargs):
        kv = kwargs["kv"]
        for layer in range(LAYERS):
            objs = yield
            for o, s, e in zip(objs, starts, ends, strict=True):
                kv[:, layer, s:e, :].copy_(o.tensor)
        yield
        yield


class LookupServerStub:
    """Records ``send_response_to_scheduler`` (ZMQ to vLLM's scheduler in production)."""

    def __init__(self) -> None:
        self.responses: dict[str, int] = {}

    def send_response_to_scheduler(self, lookup_id: str, retrieved_length: int) -> None:
        self.responses[lookup_id] = retrieved_length


def _main(argv: list[str]) -> None:
    os.environ.setdefault("PYTHONHASHSEED", "0")
    op, yaml_path, n = argv[0], argv[1], int(argv[2])
    seed = int(argv[3]) if len(argv) > 3 else 0
    sm = storage_manager(yaml_path)
    kv = sm.storage_backends["kvstream"]
    report: dict[str, Any] = {}
    if op == "put":
        put_chunks(sm, list(range(n)), seed)
        report["flushed"] = kv.engine.flush(120)
    else:
        keys = [key(i) for i in range(n)]
        hits, where = sm.batched_contains(keys, pin=True)
        objs = sm.batched_get(keys, location="kvstream")
        report["hits"] = hits
        report["locations"] = sorted(where)
        report["identical"] = [
            o is not None and torch.equal(o.tensor, chunk_tensor(i, seed))
            for i, o in enumerate(objs)
        ]
        for o in objs:
            if o is not None:
                o.ref_count_down()
        sm.batched_unpin(keys, ["kvstream"])
        report["tier_read_bytes"] = {t.name: t.read_bytes for t in kv.engine.stats().tiers}
    sm.close()
    print("REPORT " + json.dumps(report))


if __name__ == "__main__":
    _main(sys.argv[1:])
