"""kvstream driven by SGLang's own HiCache controller (``UnifiedRadixCache`` and its cache
controller's prefetch and backup threads), through the unified radix cache test kit that ships
in SGLang's wheel, with ``--hicache-storage-backend dynamic``.

What cannot run here: the device <-> host copies (CUDA streams). The kit's ``_simulate_backup``
stands in for the device -> host step (the host value takes the device indices); everything
from the host pool on is SGLang's real path: ``write_backup_storage`` -> backup thread ->
``batch_set_v1``; ``prefetch_from_storage`` -> prefetch thread -> ``batch_exists`` ->
host allocation -> ``batch_get_v1`` -> the prefetched node in the consumer's radix tree.
"""

from __future__ import annotations

import json
import os
import unittest
import uuid
from unittest import mock

import pytest
import sglang.test.kits.unified_radix_cache.fixtures as kit_fixtures
import torch
from sglang.kernels.ops.attention.fla.chunk_delta_h import (
    CHUNK_SIZE as FLA_CHUNK_SIZE,
)
from sglang.srt.mem_cache.base_prefix_cache import CacheRequestHandle
from sglang.srt.mem_cache.unified_cache.components.base import ComponentType
from sglang.srt.server_args import (
    ServerArgs,
    set_global_server_args_for_scheduler,
)
from sglang.test.kits.unified_radix_cache.config import CacheConfig
from sglang.test.kits.unified_radix_cache.fixtures import (
    build_fixture,
    drop_hicache_atexit_pin,
    match_prefix,
    node_host_value,
)
from sglang.test.kits.unified_radix_cache.storage import (
    UnifiedRadixCacheStorageFixtures,
)

pytestmark = pytest.mark.sglang


class TestHiCacheControllerOverKVStream(UnifiedRadixCacheStorageFixtures, unittest.TestCase):
    cfg = CacheConfig(page_size=16, components=(ComponentType.FULL,), num_layers=2,
                      kv_size=512, head_num=2, head_dim=64)

    def setUp(self) -> None:
        # No accelerator here: the kit's pools on the CPU, host pools without pinned memory.
        p = mock.patch.object(kit_fixtures, "get_device", return_value="cpu")
        p.start()
        self.addCleanup(p.stop)
        import sglang.srt.mem_cache.hybrid_cache.hybrid_pool_assembler as assembler

        host_cls = assembler.get_mha_host_pool_cls

        def unpinned(info):
            cls = host_cls(info)
            return lambda *a, **k: cls(*a, **{**k, "pin_memory": False})

        p = mock.patch.object(assembler, "get_mha_host_pool_cls", side_effect=unpinned)
        p.start()
        self.addCleanup(p.stop)
        from sglang.srt.runtime_context import get_parallel

        single = get_parallel().override(tp_rank=0, tp_size=1, pp_rank=0, pp_size=1)
        single.__enter__()
        self.addCleanup(single.__exit__, None, None, None)
        base = f"kvs-ctl-{uuid.uuid4().hex[:8]}"
        self.tiers = [os.path.join(self._make_storage_dir(), "disk"), f"/dev/shm/{base}"]
        self.addCleanup(lambda: __import__("shutil").rmtree(self.tiers[1], True))

    def _init_kvstream(self, cache) -> None:
        extra = {"backend_name": "kvstream", "module_path": "kvstream_backend",
                 "class_name": "KVStreamHiCacheStorage", "interface_v1": 1,
                 "prefetch_threshold": 1,
                 "tiers": [{"name": f"t{i}", "path": d, "max_size_gb": 1}
                           for i, d in enumerate(self.tiers)]}
        args = ServerArgs(model_path="dummy", page_size=self.cfg.page_size,
                          hicache_io_backend="kernel", hicache_write_policy="write_through",
                          hicache_storage_backend="dynamic",
                          hicache_storage_backend_extra_config=json.dumps(extra),
                          hicache_storage_prefetch_policy="wait_complete")
        args._mamba_cache_chunk_size = max(FLA_CHUNK_SIZE, self.cfg.page_size)
        set_global_server_args_for_scheduler(args)
        cache.init_hicache(args, cache.cache_init_params)
        self.addCleanup(drop_hicache_atexit_pin, cache)
        self.addCleanup(cache.release_host_resources)
        cache.write_through_threshold = 1 << 30
        cache.load_back_threshold = 0
        cc = cache.cache_controller
        cc.prefetch_capacity_limit = max(cc.prefetch_capacity_limit, cc.mem_pool_host.size)
        self.addCleanup(cc._stop_storage_threads)

    def _host_pages(self, cache, leaf) -> list[bytes]:
        pool = cache.cache_controller.mem_pool_host.anchor_entry.host_pool
        idx = torch.cat([node_host_value(cache, n, ComponentType.FULL)
                         for n in self._path_chain(cache, leaf)])
        ps = self.cfg.page_size
        return [bytes(pool.get_data_page(idx[i]).contiguous().view(torch.uint8).numpy())
                for i in range(0, len(idx), ps)]

    def test_pages_backed_up_by_one_server_are_prefetched_by_another(self) -> None:
        seq = self._make_seq(1, 6)
        prod, alloc, rtp = build_fixture(self.cfg)
        self._init_kvstream(prod)
        self._insert(prod, alloc, rtp, seq)
        leaf = match_prefix(prod, seq).last_device_node
        self._simulate_backup(prod, leaf)  # device -> host: CUDA only (see module doc)
        pool = prod.cache_controller.mem_pool_host.anchor_entry.host_pool
        g = torch.Generator().manual_seed(11)
        flat = pool.kv_buffer.view(torch.uint8).view(-1)
        flat.copy_(torch.randint(0, 256, flat.shape, dtype=torch.uint8, generator=g))
        want = self._host_pages(prod, leaf)
        self._write_path_to_l3(prod, leaf)  # the controller's backup thread: batch_set_v1
        self._flush_l3_backups(prod)
        producer = prod.cache_controller.storage_backend
        self.assertEqual(type(producer).__name__, "KVStreamHiCacheStorage")
        self.assertEqual(producer.pages_written, 6)
        producer.close()  # the producing server stops; its tiers stay

        cons, _, _ = build_fixture(self.cfg)
        self._init_kvstream(cons)
        self._consume_prefetch(cons, seq, CacheRequestHandle("r", 0))  # prefetch thread
        m = match_prefix(cons, seq)
        self.assertEqual(m.host_hit_length, len(seq))
        self.assertEqual(cons.cache_controller.storage_backend.pages_read, 6)
        self.assertEqual(self._host_pages(cons, m.last_host_node), want)
