#!/bin/bash
# One device call (issue 24): the trace replay. Everything it prints goes under $OUT; the JSON
# is written after every phase, so a call cut short keeps what it measured. ONLY, if set, the
# --gpu-only list (on an H200 the whole replay outlasts one call: split it in two, each with
# lmcache-cpu, which kvsim needs).
T0=$(date +%s)
source docs/bench/tools/device_setup.sh
echo "setup took $(( $(date +%s) - T0 )) s" >> $OUT/machine.log
timeout $(( 590 - ($(date +%s) - T0) )) python3 -c 'import sys; from kvstream_backend.cli import main; sys.exit(main())' bench --gpu \
    --trace conversation --trace-requests 20 ${ONLY:+--gpu-only $ONLY} --workdir /var/tmp \
    --json $OUT/replay.json --plot $OUT/replay.png > $OUT/replay.log 2>&1
echo "replay rc $? after $(( $(date +%s) - T0 )) s" >> $OUT/machine.log
