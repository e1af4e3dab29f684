#!/usr/bin/env bash
# Where an auto prefill layer's CPU idles (probe_ahead_gap.py), one process per KTINJECT_SPIN_US setting in turns,
# on the GPU machine from the repository root (carry .whl):
#   [SPINS="50 1000 50 1000"] [THREADS="15 14 15 14", GATED="1 0 1 0": one per SPINS entry] [QUANT=int8] [TOKENS=512] \
#   bash tests/gpu/gap_stage.sh
set -uo pipefail
. tests/gpu/stage_lib.sh
stage_setup
export PYTHONPATH=/tmp/site:$PWD
n=0
for s in ${SPINS:-50 1000 50 1000}; do
  n=$((n + 1))
  th=$(echo "${THREADS:-}" | cut -s -d" " -f$n)
  gt=$(echo "${GATED:-}" | cut -s -d" " -f$n)
  echo "=== spin $s threads ${th:-default} gated ${gt:-1} $(steal)"
  KTINJECT_PREFILL_GATED=${gt:-1} KTINJECT_SPIN_US=$s timeout "${PROBE_S:-200}" python3 tests/gpu/probe_ahead_gap.py --quant "${QUANT:-int8}" \
    --tokens "${TOKENS:-512}" --reps "${REPS:-5}" ${th:+--threads $th} ${PROBE_ARGS:-} > "$OUT/gap-$n-$s.log" 2>&1
  echo "rc=$?"; grep "^#" "$OUT/gap-$n-$s.log"; grep -v "^#" "$OUT/gap-$n-$s.log" | tail -${TAIL:-3}
done
echo "=== $(steal) $(date -u +%FT%TZ) $(nvidia-smi --query-gpu=name --format=csv,noheader 2>/dev/null)"
