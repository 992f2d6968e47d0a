#!/bin/bash
# One device call (issue 20): the two-tier step (disk listed first) against /dev/shm alone;
# in run 6 the slow tier read the first request's tail at its lookup. Three steps per
# process: the first is cold (no rates measured yet). GPU_ONLY picks the configurations
# (default kvstream-shm,kvstream).
T0=$(date +%s)
source docs/bench/tools/device_setup.sh
echo "setup took $(( $(date +%s) - T0 )) s" >> $OUT/machine.log
timeout $(( 285 - ($(date +%s) - T0) )) python3 -c 'import sys; from kvstream_backend.cli import main; sys.exit(main())' \
    bench --gpu --gpu-rounds 1 --gpu-iters 3 --gpu-only ${GPU_ONLY:-kvstream-shm,kvstream} \
    --workdir /var/tmp --json $OUT/gpu.json > $OUT/gpu.log 2>&1
echo "bench rc $? after $(( $(date +%s) - T0 )) s" >> $OUT/machine.log
