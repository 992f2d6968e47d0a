#!/bin/bash
# One device call: build LMCache for the machine's torch (skipped when a warm machine has it),
# then the trace replay (issue 24). Everything it prints goes under $OUT.
export LMCACHE_TRACK_USAGE=false DO_NOT_TRACK=1 VLLM_NO_USAGE_STATS=1 PYTHONHASHSEED=0
export PYTHONPATH=/tmp/site:$PWD
python3 -c "import lmcache.cuda_ops" 2>/dev/null || (time bash .lmbuild/build-lmcache.sh) > $OUT/build.log 2>&1
mount -o remount,size=64G /dev/shm
{ nvidia-smi -L; nproc; python3 -c "import lmcache.cuda_ops; print('cuda_ops loaded')"; uname -r; git log -1 --oneline 2>/dev/null; } > $OUT/machine.log 2>&1
python3 -c 'import sys; from kvstream_backend.cli import main; sys.exit(main())' bench --gpu \
    --trace conversation --trace-requests 20 --workdir /var/tmp \
    --json $OUT/replay.json --plot $OUT/replay.png > $OUT/replay.log 2>&1
echo "replay rc $?" >> $OUT/machine.log
