#!/bin/bash
# One device call (issue 20): the two-tier step against /dev/shm alone, in both tier orders,
# after the open-pool guard (the slow tier no longer reads the first request's tail at its
# lookup). Three steps per process: the first is cold (no rates measured yet).
T0=$(date +%s)
source docs/bench/tools/device_setup.sh
echo "setup took $(( $(date +%s) - T0 )) s" >> $OUT/machine.log
timeout $(( 440 - ($(date +%s) - T0) )) python3 -c 'import sys; from kvstream_backend.cli import main; sys.exit(main())' \
    bench --gpu --gpu-rounds 1 --gpu-iters 3 --gpu-only kvstream-shm,kvstream,kvstream-rev \
    --workdir /var/tmp --json $OUT/gpu.json > $OUT/gpu.log 2>&1
echo "bench rc $? after $(( $(date +%s) - T0 )) s" >> $OUT/machine.log
