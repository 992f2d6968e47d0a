#!/bin/bash
# One device call (issue 24): the trace replay. Everything it prints goes under $OUT; the JSON
# is written after every phase, so a call cut short keeps what it measured.
T0=$(date +%s)
source docs/bench/tools/device_setup.sh
echo "setup took $(( $(date +%s) - T0 )) s" >> $OUT/machine.log
timeout $(( 590 - ($(date +%s) - T0) )) python3 -c 'import sys; from kvstream_backend.cli import main; sys.exit(main())' bench --gpu \
    --trace conversation --trace-requests 20 --workdir /var/tmp \
    --json $OUT/replay.json --plot $OUT/replay.png > $OUT/replay.log 2>&1
echo "replay rc $? after $(( $(date +%s) - T0 )) s" >> $OUT/machine.log
