#!/usr/bin/env bash
# ktinject beside llama.cpp (llama-bench, experts on the CPU: -ot exps=CPU) on a GPU machine, from the repository
# root. llama.cpp is not part of this repository: build its llama-bench yourself (cmake -DGGML_CUDA=ON, target
# llama-bench) and give this script its path and the GGUF file(s) it should time, of Qwen3-30B-A3B's shapes (the
# bench model's: 48 layers, hidden 2048, 128 experts top-8, expert intermediate 768; random weights do, e.g. Q4_0):
#   LLAMA_BENCH=/path/to/llama-bench PEER_MODELS=/path/to/q4_0.gguf[,/path/to/q8_0.gguf] \
#     bash benchmarks/peer_stage.sh [prefill] [decode] [defer] [noise]      (default: prefill decode)
#   prefill  python -m ktinject.bench prefill --layers 12 (PQUANTS, default int4; LENGTHS, default 2048,8192;
#            MODES, default cpu,gpu,auto) --peer ...: llama-bench's prefill of the same lengths after ours (~2.5 min)
#   decode   python -m ktinject.bench decode --quant DQUANTS (default int4) --defer 0 --peer ...   (~2 min a quant)
#   defer    ... decode --quant int4 --defer 0,3 --prompt PROMPT (default 8192): deferral against none at a long
#            context (no peer)                                                                       (~2.5 min)
#   noise    ... decode --quant int4 --noise 1,2,4 --noise-only: one busy core, the spread of the runs (no peer)
# PEER_REPS (default 3): llama-bench's repetitions. Logs: $OUT/peer-<step>.log ($OUT: /tmp/ktinject-out by
# default); the rows that matter are printed, then a line a step.
set -uo pipefail
source benchmarks/stage_lib.sh
want="$*"; [ -z "$want" ] && want="prefill decode"
peer=()
if [[ " $want " == *" prefill "* || " $want " == *" decode "* ]]; then
  : "${LLAMA_BENCH:?LLAMA_BENCH=<path of a llama-bench binary> (prefill and decode time it beside ktinject)}"
  : "${PEER_MODELS:?PEER_MODELS=<GGUF>[,<GGUF>] (the model file(s) llama-bench times)}"
  [ -x "$LLAMA_BENCH" ] || { echo "LLAMA_BENCH=$LLAMA_BENCH: not an executable file"; exit 2; }
  peer=(--peer "$LLAMA_BENCH" --peer-model "$PEER_MODELS" --peer-reps "${PEER_REPS:-3}")
fi
stage_setup
steps=()
bench_step() {  # bench_step NAME ROWS CMD...: run when NAME was asked for, log, print the rows matching ROWS
  local name=$1 rows=$2 t0=$SECONDS; shift 2
  [[ " $want " == *" $name "* ]] || return 0
  echo "=== $name, $(steal)"
  "$@" > "$OUT/peer-$name.log" 2>&1
  echo "rc=$? $(steal)"
  grep -E "$rows" "$OUT/peer-$name.log" | cut -c1-330
  steps+=("$name $((SECONDS - t0))s")
}
bench_step prefill "^\| .*(prefill [0-9]+ |target|peer)" \
  python3 -m ktinject.bench prefill --layers 12 --quant "${PQUANTS:-int4}" --prefill "${LENGTHS:-2048,8192}" \
    --mode "${MODES:-cpu,gpu,auto}" --reps "${REPS:-2}" "${peer[@]}"
bench_step decode "^\| .*(defer 0: graph|llama|/ llama|peer|target|CPU experts alone  )" \
  python3 -m ktinject.bench decode --quant "${DQUANTS:-int4}" --defer 0 --tokens 64 "${peer[@]}"
bench_step defer "^\| defer" \
  python3 -m ktinject.bench decode --quant int4 --defer 0,3 --prompt "${PROMPT:-8192}" --tokens 64 --defer-rounds 3
bench_step noise "^\| (noise [0-9]+: |target)" \
  python3 -m ktinject.bench decode --quant int4 --noise 1,2,4 --noise-only --tokens 64
echo "=== $(git rev-parse --short HEAD 2>/dev/null) $(date -u +%FT%TZ) $(nvidia-smi --query-gpu=name --format=csv,noheader 2>/dev/null)"
printf '%s\n' "${steps[@]}"
