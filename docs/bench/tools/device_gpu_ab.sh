#!/bin/bash
# One device call: A/B of the routing on the GPU step. The old tree is this one with
# .old/routing.py (carried: `git show REV:kvstream_backend/policy/routing.py > .old/routing.py`,
# carry [".whl", ".lmbuild", ".old"]). Each tree runs kvstream-shm (the best single tier) and
# both tier orders, ROUNDS (2) interleaved rounds of two steps; ORDER="new old" swaps the trees;
# "cold" in ORDER also runs this tree with --gpu-cold (step 0 makes the GPU connector's first
# calls), one round; DEADLINE (585) seconds in all; CONFIGS the --gpu-only list.
# Everything goes under $OUT.
T0=$(date +%s)
source docs/bench/tools/device_setup.sh
echo "setup took $(( $(date +%s) - T0 )) s" >> $OUT/machine.log
rm -rf /tmp/oldtree && mkdir -p /tmp/oldtree && cp -r kvstream_backend /tmp/oldtree/ \
    && cp .old/routing.py /tmp/oldtree/kvstream_backend/policy/routing.py
for v in ${ORDER:-old new}; do
  if [ $v = old ]; then D=/tmp/oldtree; else D=$PWD; fi
  if [ $v = cold ]; then X="--gpu-cold --gpu-rounds 1"; else X="--gpu-rounds ${ROUNDS:-2}"; fi
  P=/tmp/site:/tmp/nat:$D  # and run from $D: python -c puts the working directory first
  left=$(( ${DEADLINE:-585} - ($(date +%s) - T0) ))
  [ $left -gt 60 ] || break
  t=$(( left < 230 ? left : 230 ))
  (cd $D && PYTHONPATH=$P timeout $t python3 -c 'import sys; from kvstream_backend.cli import main; sys.exit(main())' \
      bench --gpu --gpu-only ${CONFIGS:-kvstream-shm,kvstream,kvstream-rev} $X --gpu-iters 2 \
      --workdir /var/tmp --json $OUT/gpu-$v.json > $OUT/gpu-$v.log 2>&1)
  echo "$v rc $? after $(( $(date +%s) - T0 )) s ($(cd $D && PYTHONPATH=$P python3 -c 'import kvstream_backend.policy.routing as r; print(r.__file__)'))" >> $OUT/machine.log
done
