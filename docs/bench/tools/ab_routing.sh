#!/bin/bash
# Interleaved A/B of two commits on the quick CPU bench, disk + GlusterFS (2026-12-06: the
# routing before, c07afb3, and after the open-pool guard and the cold-step hedge). Needs the
# GlusterFS tier up (PFS_BRICK=/var/tmp/gbrick ../shared/tools/pfs-gluster.sh up) and a
# worktree of the old commit: git worktree add /tmp/wt-old c07afb3. Runs old, new, new, old
# (twice with ROUNDS=2) and writes $OUT/{old,new}-N.json.
set -u
OLD=${OLD:-/tmp/wt-old} NEW=${NEW:-$PWD} OUT=${OUT:-/tmp/ab} ROUNDS=${ROUNDS:-2}
PY=${PY:-$NEW/.tox/py/bin/python}
export LMCACHE_TRACK_USAGE=false DO_NOT_TRACK=1 VLLM_NO_USAGE_STATS=1 PYTHONHASHSEED=0
mkdir -p "$OUT" /var/tmp/kvb-nvme /mnt/pfs/kvb
for _ in $(seq "$ROUNDS"); do
  for v in old new new old; do
    if [ "$v" = old ]; then d=$OLD; else d=$NEW; fi
    n=$(ls "$OUT"/$v-*.json 2>/dev/null | wc -l)
    (cd "$d" && PYTHONPATH="$d" timeout 900 "$PY" -m kvstream_backend.cli bench --quick \
       --write-rounds 1 --tier /var/tmp/kvb-nvme --tier /mnt/pfs/kvb \
       --json "$OUT/$v-$n.json" > "$OUT/$v-$n.log" 2>&1; echo "$v $n rc $?")
  done
done
