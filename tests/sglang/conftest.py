"""SGLang's real HiCache classes on the CPU: its device and host KV pools, its storage config and
its backend factory (``--hicache-storage-backend dynamic``). These tests need SGLang's own
environment (``tox -e sglang``, which sets ``KVSTREAM_SGLANG_TESTS=1``); elsewhere this directory
is not collected at all (neither run nor reported as skipped).
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterator
from typing import Any

import pytest
import torch

PAGE = 64  # tokens per page
LAYERS, HEADS, HEAD_DIM = 4, 4, 128  # a page: 2 x 4 x 64 x 4 x 128 x 2 B = 512 KiB


collect_ignore_glob = [] if os.environ.get("KVSTREAM_SGLANG_TESTS") == "1" else ["test_*.py"]


def host_pool(layout: str, tokens: int = 4096) -> Any:
    """SGLang's MHA host pool (``pin_memory=False``: no CUDA here) over a CPU device pool."""
    from sglang.srt.mem_cache.memory_pool import MHATokenToKVPool
    from sglang.srt.mem_cache.pool_host.mha import get_mha_host_pool_cls

    dev = MHATokenToKVPool(size=tokens, page_size=PAGE, dtype=torch.bfloat16, head_num=HEADS,
                           head_dim=HEAD_DIM, layer_num=LAYERS, device="cpu",
                           enable_memory_saver=False)
    info = dev.get_device_pool_infos()[0].buffer_info
    return get_mha_host_pool_cls(info)(
        info, 2.0, 0, PAGE, layout, pin_memory=False, device_capacity_tokens=dev.size,
        start_layer=dev.start_layer, end_layer=dev.end_layer)


def extra_config(dirs: list[str], **opts: Any) -> dict[str, Any]:
    return {"backend_name": "kvstream", "module_path": "kvstream_backend",
            "class_name": "KVStreamHiCacheStorage", "interface_v1": 1,
            "tiers": [{"name": f"t{i}", "path": d, "max_size_gb": 2} for i, d in
                      enumerate(dirs)], **opts}


def storage_config(extra: dict[str, Any], layout: str, *, mla: bool = False) -> Any:
    from sglang.srt.mem_cache.hicache_storage import HiCacheStorageConfig

    return HiCacheStorageConfig(
        tp_rank=0, tp_size=1, pp_rank=0, pp_size=1, attn_cp_rank=0, attn_cp_size=1,
        is_mla_model=mla, enable_storage_metrics=False,
        is_page_first_layout=layout == "page_first", model_name="tiny/llama",
        extra_config=extra)


def create(extra: dict[str, Any], host: Any, layout: str) -> Any:
    """The backend as SGLang's cache controller makes it (factory, then host registration)."""
    from sglang.srt.mem_cache.storage.backend_factory import StorageBackendFactory

    backend = StorageBackendFactory.create_backend("dynamic", storage_config(extra, layout),
                                                   host)
    backend.register_mem_pool_host(host)
    backend.register_mem_host_pool_v2(host, "kv")
    backend.on_host_pools_registered()
    return backend


def page_bytes(host: Any, host_indices: torch.Tensor, i: int) -> bytes:
    """Page ``i``'s bytes, read through the pool's own layout-aware accessor."""
    return bytes(host.get_data_page(host_indices[i * PAGE]).contiguous().view(torch.uint8)
                 .numpy())


def fill_random(host: Any, seed: int) -> None:
    g = torch.Generator().manual_seed(seed)
    flat = host.kv_buffer.view(torch.uint8).view(-1)
    flat.copy_(torch.randint(0, 256, flat.shape, dtype=torch.uint8, generator=g))


@pytest.fixture
def tiers(tmp_path) -> Iterator[list[str]]:
    """Two tier roots: the local disk and tmpfs."""
    shm = f"/dev/shm/kvs-sgl-{os.getpid()}-{tmp_path.name}"
    yield [str(tmp_path / "disk"), shm]
    import shutil

    shutil.rmtree(shm, ignore_errors=True)


@pytest.fixture
def backends() -> Iterator[Callable[..., Any]]:
    made: list[Any] = []

    def make(dirs: list[str], layout: str = "page_first", host: Any = None,
             **opts: Any) -> tuple[Any, Any]:
        host = host if host is not None else host_pool(layout)
        b = create(extra_config(dirs, **opts), host, layout)
        made.append(b)
        return b, host

    yield make
    for b in made:
        getattr(b, "_backend", b).close()
