#!/usr/bin/env bash
# The release formats at Qwen3-30B-A3B shapes on a GPU machine, from the repository root: random checkpoints written
# by bench load (bench.checkpoints), loaded, and decoded / prefilled from the files, llama.cpp beside on the same GGUF.
#   [LLAMA_BENCH=/path/to/llama-bench] bash benchmarks/formats_stage.sh [load] [decode] [prefill]  (default: load decode)
#   load     bench load --format bf16,fp8,gguf-q4_k_m,gguf-q8_0 --layers LAYERS --keep: seconds, GB/s, peak RSS against
#            resident + one layer, the experts' format, GGUF / safetensors per GB read (target 1.5x); then the bf16
#            and Q8_0 files are deleted (KEEP_ALL=1 keeps them: ~25 GB at 12 layers)                      (~3 min)
#   decode   bench decode --checkpoint on the Q4_K_M GGUF (--peer: llama-bench on that file), on the FP8 directory,
#            and bench decode --quant int8 --layers LAYERS in memory; each --defer 0 (median of 3 runs); then the
#            line "fp8 / int8" (target: at least 0.90)                                                (~5 min)
#   prefill  bench prefill --checkpoint on the Q4_K_M GGUF (--peer) and the FP8 directory, LENGTHS (default
#            2048,8192), modes cpu,gpu,auto, 2 reps                                                    (~5 min)
# LAYERS (default 12), DIR (default /tmp/ktinject-formats: the checkpoints, kept between calls while the machine
# stays warm), PEER_REPS (default 3). The gguf package must be importable (a wheel in ./.whl does). Logs:
# $OUT/formats-<step>.log ($OUT: /tmp/ktinject-out by default); the rows that matter are printed, then a line a step.
set -uo pipefail
source benchmarks/stage_lib.sh
want="$*"; [ -z "$want" ] && want="load decode"
LAYERS=${LAYERS:-12}; DIR=${DIR:-/tmp/ktinject-formats}
GGUF=$DIR/checkpoint-q4_k_m.gguf; FP8=$DIR/checkpoint-fp8
peer=()
if [ -n "${LLAMA_BENCH:-}" ]; then
  [ -x "$LLAMA_BENCH" ] || { echo "LLAMA_BENCH=$LLAMA_BENCH: not an executable file"; exit 2; }
  peer=(--peer "$LLAMA_BENCH" --peer-model "$GGUF" --peer-reps "${PEER_REPS:-3}")
fi
stage_setup
python3 -c "import gguf" 2>/dev/null || { echo "no gguf package: pip install gguf, or put its wheel in ./.whl"; exit 2; }
steps=()
step() {  # step NAME ROWS CMD...: run, log, print the rows matching ROWS
  local name=$1 rows=$2 t0=$SECONDS; shift 2
  echo "=== $name, $(steal)"
  "$@" > "$OUT/formats-$name.log" 2>&1
  echo "rc=$? $(steal)"
  grep -E "$rows" "$OUT/formats-$name.log" | cut -c1-330
  steps+=("$name $((SECONDS - t0))s")
}
files() {  # the Q4_K_M and FP8 checkpoints the decode and prefill steps read (written by the load step, else here)
  [ -f "$GGUF" ] && [ -d "$FP8" ] && return 0
  step write "^(fp8|gguf)" python3 -m ktinject.bench load --format gguf-q4_k_m,fp8 --layers "$LAYERS" --dir "$DIR" \
    --keep --phases stream
}
rate() { grep -E "^\| defer 0: graph decode " "$1" | head -1 | awk -F'|' '{gsub(/[ ,]/, "", $3); print $3}'; }
if [[ " $want " == *" load "* ]]; then
  step load "^(bf16|fp8|gguf)|^ +experts|GB read =|wrote|reusing" python3 -m ktinject.bench load \
    --format bf16,fp8,gguf-q4_k_m,gguf-q8_0 --layers "$LAYERS" --dir "$DIR" --keep
  [ -n "${KEEP_ALL:-}" ] || rm -rf "$DIR/checkpoint" "$DIR/checkpoint-q8_0.gguf" "$DIR"/cache-*
fi
if [[ " $want " == *" decode "* ]]; then
  files
  rows="^# checkpoint|^\| .*(defer 0: graph|llama|/ llama|peer|target|CPU experts alone  )"
  step decode-q4_k_m "$rows" python3 -m ktinject.bench decode --checkpoint "$GGUF" --defer 0 --tokens 64 "${peer[@]}"
  step decode-fp8 "$rows" python3 -m ktinject.bench decode --checkpoint "$FP8" --defer 0 --tokens 64
  step decode-int8 "$rows" python3 -m ktinject.bench decode --quant int8 --layers "$LAYERS" --defer 0 --tokens 64
  fp8=$(rate "$OUT/formats-decode-fp8.log"); int8=$(rate "$OUT/formats-decode-int8.log")
  if [ -n "$fp8" ] && [ -n "$int8" ]; then
    echo "fp8 / int8 decode ($LAYERS layers, same call): $fp8 / $int8 tok/s = $(awk -v a="$fp8" -v b="$int8" \
      'BEGIN { r = a / b; printf "%.3f (target: at least 0.90: %s)", r, r >= 0.9 ? "met" : "NOT met" }')"
  else
    echo "fp8 / int8 decode: a run gave no 'defer 0: graph decode' row (see the logs)"
  fi
fi
if [[ " $want " == *" prefill "* ]]; then
  files
  rows="^# .*checkpoint|^\| .*(prefill [0-9]+ |target|peer)"
  for ck in "$GGUF" "$FP8"; do
    name=prefill-$(basename "$ck" .gguf); args=()
    [ "$ck" = "$GGUF" ] && args=("${peer[@]}")
    step "$name" "$rows" python3 -m ktinject.bench prefill --checkpoint "$ck" --prefill "${LENGTHS:-2048,8192}" \
      --mode cpu,gpu,auto --reps 2 "${args[@]}"
  done
fi
echo "=== $(git rev-parse --short HEAD 2>/dev/null) $(date -u +%FT%TZ) $(nvidia-smi --query-gpu=name --format=csv,noheader 2>/dev/null)"
printf '%s\n' "${steps[@]}"
