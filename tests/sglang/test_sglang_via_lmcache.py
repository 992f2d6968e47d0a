"""SGLang via LMCache, for real on the CPU: SGLang's ``LMCacheUnifiedRadixCache`` (what
``--enable-lmcache`` builds) over SGLang's real ``ModelConfig`` (a tiny config, no weights),
``MHATokenToKVPool(device="cpu")`` and ``PagedTokenToKVPoolAllocator``, talking through LMCache's
``UnifiedLMCacheMPConnector`` to a real ``lmcache server`` whose one L2 adapter is kvstream.

A request's prefix is inserted into the tree and stored (the tree's own store path, which its
``checkpoint`` calls), the server is stopped with SIGTERM and a new one started over the same
tiers (so its L1 is empty), and a new radix cache with an empty device pool matches the prefix,
prefetches it (``prefetch_from_storage`` / ``check_prefetch_progress``) and loads it back
(``init_load_back``, completed by ``check_hicache_events``): byte-identical.

The server runs from the main test environment (LMCache 0.5.6 with its torch; ``tox -e py``
builds it, ``tox -e sglang`` points ``KVSTREAM_LMCACHE_BIN`` at it): SGLang pins another torch,
and here only LMCache's client code is installed (``--no-deps``). Transfers are engine-driven
(``--supported-transfer-mode engine_driven``): there is no CUDA IPC on a CPU machine.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import time
import urllib.request
from array import array

import pytest
import torch

pytestmark = pytest.mark.sglang

PAGE = 16
TOKENS = 512  # two LMCache chunks of 256


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Server:
    """``lmcache server`` with kvstream as its L2 adapter; stopped with SIGTERM."""

    def __init__(self, binary: str, tiers: list[str], log_path: str) -> None:
        self.port, http = _free_port(), _free_port()
        spec = {"type": "plugin", "module_path": "kvstream_backend",
                "class_name": "KVStreamL2Adapter", "adapter_params": {"tiers": [
                    {"name": f"t{i}", "path": d, "max_size_gb": 1}
                    for i, d in enumerate(tiers)]}}
        self._log = open(log_path, "wb")  # noqa: SIM115 - closed by stop()
        self.log_path = log_path
        self.proc = subprocess.Popen(
            [binary, "server", "--host", "127.0.0.1", "--port", str(self.port), "--http-port",
             str(http), "--l1-size-gb", "0.25", "--eviction-policy", "LRU",
             "--supported-transfer-mode", "engine_driven", "--l2-adapter", json.dumps(spec)],
            stdout=self._log, stderr=subprocess.STDOUT,
            env={**os.environ, "LMCACHE_DISABLE_BANNER": "1", "LMCACHE_TRACK_USAGE": "false"})
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:
            assert self.proc.poll() is None, f"lmcache server exited:\n{self.log()}"
            try:
                urllib.request.urlopen(f"http://127.0.0.1:{http}/config", timeout=2)
                return
            except OSError:
                time.sleep(0.5)
        raise AssertionError(f"lmcache server not serving after 120 s:\n{self.log()}")

    def log(self) -> str:
        self._log.flush()
        with open(self.log_path, errors="replace") as f:
            return f.read()[-6000:]

    def stop(self) -> int:
        self.proc.send_signal(signal.SIGTERM)
        try:
            return self.proc.wait(60)
        finally:
            if self.proc.poll() is None:
                self.proc.kill()
            self._log.close()


@pytest.fixture
def lmcache_bin() -> str:
    path = os.environ.get("KVSTREAM_LMCACHE_BIN", "")
    if not os.path.exists(path):
        pytest.fail(f"KVSTREAM_LMCACHE_BIN={path!r}: the `lmcache` of the main test environment "
                    "is needed (tox -e py first; tox -e sglang sets it)")
    return path


def _radix_cache(model_dir: str, mp_yaml: str):
    from sglang.srt.configs.model_config import ModelConfig
    from sglang.srt.mem_cache.allocator.paged import PagedTokenToKVPoolAllocator
    from sglang.srt.mem_cache.cache_init_params import CacheInitParams
    from sglang.srt.mem_cache.memory_pool import MHATokenToKVPool, ReqToTokenPool
    from sglang.srt.mem_cache.storage.lmcache.lmcache_unified_radix_cache import (
        LMCacheUnifiedRadixCache,
    )
    from sglang.srt.mem_cache.unified_cache.components.base import ComponentType
    from sglang.srt.server_args import ServerArgs, set_global_server_args_for_scheduler

    set_global_server_args_for_scheduler(ServerArgs(model_path="dummy", page_size=PAGE,
                                                    device="cpu"))
    kv = MHATokenToKVPool(size=4096, page_size=PAGE, dtype=torch.bfloat16, head_num=2,
                          head_dim=32, layer_num=2, device="cpu", enable_memory_saver=False)
    alloc = PagedTokenToKVPoolAllocator(4096, PAGE, torch.bfloat16, "cpu", kv, need_sort=False)
    rtp = ReqToTokenPool(size=8, max_context_len=4096, device="cpu", enable_memory_saver=False)
    params = CacheInitParams(disable=False, req_to_token_pool=rtp,
                             token_to_kv_pool_allocator=alloc, page_size=PAGE,
                             tree_components=(ComponentType.FULL,))
    cache = LMCacheUnifiedRadixCache(params, model_config=ModelConfig(model_dir), tp_size=1,
                                     tp_rank=0, lmcache_config_file=mp_yaml,
                                     forward_stream=None)
    return cache, kv, alloc


def _req(rid: str, tokens: list[int]):
    from sglang.srt.managers.schedule_batch import Req
    from sglang.srt.sampling.sampling_params import SamplingParams

    return Req(rid=rid, origin_input_text="", origin_input_ids=array("q", tokens),
               sampling_params=SamplingParams(temperature=0, max_new_tokens=1))


def _pump(cache, done, what: str, timeout: float = 60) -> None:
    deadline = time.monotonic() + timeout
    while not done():
        assert time.monotonic() < deadline, f"{what} not done in {timeout} s"
        cache.check_hicache_events()
        time.sleep(0.02)


def test_a_prefix_stored_through_lmcache_comes_back_from_kvstream_after_a_restart(
        tmp_path, lmcache_bin):
    from sglang.srt.mem_cache.base_prefix_cache import (
        CacheRequestHandle,
        InitLoadBackParams,
        InsertParams,
        MatchPrefixParams,
    )
    from sglang.srt.mem_cache.radix_cache import RadixKey

    model = tmp_path / "tiny"
    model.mkdir()
    (model / "config.json").write_text(json.dumps({
        "architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 64,
        "intermediate_size": 128, "num_attention_heads": 2, "num_key_value_heads": 2,
        "head_dim": 32, "num_hidden_layers": 2, "vocab_size": 512,
        "max_position_embeddings": 4096, "rms_norm_eps": 1e-5, "torch_dtype": "bfloat16"}))
    tiers = [str(tmp_path / "disk"), f"/dev/shm/kvs-sgl-lmc-{tmp_path.name}"]
    for d in tiers:
        os.makedirs(d, exist_ok=True)
    tokens = list(range(7, 7 + TOKENS))
    key = RadixKey(array("q", tokens))
    try:
        server = Server(lmcache_bin, tiers, str(tmp_path / "server1.log"))
        mp = tmp_path / "mp.yaml"
        mp.write_text(f'mp_host: "127.0.0.1"\nmp_port: {server.port}\nchunk_size: 256\n')
        cache, kv, alloc = _radix_cache(str(model), str(mp))
        bufs = kv.k_buffer + kv.v_buffer
        g = torch.Generator().manual_seed(23)
        for b in bufs:
            b.view(torch.uint8).copy_(torch.randint(0, 256, b.view(torch.uint8).shape,
                                                    dtype=torch.uint8, generator=g))
        slots = alloc.alloc(TOKENS)
        cache.insert(InsertParams(key=key, value=slots))
        want = torch.cat([b[slots].view(torch.uint8).flatten() for b in bufs])
        cache._submit_store(_req("writer", tokens), array("q", tokens))  # checkpoint's store
        _pump(cache, lambda: not cache.has_pending_cache_operations(), "the store")
        cache.shutdown()
        assert server.stop() in (0, -signal.SIGTERM), server.log()
        on_tiers = [sum(n.endswith(".kvs") for _, _, fs in os.walk(d) for n in fs)
                    for d in tiers]
        assert all(n >= 2 for n in on_tiers), on_tiers  # both chunks on both tiers

        server = Server(lmcache_bin, tiers, str(tmp_path / "server2.log"))  # L1 empty
        mp.write_text(f'mp_host: "127.0.0.1"\nmp_port: {server.port}\nchunk_size: 256\n')
        cache, kv, alloc = _radix_cache(str(model), str(mp))
        bufs = kv.k_buffer + kv.v_buffer
        req = _req("reader", tokens)
        handle = CacheRequestHandle("reader", 0)
        req.cache_request_handle = handle
        cache.prefetch_from_storage(handle, cache.root_node_handle(), tokens)
        _pump(cache, lambda: cache.check_prefetch_progress(handle), "the lookup")
        m = cache.match_prefix(MatchPrefixParams(key=key, req=req))
        assert (m.device_prefix_len, m.host_hit_length) == (0, TOKENS)
        loaded, _ = cache.init_load_back(InitLoadBackParams(
            best_match_node=m.best_match_node, host_hit_length=m.host_hit_length, req=req))
        assert loaded == TOKENS
        flow = cache._external_flows["reader"]
        _pump(cache, lambda: flow.load_completed, "the load")
        assert flow.load.result, server.log()
        got = torch.cat([b[flow.load.device_indices].view(torch.uint8).flatten()
                         for b in bufs])
        assert torch.equal(got, want)
        assert cache.match_prefix(MatchPrefixParams(key=key, req=req)).device_prefix_len == TOKENS
        cache.shutdown()
        assert server.stop() in (0, -signal.SIGTERM), server.log()
    finally:
        import shutil

        shutil.rmtree(tiers[1], ignore_errors=True)
