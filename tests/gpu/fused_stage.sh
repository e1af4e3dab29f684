#!/usr/bin/env bash
# The fused decode kernels of issue 18 on the GPU machine, in one device call (about 4 minutes), from the repository
# root (carry .whl for transformers 5.24):   bash tests/gpu/fused_stage.sh [probe]
#   kernels  the GPU-marked tests of the Triton kernels (tests/test_fused_kernels.py: every kernel against float64,
#            the attention replayed in a CUDA graph) and of the paths that use them (decode layer, decode attention,
#            router)
#   bench    python -m ktinject.bench decode --quant int4 --profile --hf-tokens 0: the muted replay (GPU part of a
#            step, every expert skipped) and the kernel list of 3 muted replays (48 layers)
#   graph    tests/gpu/test_graph_gpu.py with the Triton GEMVs forced (KTINJECT_GEMV=triton; tiny models otherwise
#            keep cuBLAS): graph decode == eager == HF's greedy tokens, 32 tokens
#   probe    (only when asked) tests/gpu/probe_fused.py: each fused piece against the torch ops it replaces, timed in
#            CUDA graphs, and every GEMV config against cuBLAS at the model's shapes
# Logs: $OUT/<step>.log; a summary line per step last.
set -uo pipefail
OUT=${OUT:-/tmp/ktinject-out}; mkdir -p "$OUT"
OUT=$OUT bash tests/gpu/run_gpu_machine.sh build > "$OUT/setup.log" 2>&1  # carried wheels, native build
grep -q "^build rc=0" "$OUT/setup.log" || { tail -30 "$OUT/setup.log"; exit 1; }
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 TOKENIZERS_PARALLELISM=false
[ -d .whl ] && export PYTHONPATH=/tmp/site:${PYTHONPATH:-}  # where run_gpu_machine.sh put the carried wheels
python3 -c "import torch, triton, transformers; print('torch', torch.__version__, 'triton', triton.__version__,
'transformers', transformers.__version__, torch.cuda.get_device_name())" 2>&1 | tee "$OUT/versions.log"
summary=()
step() {  # step NAME SECONDS CMD...: run with a time limit, log, remember the result
  local name=$1 limit=$2; shift 2
  local t0=$SECONDS
  echo "=== $name: $*"
  timeout "$limit" "$@" > "$OUT/$name.log" 2>&1
  local rc=$?
  tail -n 25 "$OUT/$name.log"
  summary+=("$name rc=$rc $((SECONDS - t0))s")
}
step kernels 100 python3 -m pytest -q -rs -m gpu tests/test_fused_kernels.py tests/test_decode_layer.py \
  tests/test_decode_attention.py tests/test_router.py
step bench 160 python3 -m ktinject.bench decode --quant int4 --profile --hf-tokens 0
grep -E "split: GPU|kernels of|Triton|nvjet|_k |Memcpy|elementwise|norm|splitK|index" "$OUT/bench.log" | head -40
step graph 100 env KTINJECT_GEMV=triton python3 -m pytest -q -rs -s tests/gpu/test_graph_gpu.py
if [ "${1:-}" = probe ]; then
  step probe 120 env PYTHONPATH="$PWD:$PWD/tests/gpu:${PYTHONPATH:-}" python3 tests/gpu/probe_fused.py
fi
echo "=== summary (commit $(git rev-parse --short HEAD 2>/dev/null), $(date -u +%F), $(nvidia-smi --query-gpu=name --format=csv,noheader 2>/dev/null))"
printf '%s\n' "${summary[@]}"
