"""The test-only vLLM-CPU connector's gather/scatter against a direct computation."""

from __future__ import annotations

import torch

from kvstream_backend.testing.vllm_cpu import gather, scatter


def _caches(layers=2, blocks=6, heads=2, bs=16, d=8):
    g = torch.Generator().manual_seed(0)
    return [torch.randn(blocks, heads, bs, 2 * d, generator=g).to(torch.bfloat16)
            for _ in range(layers)]


def _direct(caches, slots):
    """Token by token, from vLLM-CPU's definition: per (block, head) K[bs, d] then V[bs, d]."""
    layers, (_, heads, bs, two_d) = len(caches), caches[0].shape
    d = two_d // 2
    out = torch.empty(2, layers, len(slots), heads * d, dtype=caches[0].dtype)
    for li, layer in enumerate(caches):
        flat = layer.reshape(layer.shape[0], heads, 2 * bs, d)  # cpu_attn.py's view
        for t, s in enumerate(slots.tolist()):
            b, o = divmod(s, bs)
            for h in range(heads):
                out[0, li, t, h * d:(h + 1) * d] = flat[b, h, o]
                out[1, li, t, h * d:(h + 1) * d] = flat[b, h, bs + o]
    return out


def test_gather_matches_the_layout() -> None:
    caches = _caches()
    slots = torch.tensor([5, 17, 18, 40, 95, 0, 63])
    assert torch.equal(gather(caches, slots), _direct(caches, slots))


def test_scatter_inverts_gather_and_touches_nothing_else() -> None:
    caches = _caches()
    before = [c.clone() for c in caches]
    slots = torch.tensor([3, 33, 34, 70])
    src = torch.randn(2, 2, 4, 16).to(torch.bfloat16)
    scatter(caches, slots, src)
    assert torch.equal(gather(caches, slots), src)
    others = torch.tensor([s for s in range(96) if s not in slots.tolist()])
    assert torch.equal(gather(caches, others), gather(before, others))
