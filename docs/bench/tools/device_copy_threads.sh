#!/bin/bash
# One device call (issue 20): a memory tier's copy threads, the engine's default (with the limit
# rows) against `--set copy_threads=N`, N = the cores less SPARE (0), or with SET=spare_cores
# against `--set spare_cores=SPARE` (1), over /dev/shm alone and both tiers in both orders.
# FIRST=set runs the `--set` bench first (alternate it between calls). DEADLINE (560) s in all;
# everything under $OUT. Stop 39's call 3 ran it with a 3/4-of-the-cores default against
# SPARE=0; stop 41 with SPARE=1 (no gain: the threads must be kept off the core,
# docs/benchmarks.md), and prepared SET=spare_cores.
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
N=$(( $(nproc) - ${SPARE:-0} ))
auto() { bench auto --gpu-only kvstream-shm,kvstream,kvstream-rev,limits; }
if [ "${SET:-copy_threads}" = spare_cores ]; then  # the copy threads kept off SPARE cores
  set_n() { bench spare${SPARE:-1} --gpu-only kvstream-shm,kvstream,kvstream-rev \
                --set spare_cores=${SPARE:-1}; }
else  # N copy threads, anywhere
  set_n() { bench copy$N --gpu-only kvstream-shm,kvstream,kvstream-rev --set copy_threads=$N; }
fi
if [ "${FIRST:-auto}" = set ]; then set_n; auto; else auto; set_n; fi
