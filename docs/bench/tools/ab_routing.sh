#!/bin/bash
# Interleaved A/B of two trees on the quick CPU bench: old, new, new, old (ROUNDS times), writing
# $OUT/{old,new}-N.json. Needs a worktree of the old commit (git worktree add /tmp/wt-old REV).
# By default the second tier is GlusterFS (up first: PFS_BRICK=/var/tmp/gbrick
# ../shared/tools/pfs-gluster.sh up); TIERS="" runs the default bench (disk + emulated tier).
set -u
OLD=${OLD:-/tmp/wt-old} NEW=${NEW:-$PWD} OUT=${OUT:-/tmp/ab} ROUNDS=${ROUNDS:-2}
PY=${PY:-$NEW/.tox/py/bin/python}
TIERS=${TIERS---tier /var/tmp/kvb-nvme --tier /mnt/pfs/kvb}
export LMCACHE_TRACK_USAGE=false DO_NOT_TRACK=1 VLLM_NO_USAGE_STATS=1 PYTHONHASHSEED=0
mkdir -p "$OUT" /var/tmp/kvb-nvme /mnt/pfs/kvb
for _ in $(seq "$ROUNDS"); do
  for v in old new new old; do
    if [ "$v" = old ]; then d=$OLD; else d=$NEW; fi
    n=$(ls "$OUT"/$v-*.json 2>/dev/null | wc -l)
    (cd "$d" && PYTHONPATH="$d" timeout 900 "$PY" -m kvstream_backend.cli bench --quick \
       --write-rounds 1 $TIERS \
       --json "$OUT/$v-$n.json" > "$OUT/$v-$n.log" 2>&1; echo "$v $n rc $?")
  done
done
