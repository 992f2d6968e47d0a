"""TEST-ONLY helpers. Nothing here is used by the plugin itself.

``vllm_cpu`` is an LMCache connector for vLLM's CPU backend, so that the end-to-end tests (and
``examples/vllm_offline.py --cpu``) can run a real vLLM with LMCacheConnectorV1 on a machine
without a GPU; ``site/sitecustomize.py`` installs it lazily in vLLM's worker processes.
"""
