#!/usr/bin/env bash
# SGLang with its own hierarchical cache (HiCache) and kvstream as HiCache's storage (L3)
# backend, in the SGLang process: no LMCache involved (GPU machine).
#   examples/sglang_hicache_serve.sh Qwen/Qwen2.5-7B-Instruct
# Edit the tier paths in sglang-hicache.json. SGLang reads the "@file" form of the extra
# config itself; its own keys (prefetch_threshold, ...) sit in the same JSON.
set -euo pipefail
MODEL=${1:?usage: $0 MODEL}
HERE=$(cd "$(dirname "$0")" && pwd)
python -m sglang.launch_server --model-path "$MODEL" --page-size 64 \
  --enable-hierarchical-cache --hicache-mem-layout page_first \
  --hicache-storage-backend dynamic \
  --hicache-storage-backend-extra-config "@$HERE/sglang-hicache.json"
