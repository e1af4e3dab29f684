#!/usr/bin/env bash
# ktinject beside llama.cpp (llama-bench, experts on the CPU) in one device call, for issues 18 and 19. From the
# repository root on the GPU machine, carry [".whl", ".peer"] (`bash ../shared/tools/peer-llamacpp.sh fetch` here
# first):
#   bash tests/gpu/peer_stage.sh [build] [prefill] [decode] [defer] [noise]   (default: build prefill decode)
#   build    llama-bench -> /tmp/lbuild/bin (~5 min), random Qwen3-30B-A3B GGUFs /tmp/q.gguf (Q4_0) and, with
#            Q8=1, /tmp/q8.gguf (Q8_0); skipped where they are there (/tmp survives while the machine stays warm)
#   prefill  python -m ktinject.bench prefill --layers 12 (PQUANTS, default int4; LENGTHS, default 2048,8192;
#            MODES, default cpu,gpu,auto) --peer ... : llama-bench's prefill of the same lengths after ours
#   decode   python -m ktinject.bench decode --quant DQUANTS (default int4) --defer 0 (three rounds) --peer ...
#            (issue 18's targets judged in its output: tok/s, the GPU part)
#   defer    ... decode --quant int4 --defer 0,3 --prompt PROMPT (default 8192; issue 20: d=3 against d=0 at a
#            long context, where attention makes the GPU part worth overlapping: 16384 gave 1.274x on 2026-11-27)
#   noise    ... decode --quant int4 --noise 1,2,4 --noise-only (issue 18: one busy core, the spread of the runs)
# A whole pass (build ~5.5 min, prefill ~2.5, decode ~2 a quant, defer ~2.5, noise ~3) takes two or three calls:
# /tmp (the peer, the GGUFs) survives between them while the machine stays warm (30 s).
# Logs: $OUT/peer-<step>.log; the rows that matter are printed.
set -uo pipefail
source tests/gpu/stage_lib.sh
stage_setup
[ -d .whl ] && export PYTHONPATH=/tmp/site:${PYTHONPATH:-}
want="$*"; [ -z "$want" ] && want="build prefill decode"
LB=/tmp/lbuild/bin/llama-bench
models=/tmp/q.gguf; [ "${Q8:-0}" = 1 ] && models+=,/tmp/q8.gguf
bench_models=${PEER_MODELS:-$models}  # the GGUFs llama-bench times (PEER_MODELS=/tmp/q8.gguf: Q8_0 alone)
steps=()
if [[ " $want " == *" build "* ]]; then
  t0=$SECONDS
  df -h /tmp | tail -1
  if [ "${Q8:-0}" = 1 ] && [ ! -s /tmp/q8.gguf ]; then
    ( sleep 20; PYTHONPATH=/tmp/peersite python3 .peer/make_random_gguf.py /tmp/q8.gguf --preset qwen3-30b-a3b \
        --type Q8_0 --fast --workers 4 --no-verify > "$OUT/peer-q8.log" 2>&1 ) & q8=$!
  fi
  if [ ! -x $LB ] || [ ! -s /tmp/q.gguf ]; then
    bash .peer/peer-llamacpp.sh build Q4_0 > "$OUT/peer-build.log" 2>&1 || tail -20 "$OUT/peer-build.log"
  fi
  [ -n "${q8:-}" ] && { wait "$q8" || tail -5 "$OUT/peer-q8.log"; }
  ls -la $LB /tmp/q*.gguf 2>&1
  steps+=("build $((SECONDS - t0))s")
fi
peer=(--peer $LB --peer-model "$bench_models" --peer-reps "${PEER_REPS:-3}")
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
echo "=== $(git rev-parse --short HEAD 2>/dev/null) $(date -u +%FT%TZ) $(nvidia-smi --query-gpu=name --format=csv,noheader)"
printf '%s\n' "${steps[@]}"
