"""TEST-ONLY: an LMCache connector between vLLM-CPU's paged KV cache and LMCache MemoryObjs.

Why it exists: LMCache 0.5.6's vLLM connectors are CUDA kernels; on vLLM's CPU backend
``CreateGPUConnector`` raises "No supported cpu connector found". This pure-torch connector lets
a real vLLM-CPU store and retrieve real KV through LMCache (and kvstream), which is what the
end-to-end tests need. It is not tuned for speed.

Layout it assumes (vLLM-CPU 0.32, ``vllm/v1/attention/backends/cpu_attn.py``): one tensor per
layer of shape ``[num_blocks, kv_heads, block_size, 2 * head_size]`` whose memory, for each
(block, head), is ``K[block_size, head_size]`` followed by ``V[block_size, head_size]``. A
token's slot ``s`` (from vLLM's ``slot_mapping``) lives in block ``s // block_size`` at offset
``s % block_size``. LMCache's side is a KV_2LTD MemoryObj: ``[2, layers, tokens, heads*head]``.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from lmcache.v1.gpu_connector.gpu_connectors import GPUConnectorInterface
from lmcache.v1.memory_management import MemoryFormat, MemoryObj


def _kv_view(layer: torch.Tensor) -> torch.Tensor:
    """``[num_blocks, heads, 2, block_size, head]`` view of one vLLM-CPU layer (no copy)."""
    nb, heads, bs, two_d = layer.shape
    return layer.view(nb, heads, 2, bs, two_d // 2)


def gather(kvcaches: Sequence[torch.Tensor], slots: torch.Tensor) -> torch.Tensor:
    """The KV of ``slots`` as ``[2, layers, len(slots), heads*head]``."""
    out = []
    for layer in kvcaches:
        v = _kv_view(layer)
        bs = v.shape[3]
        sel = v[slots // bs, :, :, slots % bs, :]  # [T, heads, 2, head]
        out.append(sel.permute(2, 0, 1, 3).reshape(2, len(slots), -1))
    return torch.stack(out, dim=1)


def scatter(kvcaches: Sequence[torch.Tensor], slots: torch.Tensor, src: torch.Tensor) -> None:
    """Write ``src`` (``[2, layers, len(slots), heads*head]``) into ``slots`` of every layer."""
    for i, layer in enumerate(kvcaches):
        v = _kv_view(layer)
        heads, bs, d = v.shape[1], v.shape[3], v.shape[4]
        vals = src[:, i].reshape(2, len(slots), heads, d).permute(1, 2, 0, 3)
        v[slots // bs, :, :, slots % bs, :] = vals.to(v.dtype)


class VLLMCPUConnector(GPUConnectorInterface):
    """LMCache ``GPUConnectorInterface`` over vLLM-CPU's KV cache (see the module doc).

    kwargs as LMCache's vLLM adapter passes them: ``kvcaches`` (one tensor per layer),
    ``slot_mapping`` (slots of the whole sequence) and ``vllm_cached_tokens`` (tokens vLLM
    already holds: never overwritten on load).
    """

    def __init__(self, num_layers: int, hidden: int) -> None:
        self.num_layers = num_layers
        self.hidden = hidden
        self.kvcaches: list[torch.Tensor] | None = None

    @classmethod
    def from_metadata(cls, metadata: Any) -> VLLMCPUConnector:
        layers, _, _, heads, head = metadata.kv_shape
        return cls(layers, heads * head)

    def get_shape(self, num_tokens: int) -> torch.Size:
        return torch.Size([2, self.num_layers, num_tokens, self.hidden])

    def _caches(self, kwargs: dict) -> list[torch.Tensor]:
        if "kvcaches" in kwargs:
            self.kvcaches = list(kwargs["kvcaches"])
        assert self.kvcaches is not None, "kvcaches not provided"
        return self.kvcaches

    def from_gpu(self, memory_obj: MemoryObj, start: int, end: int, **kwargs: Any) -> None:
        assert memory_obj.tensor is not None
        slots = kwargs["slot_mapping"][start:end].long()
        memory_obj.tensor.copy_(gather(self._caches(kwargs), slots))
        memory_obj.metadata.fmt = MemoryFormat.KV_2LTD

    def to_gpu(self, memory_obj: MemoryObj, start: int, end: int, **kwargs: Any) -> None:
        assert memory_obj.tensor is not None
        skip = min(end - start, max(0, kwargs.get("vllm_cached_tokens", 0) - start))
        slots = kwargs["slot_mapping"][start + skip : end].long()
        if len(slots):
            scatter(self._caches(kwargs), slots, memory_obj.tensor[:, :, skip:])

    def batched_from_gpu(self, memory_objs, starts, ends, **kwargs: Any) -> None:
        for o, s, e in zip(memory_objs, starts, ends, strict=True):
            self.from_gpu(o, s, e, **kwargs)

    def batched_to_gpu(self, memory_objs, starts, ends, **kwargs: Any) -> None:
        for o, s, e in zip(memory_objs, starts, ends, strict=True):
            self.to_gpu(o, s, e, **kwargs)


def install() -> None:
    """Make LMCache's ``CreateGPUConnector`` return :class:`VLLMCPUConnector` on the CPU."""
    import lmcache.v1.gpu_connector as gc
    from lmcache import torch_device_type
    from lmcache.utils import EngineType

    if getattr(gc.CreateGPUConnector, "_kvstream_cpu", False):
        return
    original = gc.CreateGPUConnector

    def create(config, metadata, engine, layout_hints=None):  # type: ignore[no-untyped-def]
        if engine == EngineType.VLLM and torch_device_type == "cpu" and not config.use_layerwise:
            return VLLMCPUConnector.from_metadata(metadata)
        return original(config, metadata, engine, layout_hints=layout_hints)

    create._kvstream_cpu = True  # type: ignore[attr-defined]
    gc.CreateGPUConnector = create
