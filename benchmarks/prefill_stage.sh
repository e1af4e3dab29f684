#!/usr/bin/env bash
# Streamed GPU prefill on a GPU machine, from the repository root (the wheels of a ./.whl folder, where there is one,
# installed first, as run_gpu_machine.sh does):
#   bash benchmarks/prefill_stage.sh [tests] [bench] [QUANTS]     (default: tests bench bf16,int8,int4; ~6-8 minutes)
#   tests  tests/gpu_experts/test_prefill_gpu.py (unpack bit-exact on CUDA, one layer vs float64 for every quant and awkward
#          shape, gpu / auto / forced split == cpu for qwen3_moe, deepseek_v3, gpt_oss, copies overlapping compute
#          on CUDA events, no memory growth over 20 prompts) and tests/gpu_experts/test_prefill_stream.py (CPU tensors)
#   bench  python -m ktinject.bench prefill on 12 of the 48 Qwen3-30B-A3B layers (percentages of the streaming limit
#          do not depend on the layer count; tok/s x 12/48 = the whole model's), cpu / gpu / auto at 512, 2048, 8192
#          (LENGTHS=512 for fewer)
# Logs: $OUT/prefill-<step>.log ($OUT: /tmp/ktinject-out by default); the rows that matter, a summary line a step.
set -uo pipefail
OUT=${OUT:-/tmp/ktinject-out}; mkdir -p "$OUT"
OUT=$OUT bash benchmarks/run_gpu_machine.sh build > "$OUT/prefill-setup.log" 2>&1  # ./.whl wheels, native build
grep -q "^build rc=0" "$OUT/prefill-setup.log" || { tail -30 "$OUT/prefill-setup.log"; exit 1; }
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 TOKENIZERS_PARALLELISM=false
[ -d .whl ] && export PYTHONPATH=/tmp/site:${PYTHONPATH:-}
want="" quants=bf16,int8,int4
for a in "$@"; do case $a in tests|bench) want+=" $a ";; *) quants=$a;; esac; done
[ -z "$want" ] && want=" tests bench "
done_steps=()
run_step() {  # run_step NAME LIMIT CMD...
  local name=$1 limit=$2 t0=$SECONDS rc; shift 2
  echo "=== $name ($limit s at most): $*"
  timeout "$limit" "$@" > "$OUT/prefill-$name.log" 2>&1; rc=$?
  done_steps+=("$name rc=$rc $((SECONDS - t0))s")
}
if [[ $want == *" tests "* ]]; then
  run_step tests 200 python3 -m pytest -q -rs -s tests/gpu_experts/test_prefill_gpu.py tests/gpu_experts/test_prefill_stream.py
  grep -E "passed|failed|error|copies .* ms" "$OUT/prefill-tests.log" | tail -8
fi
if [[ $want == *" bench "* ]]; then
  run_step bench 420 python3 -m ktinject.bench prefill --layers 12 --quant "$quants" --prefill "${LENGTHS:-512,2048,8192}" \
    --mode cpu,gpu,auto
  grep -E "^# (bf16|int8|int4)|^\| .*(target|per layer)" "$OUT/prefill-bench.log" | head -60
fi
echo "=== $(git rev-parse --short HEAD 2>/dev/null) $(date -u +%FT%TZ) $(nvidia-smi --query-gpu=name --format=csv,noheader 2>/dev/null)"
printf '%s\n' "${done_steps[@]}"
