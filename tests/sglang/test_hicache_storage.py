"""kvstream as SGLang's HiCache storage backend, with SGLang's real pools, config and factory."""

from __future__ import annotations

import glob
import os
import shutil
import threading

import pytest
import torch

from kvstream_backend.config import ConfigError

from .conftest import PAGE, create, extra_config, fill_random, host_pool, page_bytes

pytestmark = pytest.mark.sglang

LAYOUTS = ["page_first", "layer_first"]


def keys_for(n: int, tag: str = "") -> list[str]:
    return [f"{tag}{i:062x}".rjust(64, "0") for i in range(n)]


def stored(backend, host, n: int, seed: int = 1, tag: str = ""):
    """Fill the pool with random bytes, store ``n`` pages; returns keys, indices, snapshots."""
    fill_random(host, seed)
    idx = host.alloc(n * PAGE)
    keys = keys_for(n, tag)
    snap = [page_bytes(host, idx, i) for i in range(n)]
    assert backend.batch_set_v1(keys, idx) == [True] * n
    return keys, idx, snap


def chunk_files(root: str) -> list[str]:
    return sorted(glob.glob(os.path.join(root, "*", "chunks", "*", "*", "*")))


@pytest.mark.parametrize("layout", LAYOUTS)
def test_set_zero_get_is_byte_identical_in_both_layouts(tiers, backends, layout):
    b, host = backends(tiers, layout)
    keys, idx, snap = stored(b, host, 24)
    assert b.batch_exists(keys + keys_for(1, "f")) == 24
    host.kv_buffer.zero_()
    assert b.batch_get_v1(keys, idx) == [True] * 24
    assert [page_bytes(host, idx, i) for i in range(24)] == snap
    # every page is replicated to both tiers (deferred), into bucketed directories
    assert b.engine.flush(30)
    assert all(len(chunk_files(t)) == 24 for t in tiers)
    assert b.engine.stats().tiers[0].direct  # O_DIRECT straight into the pool's regions


def test_the_pages_of_one_call_are_read_from_both_tiers(tiers, backends):
    b, host = backends(tiers)
    keys, idx, snap = stored(b, host, 64)
    b.engine.flush(30)
    host.kv_buffer.zero_()
    before = [t.read_bytes for t in b.engine.stats().tiers]
    assert all(b.batch_get_v1(keys, idx))
    after = [t.read_bytes for t in b.engine.stats().tiers]
    served = [a - c for a, c in zip(after, before, strict=True)]
    assert sum(served) >= 64 * b._page_bytes and all(s > 0 for s in served), served
    assert [page_bytes(host, idx, i) for i in range(64)] == snap


def test_restart_serves_what_was_acknowledged(tiers, backends):
    b, host = backends(tiers)
    keys, idx, snap = stored(b, host, 16)
    b.close()  # acknowledged = first copy published; close drains the other copies
    b2, host2 = backends(tiers)
    idx2 = host2.alloc(16 * PAGE)
    assert b2.batch_exists(keys) == 16
    assert b2.batch_get_v1(keys, idx2) == [True] * 16
    assert [page_bytes(host2, idx2, i) for i in range(16)] == snap


def test_a_tier_removed_mid_get_is_served_by_the_other(tiers, backends):
    b, host = backends(tiers)
    keys, idx, snap = stored(b, host, 96)
    b.engine.flush(30)
    assert all(len(chunk_files(t)) == 96 for t in tiers)
    host.kv_buffer.zero_()
    gone = threading.Event()

    def remove() -> None:
        for d in glob.glob(os.path.join(tiers[1], "*", "chunks")):
            shutil.rmtree(d)
        gone.set()

    t = threading.Thread(target=remove)
    t.start()
    hits = b.batch_get_v1(keys, idx)
    t.join()
    assert gone.is_set() and not chunk_files(tiers[1])
    assert hits == [True] * 96
    assert [page_bytes(host, idx, i) for i in range(96)] == snap


@pytest.mark.parametrize("layout", LAYOUTS)
def test_corrupt_copies_are_read_from_the_next_tier_or_are_a_miss(tiers, backends, layout):
    b, host = backends(tiers, layout)
    keys, idx, snap = stored(b, host, 8)
    b.engine.flush(30)
    b.close()
    digest_files = [chunk_files(t) for t in tiers]
    assert all(len(f) == 8 for f in digest_files)
    by_name = [{os.path.basename(p): p for p in files} for files in digest_files]
    names = sorted(by_name[0])

    def corrupt(path: str) -> None:
        with open(path, "r+b") as f:
            f.seek(4096 + 1000)
            byte = f.read(1)
            f.seek(4096 + 1000)
            f.write(bytes([byte[0] ^ 0xFF]))

    for name in names[:3]:  # bad on one tier only: served from the other
        corrupt(by_name[0][name])
    for name in names[3:5]:  # bad on both: a miss
        corrupt(by_name[0][name])
        corrupt(by_name[1][name])
    b2, host2 = backends(tiers, layout)
    idx2 = host2.alloc(8 * PAGE)
    host2.kv_buffer.zero_()
    hits = b2.batch_get_v1(keys, idx2)
    assert hits.count(False) == 2
    for i, ok in enumerate(hits):
        if ok:  # never wrong bytes
            assert page_bytes(host2, idx2, i) == snap[i]
    # a copy found bad is quarantined (a page bad on both tiers was tried on both); a page
    # bad on tier 0 only may have been served by tier 1 without touching its bad copy
    q = [sum(t.quarantined.values()) for t in b2.engine.stats().tiers]
    assert 2 <= q[0] <= 5 and q[1] == 2, q
    assert b2.batch_get_v1(keys, idx2) == hits


