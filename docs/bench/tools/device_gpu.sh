#!/bin/bash
# One device call (issue 20): kvstream bench --gpu, with the native loop and the into-GPU
# limit rows; DEADLINE (470) seconds in all; ONLY, if set, the --gpu-only list (an H200 took
# ~30 s a configuration: the whole bench no longer fits one call). Everything goes under $OUT.
T0=$(date +%s)
source docs/bench/tools/device_setup.sh
echo "setup took $(( $(date +%s) - T0 )) s" >> $OUT/machine.log
timeout $(( ${DEADLINE:-470} - ($(date +%s) - T0) )) python3 -c 'import sys; from kvstream_backend.cli import main; sys.exit(main())' \
    bench --gpu --gpu-rounds 1 --gpu-iters 2 ${ONLY:+--gpu-only $ONLY} --workdir /var/tmp \
    --json $OUT/gpu.json > $OUT/gpu.log 2>&1
echo "bench rc $? after $(( $(date +%s) - T0 )) s" >> $OUT/machine.log
