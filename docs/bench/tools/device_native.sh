#!/bin/bash
# One device call (issue 20): the native read-and-hash loop against io_uring + verify threads
# and the Python loop, one tmpfs tier through the engine beside the plain reader. No LMCache.
export PYTHONPATH=/tmp/site:/tmp/nat:$PWD PYTHONHASHSEED=0
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl
mkdir -p /tmp/nat
EXT=$(python3 -c "import sysconfig; print(sysconfig.get_config_var('EXT_SUFFIX'))")
INC=$(python3 -c "import sysconfig; print(sysconfig.get_paths()['include'])")
gcc -O3 -shared -fPIC -I native -I "$INC" native/kvstream_native.c -o /tmp/nat/_kvstream_native$EXT || exit 3
{ nproc; uname -r; } > $OUT/machine.log 2>&1
KVS_VARIANTS='[["uring (default)",{},{"io":"uring"},null],
 ["threads, native loop",{},{"io":"threads"},null],
 ["threads, python loop",{},{"io":"threads"},null,true],
 ["off",{"verify_checksums":false},{"io":"uring"},null]]' \
  timeout 240 python3 docs/bench/tools/engine_read.py /dev/shm/er 32 256 3 > $OUT/er-native.log 2>&1
echo "rc $?" >> $OUT/er-native.log
