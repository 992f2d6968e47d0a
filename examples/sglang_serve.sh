#!/usr/bin/env bash
# SGLang with its LMCache integration (in-process, layerwise) and kvstream (GPU machine).
#   examples/sglang_serve.sh Qwen/Qwen2.5-7B-Instruct
# SGLang's integration reads LMCACHE_CONFIG_FILE; kvstream serves the layerwise keys it uses
# through batched_async_contains / batched_get_non_blocking.
set -euo pipefail
MODEL=${1:?usage: $0 MODEL}
HERE=$(cd "$(dirname "$0")" && pwd)
export LMCACHE_CONFIG_FILE=${LMCACHE_CONFIG_FILE:-$HERE/lmcache-kvstream.yaml}
export LMCACHE_TRACK_USAGE=false
kvstream check-config "$LMCACHE_CONFIG_FILE"
exec python -m sglang.launch_server --model-path "$MODEL" --enable-lmcache
