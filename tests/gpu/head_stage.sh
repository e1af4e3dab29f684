#!/usr/bin/env bash
# The decode chain's projections on the GPU machine (carry .whl): the GPU tests of the pieces the ninth session
# changed (the LM head's kernel, graph == eager with every GEMV on the kernel, the whole-row rule's choices), then
# probe_qkv_choice.py in one process per target, the measured choice ("auto") against forced ones (muted replays,
# bare replays, generate), then `bench decode` (int4: the GPU + handshakes row names the choices).
#   [WHICH="qkv head"] [BENCH=1] bash tests/gpu/head_stage.sh
set -uo pipefail
. tests/gpu/stage_lib.sh
stage_setup
export PYTHONPATH=/tmp/site:$PWD
echo "=== $(steal)"
timeout "${TESTS_S:-200}" python3 -m pytest -q -rs -x tests/test_decode_layer.py tests/gpu/test_graph_gpu.py \
  tests/test_fused_kernels.py > "$OUT/tests.log" 2>&1
echo "tests rc=$?"; grep -E "passed|failed|^E  |Error" "$OUT/tests.log" | head -12
for which in ${WHICH:-qkv head}; do
  case $which in
    qkv) configs=${QKV_CONFIGS:-auto,cublas,4x2048x4,8x2048x8} ;;
    o) configs=${O_CONFIGS:-auto,8x2048x8,2x4096x4x1} ;;
    head) configs=${HEAD_CONFIGS:-auto,cublas,2x2048x2x1} ;;
  esac
  echo "=== $which $(steal)"
  (cd tests/gpu && timeout "${PROBE_S:-150}" python3 probe_qkv_choice.py --which "$which" --rounds 3 --tokens 32 \
    --configs "$configs" > "$OUT/probe-$which.log" 2>&1)
  echo "probe rc=$?"; grep -E "median|choices" "$OUT/probe-$which.log" | cut -c1-330
done
if [ "${BENCH:-1}" = 1 ]; then
  echo "=== bench $(steal)"
  timeout "${BENCH_S:-240}" python3 -m ktinject.bench decode --quant int4 --tokens 64 > "$OUT/bench.log" 2>&1
  echo "bench rc=$?"; grep -E "^\| (ktinject graph|split|coordination)" "$OUT/bench.log" | cut -c1-300
fi
echo "=== $(steal) $(date -u +%FT%TZ) $(nvidia-smi --query-gpu=name --format=csv,noheader 2>/dev/null)"
