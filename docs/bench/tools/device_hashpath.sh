#!/bin/bash
# One device call (issue 20): one tmpfs tier through the engine beside the plain reader, over
# I/O paths, reader threads and hash piece sizes; then kvstream bench --gpu with the time left.
T0=$(date +%s)
left() { echo $(( 590 - ($(date +%s) - T0) )); }
export LMCACHE_TRACK_USAGE=false DO_NOT_TRACK=1 VLLM_NO_USAGE_STATS=1 PYTHONHASHSEED=0
export PYTHONPATH=/tmp/site:$PWD
python3 -c "import lmcache.cuda_ops" 2>/dev/null || (time bash .lmbuild/build-lmcache.sh) > $OUT/build.log 2>&1
mount -o remount,size=64G /dev/shm
{ nvidia-smi -L; nproc; python3 -c "import lmcache.cuda_ops; print('cuda_ops loaded')"; uname -r; } > $OUT/machine.log 2>&1
M=1048576
KVS_VARIANTS='[["uring",{},{"io":"uring"},null],
 ["uring-v16",{"verify_threads":16},{"io":"uring"},null],
 ["thr4-1M",{"io_threads":4},{"io":"threads"},null],
 ["thr8-1M",{"io_threads":8},{"io":"threads"},null],
 ["thr8-4M",{"io_threads":8},{"io":"threads"},'$((4*M))'],
 ["thr16-4M",{"io_threads":16},{"io":"threads"},'$((4*M))'],
 ["thr8-256K",{"io_threads":8},{"io":"threads"},262144],
 ["off",{"verify_checksums":false},{"io":"uring"},null]]' \
  timeout 240 python3 docs/bench/tools/engine_read.py /dev/shm/er 32 256 2 > $OUT/er-variants.log 2>&1
echo "er rc $? left before bench: $(left)" >> $OUT/machine.log
timeout $(( $(left) - 10 )) python3 -c 'import sys; from kvstream_backend.cli import main; sys.exit(main())' bench --gpu --gpu-rounds 1 --gpu-iters 2 --workdir /var/tmp --json $OUT/gpu.json > $OUT/gpu.log 2>&1
echo "bench rc $? left: $(left)" >> $OUT/machine.log
