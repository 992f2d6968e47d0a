"""An engine-side client of ``lmcache server`` built from LMCache's own multi-process client code
(the engine-driven transfer context a CPU worker registers, and the SDK's store/retrieve), run
as its own process by tests/test_l2_server.py: ``python l2_client.py PORT HTTP_PORT store|load``.

The SDK (``lmcache.sdk.LMCacheSDKContext``) normally learns the KV geometry from a GPU engine's
registration; here a CPU worker registers it through ``create_transfer_context(...).register``
(the call vLLM's ``LMCacheMPWorkerAdapter`` makes) and the SDK is given that context. Prints one
JSON line: ``{"stored": bool}`` or ``{"tokens": int, "identical": bool}``.
"""

from __future__ import annotations

import json
import sys

import torch
from lmcache.sdk.context import LMCacheSDKContext
from lmcache.sdk.wrapper.contiguous import ContiguousTransferWrapper
from lmcache.v1.gpu_connector.utils import LayoutHints
from lmcache.v1.multiprocess.transfer_context.worker_transfer import create_transfer_context

LAYERS, HEADS, BLOCK, HEAD_DIM = 4, 2, 16, 64
MODEL = "kvstream-test/tiny"
TOKENS = list(range(1000, 1000 + 2048))  # 8 chunks of 256 tokens


def expected() -> torch.Tensor:
    g = torch.Generator().manual_seed(1)
    return torch.randn((2, LAYERS, len(TOKENS), HEADS * HEAD_DIM), generator=g).to(torch.bfloat16)


def main(port: int, http_port: int, mode: str) -> None:
    sdk = LMCacheSDKContext(f"tcp://127.0.0.1:{port}", f"http://127.0.0.1:{http_port}", MODEL)
    caches = {f"layer.{i}": torch.zeros((1, 2, HEADS, BLOCK, HEAD_DIM), dtype=torch.bfloat16)
              for i in range(LAYERS)}
    ctx = create_transfer_context(caches, instance_id=sdk.instance_id,
                                  req_client=sdk._req_client, mode="engine_driven")
    ctx.register(caches, MODEL, 1, sdk.chunk_size // BLOCK, 30.0,
                 layout_hints=LayoutHints(kv_layout="HND", num_kv_heads=HEADS,
                                          tokens_per_block=BLOCK, head_dim=HEAD_DIM))
    sdk._world_size, sdk._num_kv_readers = 1, 1
    sdk._transfer_ctx = ContiguousTransferWrapper(ctx.engine_driven_context, sdk.chunk_size)
    kv = expected()
    if mode == "store":
        print(json.dumps({"stored": bool(sdk.store(kv, TOKENS))}), flush=True)
    else:
        out = sdk.retrieve(TOKENS)
        same = out is not None and torch.equal(out.view(torch.int16), kv.view(torch.int16))
        print(json.dumps({"tokens": 0 if out is None else out.shape[2], "identical": same}),
              flush=True)
    sdk.close()


if __name__ == "__main__":
    main(int(sys.argv[1]), int(sys.argv[2]), sys.argv[3])
