#!/usr/bin/env bash
# Why a layer's CPU job takes longer inside graph decode than driven from Python (issue 21), and where a 48-layer
# int4 decode step goes (issue 18): one device call (~9 minutes), from the repository root, carry .whl:
#   bash tests/gpu/diag_graph.sh
# probe_cpu_decode.py --graph (one-input replays, fresh-ids replays, Python-driven forwards of the same injected
# layers, each with the pool's profile) at batch 8 and 1, batch 8 again with 16 pool threads; then bench decode int4.
set -uo pipefail
. tests/gpu/stage_lib.sh
stage_setup
export PYTHONPATH=/tmp/site:$PWD
cat /sys/kernel/mm/transparent_hugepage/enabled /sys/kernel/mm/transparent_hugepage/defrag > "$OUT/thp.log" 2>&1
run() {  # run NAME LIMIT CMD...
  local name=$1 limit=$2; shift 2
  { echo "# $(steal)"; timeout "$limit" "$@" 2>&1 | grep -v Warning; echo "# $(steal)"; } > "$OUT/$name.log"
  echo "=== $name"; grep -E "^# (graph|Python|.*profile|steal|int4|threads)" "$OUT/$name.log" | cut -c1-420
}
for s in ${STEPS:-g8 g1 g8t16 decode}; do
  case $s in
    g8) run graph-b8 200 python3 tests/gpu/probe_cpu_decode.py --graph 16 --quant int4 --batch 8 ;;
    g1) run graph-b1 200 python3 tests/gpu/probe_cpu_decode.py --graph 16 --quant int4 --batch 1 ;;
    g8t16) run graph-b8-t16 200 env KTINJECT_THREADS=16 python3 tests/gpu/probe_cpu_decode.py --graph 16 --quant int4 --batch 8 ;;
    decode) run decode-int4 200 python3 -m ktinject.bench decode --quant int4 --defer 0 --tokens 32 --defer-rounds 3
            tail -12 "$OUT/decode-int4.log" | cut -c1-400 ;;
  esac
done
echo "=== $(date -u +%FT%TZ) $(nvidia-smi --query-gpu=name --format=csv,noheader 2>/dev/null) $(git rev-parse --short HEAD) $(steal)"
