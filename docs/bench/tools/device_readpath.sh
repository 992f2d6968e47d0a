#!/bin/bash
# The device call of 2026-12-05 (docs/benchmarks.md, issue 20): build LMCache for the machine's torch, then the engine against the plain reader,
# then kvstream bench --gpu. Everything it prints goes under $OUT.
T0=$(date +%s)
left() { echo $(( 590 - ($(date +%s) - T0) )); }
(time bash .lmbuild/build-lmcache.sh) > $OUT/build.log 2>&1
export PYTHONPATH=/tmp/site:$PWD
mount -o remount,size=64G /dev/shm
export LMCACHE_TRACK_USAGE=false DO_NOT_TRACK=1 VLLM_NO_USAGE_STATS=1 PYTHONHASHSEED=0
{ nproc; python3 -c "import lmcache.cuda_ops; print('cuda_ops loaded')"; which fio; uname -r; } > $OUT/machine.log 2>&1
E=docs/bench/tools/engine_read.py
timeout 70 python3 $E /dev/shm/er 32 256 2 > $OUT/er-shm.log 2>&1
KVS_TIER_OPTS='{"io":"uring"}' timeout 70 python3 $E /dev/shm/er 32 256 2 > $OUT/er-shm-uring.log 2>&1
echo "left before bench: $(left)" >> $OUT/machine.log
timeout $(( $(left) - 45 )) python3 -c 'import sys; from kvstream_backend.cli import main; sys.exit(main())' bench --gpu --gpu-rounds 1 --gpu-iters 3 --workdir /var/tmp --json $OUT/gpu.json > $OUT/gpu.log 2>&1
echo "bench rc $? left after bench: $(left)" >> $OUT/machine.log
timeout $(( $(left) - 3 )) python3 $E /var/tmp/er 32 64 3 > $OUT/er-disk.log 2>&1
echo done >> $OUT/machine.log
