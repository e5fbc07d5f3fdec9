#!/usr/bin/env bash
# The layered redesign against the tree before it (commit 3257209), same machine, same call.
# Set-up (here): git archive 3257209 sidecar bench tests/kvtest.py tests/dataplane/dptest.py | tar -x -C .bench/base
# and python -m benchmarks.lib.kvsource --out .bench/kvsrc.pt; on the GPU machine: source benchmarks/lib/device_env.sh.
set -u; export PYTHONUNBUFFERED=1; KV=$PWD/.bench/kvsrc.pt; BASE=$PWD/.bench/base; NEW=$PWD
FB="--device cuda --chunks 64 --shape 32,8,128 --kvsrc $KV --distinct 4 --procs 8 --presets raw-direct,balanced,compact --window 8 --repeats 3"
AS="measure --kvsrc $KV --contexts 32768 --links 25 --methods auto,raw,balanced"
for round in 1 2; do
  (cd $BASE && PYTHONPATH=/tmp/site:$BASE/sidecar:$BASE/bench:$BASE/tests python3 bench/fetch_bench.py $FB --out $OUT/fetch_base_$round.json)
  (cd $NEW && PYTHONPATH=/tmp/site:$NEW/sidecar:$NEW python3 -m benchmarks.restore_rate.fetch_bench $FB --out $OUT/fetch_new_$round.json)
done
(cd $BASE && PYTHONPATH=/tmp/site:$BASE/sidecar:$BASE/bench:$BASE/tests python3 bench/auto_scale_bench.py $AS --out $OUT/auto70b_base.json)
(cd $NEW && PYTHONPATH=/tmp/site:$NEW/sidecar:$NEW python3 -m benchmarks.auto_70b.auto_scale_bench $AS --out $OUT/auto70b_new.json)
