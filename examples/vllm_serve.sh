#!/usr/bin/env bash
# vLLM's OpenAI server with LMCache + kvstream (GPU machine).
#   examples/vllm_serve.sh Qwen/Qwen2.5-7B-Instruct
set -euo pipefail
MODEL=${1:?usage: $0 MODEL}
HERE=$(cd "$(dirname "$0")" && pwd)
export LMCACHE_CONFIG_FILE=${LMCACHE_CONFIG_FILE:-$HERE/lmcache-kvstream.yaml}
export LMCACHE_TRACK_USAGE=false
kvstream check-config "$LMCACHE_CONFIG_FILE"
exec vllm serve "$MODEL" \
  --kv-transfer-config '{"kv_connector":"LMCacheConnectorV1","kv_role":"kv_both","kv_load_failure_policy":"recompute"}'
