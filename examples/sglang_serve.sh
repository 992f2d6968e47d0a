#!/usr/bin/env bash
# SGLang 0.5.23 with LMCache's multi-process server and kvstream as that server's L2 adapter
# (GPU machine).
#   examples/sglang_serve.sh Qwen/Qwen2.5-7B-Instruct
# SGLang reaches LMCache only through `lmcache server`; kvstream is ONE adapter owning all its
# tiers (edit the tier paths in l2-adapter-kvstream.json). Stopping this script stops both.
# TRANSFER: the server's --supported-transfer-mode. SGLang's connector
# (UnifiedLMCacheMPConnector) needs "engine_driven" (or "auto") on a machine without CUDA IPC:
# with the server's default its constructor waits 300 s and times out. engine_driven takes one KV
# group (no SWA/Mamba hybrids), an NHD contiguous pool and a chunk size that is a multiple of
# SGLang's page size.
set -euo pipefail
MODEL=${1:?usage: $0 MODEL}
HERE=$(cd "$(dirname "$0")" && pwd)
export LMCACHE_TRACK_USAGE=false
lmcache server --host 127.0.0.1 --port 5556 --l1-size-gb "${L1_GB:-16}" --eviction-policy LRU \
  --supported-transfer-mode "${TRANSFER:-auto}" \
  --l2-adapter "$(cat "$HERE/l2-adapter-kvstream.json")" &
SERVER=$!
trap 'kill -TERM $SERVER; wait $SERVER' EXIT
python -m sglang.launch_server --model-path "$MODEL" --enable-lmcache \
  --lmcache-config-file "$HERE/sglang-mp.yaml"
