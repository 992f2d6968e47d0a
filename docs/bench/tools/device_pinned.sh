#!/bin/bash
# One device call (issue 20, stop 39): does the scatter slow down because its thread lacks a
# core of its own? scatter_contention.py with 16 and 15 readers, unpinned and pinned to CPUs 1..
# (the scatter's thread on CPU 0), with and without the GIL holder. Everything under $OUT.
T0=$(date +%s)
source docs/bench/tools/device_setup.sh
echo "setup took $(( $(date +%s) - T0 )) s" >> $OUT/machine.log
timeout ${LIMIT:-150} python3 docs/bench/tools/scatter_contention.py \
    --loads 16,15,15p,16g,15g,15pg,12g --json $OUT/contention.json > $OUT/contention.log 2>&1
echo "contention rc $? after $(( $(date +%s) - T0 )) s" >> $OUT/machine.log
