#!/bin/bash
# Sourced by the device calls: LMCache built for the machine's torch (skipped when a warm
# machine has it) and kvstream's native read-and-hash loop, both under /tmp; /dev/shm large
# enough for a tier. Build output goes under $OUT.
export LMCACHE_TRACK_USAGE=false DO_NOT_TRACK=1 VLLM_NO_USAGE_STATS=1 PYTHONHASHSEED=0
export PYTHONPATH=/tmp/site:/tmp/nat:$PWD
if ! python3 -c "import lmcache.cuda_ops" 2>/dev/null; then
  if ls .whl/lmcache-*.whl > /dev/null 2>&1; then
    # LMCache built by an earlier call for this machine's torch (sm_90): install, no build;
    # such a call carries only [".whl"] (37 MiB), not .lmbuild
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
        --target /tmp/site .whl/*.whl > $OUT/build.log 2>&1
  else
    (time bash .lmbuild/build-lmcache.sh) > $OUT/build.log 2>&1
    # the wheel just built comes back: put it in .whl/ here (fetch.sh's folder, git-excluded)
    # and the next fresh machine installs it instead of building (100-170 s of device time)
    cp /tmp/lmwheel/lmcache-*.whl $OUT/ 2>/dev/null
  fi
fi
EXT=$(python3 -c "import sysconfig; print(sysconfig.get_config_var('EXT_SUFFIX'))")
INC=$(python3 -c "import sysconfig; print(sysconfig.get_paths()['include'])")
mkdir -p /tmp/nat
[ -f /tmp/nat/_kvstream_native$EXT ] || gcc -O3 -shared -fPIC -I native -I "$INC" \
    native/kvstream_native.c -o /tmp/nat/_kvstream_native$EXT >> $OUT/build.log 2>&1
mount -o remount,size=64G /dev/shm
{ nvidia-smi -L; nproc; uname -r; git log -1 --oneline 2>/dev/null
  python3 -c "import lmcache.cuda_ops; print('cuda_ops loaded')"
  python3 -c "from kvstream_backend.io.threads import NATIVE; print('native loop', NATIVE)"
} >> $OUT/machine.log 2>&1
