#!/bin/bash
# One device call (issue 20, stop 39): what slows the scatter while /dev/shm is read.
# scatter_contention.py (LocalCPUBackend's step under native readers and a GIL holder), then
# `bench --gpu --gpu-only kvstream-shm` three ways: as is, with a 0.5 ms switch interval (the
# GIL's forced hand-off; set in every process through a sitecustomize), and with a fixed
# window of 16 reads (the first step's window, sized from a lone probe). DEADLINE (560) s.
T0=$(date +%s)
left() { echo $(( ${DEADLINE:-560} - ($(date +%s) - T0) )); }
source docs/bench/tools/device_setup.sh
echo "setup took $(( $(date +%s) - T0 )) s" >> $OUT/machine.log
timeout $(( $(left) < 150 ? $(left) : 150 )) python3 docs/bench/tools/scatter_contention.py \
    --json $OUT/contention.json > $OUT/contention.log 2>&1
echo "contention rc $? after $(( $(date +%s) - T0 )) s" >> $OUT/machine.log
rm -rf /dev/shm/kvstream-contention
mkdir -p /tmp/swi
echo 'import os, sys; v = os.environ.get("KVSTREAM_SWITCH_MS"); v and sys.setswitchinterval(float(v) / 1e3)' \
    > /tmp/swi/sitecustomize.py
bench() {  # NAME, then extra arguments
  local name=$1; shift
  [ $(left) -gt 40 ] || { echo "$name skipped: out of time" >> $OUT/machine.log; return; }
  timeout $(left) python3 -c 'import sys; from kvstream_backend.cli import main; sys.exit(main())' \
      bench --gpu --gpu-rounds 1 --gpu-iters 3 --gpu-only kvstream-shm --workdir /var/tmp \
      --json $OUT/gpu-$name.json "$@" > $OUT/gpu-$name.log 2>&1
  echo "bench $name rc $? after $(( $(date +%s) - T0 )) s" >> $OUT/machine.log
}
bench plain
export KVSTREAM_SWITCH_MS=0.5 PYTHONPATH=/tmp/swi:$PYTHONPATH
bench switch
unset KVSTREAM_SWITCH_MS; export PYTHONPATH=${PYTHONPATH#/tmp/swi:}
bench window16 --set read_window=16