def test_concurrent_writers_of_the_same_pages(tiers, backends):
    """Two backends (two engines, as two SGLang ranks or servers sharing the tiers) back up
    the same pages at once: first writer wins, nothing torn."""
    host = host_pool("page_first")
    fill_random(host, 7)
    idx = host.alloc(48 * PAGE)
    keys = keys_for(48)
    snap = [page_bytes(host, idx, i) for i in range(48)]
    b1, _ = backends(tiers, host=host)
    b2, _ = backends(tiers, host=host)
    out: list[list[bool]] = []
    ts = [threading.Thread(target=lambda b=b: out.append(b.batch_set_v1(keys, idx)))
          for b in (b1, b2)]
    for t in ts:
        t.start()
    for t in ts:
        t.join()
    assert out == [[True] * 48, [True] * 48]
    b1.close()
    b2.close()
    assert all(len(chunk_files(t)) == 48 for t in tiers)
    b3, host3 = backends(tiers)
    idx3 = host3.alloc(48 * PAGE)
    assert b3.batch_get_v1(keys, idx3) == [True] * 48
    assert [page_bytes(host3, idx3, i) for i in range(48)] == snap


def test_namespaces_keep_layouts_and_ranks_apart(tiers, backends):
    b, host = backends(tiers, "page_first")
    keys, _, _ = stored(b, host, 4)
    b_lf, _ = backends(tiers, "layer_first")
    assert b_lf.batch_exists(keys) == 0  # the same SGLang keys, another layout: no hit


def test_a_miss_in_the_middle_ends_the_leading_run(tiers, backends):
    b, host = backends(tiers)
    keys, idx, _ = stored(b, host, 6)
    b.engine.flush(30)
    b.engine.remove(b._key(keys[3]))
    assert b.batch_exists(keys) == 3
    assert b.batch_get_v1(keys, idx) == [True, True, True, False, True, True]
    assert b.engine.pinned() == 0  # the exists pins were released by the get


def test_config_errors_name_the_key(tiers):
    host = host_pool("page_first")
    bad = extra_config([tiers[0], "relative/path"])
    with pytest.raises(ConfigError, match=r"extra_config\.tiers\[1\]\.path"):
        create(bad, host, "page_first")
    no_v1 = extra_config(tiers)
    del no_v1["interface_v1"]
    with pytest.raises(ConfigError, match=r"extra_config\.interface_v1"):
        create(no_v1, host, "page_first")
    with pytest.raises(ConfigError, match=r"extra_config\.read_windw"):
        create(extra_config(tiers, read_windw=4), host, "page_first")


def test_hybrid_pools_are_refused_at_start(tiers, backends):
    b, host = backends(tiers)
    with pytest.raises(ValueError, match="mamba"):
        b.register_mem_host_pool_v2(host, "mamba")


def test_failure_injection_never_raises_into_sglang(tiers, monkeypatch, backends):
    """SGLang's own injector (random failures and delays) over kvstream: every call answers,
    and a page that is True holds the right bytes."""
    monkeypatch.setenv("SGLANG_TEST_HICACHE_BACKEND_RANDOM_FAILURE", "0.3")
    monkeypatch.setenv("SGLANG_TEST_HICACHE_BACKEND_RANDOM_DELAY", "0.01")
    b, host = backends(tiers)
    assert type(b).__name__ == "HiCacheStorageFailureInjector"
    fill_random(host, 3)
    idx = host.alloc(32 * PAGE)
    keys = keys_for(32)
    snap = [page_bytes(host, idx, i) for i in range(32)]
    for _ in range(5):
        b.batch_set_v1(keys, idx)
    host.kv_buffer.zero_()
    for _ in range(5):
        n = b.batch_exists(keys)
        hits = b.batch_get_v1(keys, idx)
        assert len(hits) == 32 and 0 <= n <= 32
        for i, ok in enumerate(hits):
            if ok:
                assert page_bytes(host, idx, i) == snap[i]


def test_the_tensor_path_without_v1_roundtrips(tiers, backends):
    b, host = backends(tiers)
    fill_random(host, 5)
    idx = host.alloc(4 * PAGE)
    pages = [host.get_data_page(idx[i * PAGE]).clone() for i in range(4)]
    assert b.batch_set(keys_for(4, "t"), pages)
    dst = [torch.zeros_like(p) for p in pages]
    got = b.batch_get(keys_for(4, "t"), dst)
    assert all(g is not None for g in got)
    assert all(torch.equal(d.view(torch.uint8), p.view(torch.uint8))
               for d, p in zip(dst, pages, strict=True))


def test_the_example_extra_config_is_what_sglang_hands_the_backend():
    from sglang.srt.mem_cache.hybrid_cache.hybrid_cache_controller import HybridCacheController

    from kvstream_backend.adapters.sglang_hicache import parse_extra_config

    path = os.path.join(os.path.dirname(__file__), "..", "..", "examples", "sglang-hicache.json")
    extra, threshold, *_ = HybridCacheController.parse_storage_backend_extra_config("@" + path)
    assert threshold == 256  # SGLang's own key, popped before the backend sees the dict
    cfg = parse_extra_config(extra, check_paths=False)
    assert [t.name for t in cfg.tiers] == ["nvme", "pfs"]
