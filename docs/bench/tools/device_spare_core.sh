#!/bin/bash
# One device call (issue 20, stop 40): a memory tier's copy threads one per core but one
# (`--set copy_threads=$(nproc)-1`, the scatter's thread keeps a core) against the default (one
# per core, with the limit rows), over /dev/shm alone and both tiers in both orders. FIRST=spare
# runs the spare-core bench first (alternate it between calls). DEADLINE (560) s in all;
# everything under $OUT.
T0=$(date +%s)
source docs/bench/tools/device_setup.sh
echo "setup took $(( $(date +%s) - T0 )) s" >> $OUT/machine.log
bench() {  # NAME, then bench arguments
  local name=$1 left=$(( ${DEADLINE:-560} - ($(date +%s) - T0) )); shift
  [ $left -gt 60 ] || { echo "bench $name skipped: out of time" >> $OUT/machine.log; return; }
  timeout $left python3 -c 'import sys; from kvstream_backend.cli import main; sys.exit(main())' \
      bench --gpu --gpu-rounds 1 --gpu-iters 3 --workdir /var/tmp --json $OUT/gpu-$name.json \
      "$@" > $OUT/gpu-$name.log 2>&1
  echo "bench $name rc $? after $(( $(date +%s) - T0 )) s" >> $OUT/machine.log
}
spare() { bench spare --gpu-only kvstream-shm,kvstream,kvstream-rev \
              --set copy_threads=$(( $(nproc) - 1 )); }
auto() { bench auto --gpu-only kvstream-shm,kvstream,kvstream-rev,limits; }
if [ "${FIRST:-auto}" = spare ]; then spare; auto; else auto; spare; fi
