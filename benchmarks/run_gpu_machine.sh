#!/usr/bin/env bash
# Build, check and benchmark on a GPU machine (the reference one: an H200 + 16 Xeon cores with AMX, no network).
# From the repository root:   bash benchmarks/run_gpu_machine.sh STAGE...
# If a ./.whl folder of wheels exists (e.g. a newer transformers for a machine without network), they are installed
# into /tmp/site first and put on PYTHONPATH. Stages (in the order given):
#   build          pip install -e . (the native library built in place)
#   info           python -m ktinject.info
#   harness        the native kernel harness (native/tests/test_kernels.c) and its one-thread bench
#   native         tests/native/test_native.py, tests/native/test_native_errors.py
#   gpu            every CUDA- and AMX-marked test (pytest -m "gpu or amx" tests), on the machine's transformers
#   gpu-newest     the same on the wheels in ./.whl-newest (the newest transformers the project declares): with
#                  gpu, both ends of the supported range, as CI does for the CPU tests
#   cpu-amx        the whole CPU suite on this host's best ISA (AMX) and again with KTINJECT_ISA=avx512
#                  (pytest-xdist: -n $JOBS, default 8)
#   families       tests/operators/test_families.py + tests/gpu_experts/test_placement.py with KTINJECT_ISA=amx
#   families-cuda  tests/operators/test_families.py with gpu="cuda"
#   bench-kernels bench-decode bench-prefill bench-load bench-hot bench-serve bench-prefix bench-agents
#                  python -m ktinject.bench <what>
#   defer          the expert-deferral GPU tests (tests/operators/test_deferral_gpu.py)
#   bench-defer    bench decode --defer $DEFER (default 0,1,2,3) per quant of $QUANTS (default "int4 bf16"), each cut
#                  off after $BENCH_S seconds (130); $TOKENS (32) decode tokens a timing, $ROUNDS (3) rounds
#   serve          tests/serve/test_serve_gpu.py (concurrent greedy requests through batched CUDA graphs = alone) and,
#                  on this CPU, tests/serve/test_batch_invariance.py + the scheduler's unit tests                 (~1 minute)
#   soak           benchmarks/soak_serve.py for $SOAK_MIN minutes (default 5): 16 streams, $SOAK_DISCONNECTS
#                  (default 100) clients gone mid-stream, the demo model on CUDA with graphs ($SOAK_ARGS adds
#                  options, e.g. "--bench-layers 8 --quant int4"); ends with "soak PASSED" or "soak FAILED"
#   soak-bg        the same, detached ($SOAK_MIN default 10), logging to /tmp/ktinject-soak.log
#   soak-log       copies that log to $OUT and prints its end and verdict
# e.g.  bash benchmarks/run_gpu_machine.sh build info native gpu bench-decode bench-prefill
# Each stage's log goes to $OUT/<stage>.log ($OUT defaults to /tmp/ktinject-out); a summary line per stage is
# printed last.
set -uo pipefail
OUT=${OUT:-/tmp/ktinject-out}; mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 TOKENIZERS_PARALLELISM=false
# the checkout first: scripts run as files (benchmarks/soak_serve.py) import ktinject from it, whether or not the
# editable install's path file is read by this interpreter
export PYTHONPATH=$PWD:${PYTHONPATH:-}
if [ -d .whl ]; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
  export PYTHONPATH=$PWD:/tmp/site:${PYTHONPATH#"$PWD:"}
fi
summary=()
stage() {  # stage NAME CMD...: run, log, remember the result
  local name=$1; shift
  local t0=$SECONDS
  echo "=== $name: $*"
  "$@" 2>&1 | tee "$OUT/$name.log"
  local rc=${PIPESTATUS[0]}
  summary+=("$name rc=$rc $((SECONDS - t0))s")
}
for s in "$@"; do
  case $s in
    build) stage build pip install -q --no-build-isolation --no-deps -e . ;;
    gpu-newest)
      if [ ! -d .whl-newest ]; then echo "gpu-newest: no ./.whl-newest folder of wheels"; summary+=("gpu-newest skipped"); continue; fi
      python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site-newest \
        .whl-newest/*.whl
      stage gpu-newest env PYTHONPATH="$PWD:/tmp/site-newest:${PYTHONPATH:-}" python3 -m pytest -q -rs -m "gpu or amx" tests ;;
    cpu-amx)
      stage cpu-amx python3 -m pytest -q -n "${JOBS:-8}" -m "not gpu" tests
      stage cpu-avx512 env KTINJECT_ISA=avx512 python3 -m pytest -q -n "${JOBS:-8}" -m "not gpu" tests ;;
    info) stage info python3 -m ktinject.info ;;
    harness) stage harness bash -c 'cc -O2 -pthread -DKTK_TEST_BUILD native/tests/test_kernels.c native/src/kernels/*/*.c -lm -o /tmp/tk && /tmp/tk && /tmp/tk bench 16' ;;
    native) stage native python3 -m pytest -q -x tests/native/test_native.py tests/native/test_native_errors.py ;;
    gpu) stage gpu python3 -m pytest -q -rs -m "gpu or amx" tests ;;
    families-cuda) stage families-cuda env KTINJECT_TEST_GPU=cuda python3 -m pytest -q -rs tests/operators/test_families.py ;;
    families) stage families env KTINJECT_ISA=amx python3 -m pytest -q -rs tests/operators/test_families.py tests/gpu_experts/test_placement.py ;;
    bench-kernels) stage bench-kernels python3 -m ktinject.bench kernels ;;
    bench-decode) stage bench-decode python3 -m ktinject.bench decode ;;
    bench-prefill) stage bench-prefill python3 -m ktinject.bench prefill ;;
    bench-load) stage bench-load python3 -m ktinject.bench load ;;
    bench-hot) stage bench-hot python3 -m ktinject.bench hot ;;
    defer) stage defer python3 -m pytest -q -rs -s tests/operators/test_deferral_gpu.py ;;
    bench-defer)  # expert deferral, one model build per quant, each cut off after BENCH_S seconds
      for q in ${QUANTS:-int4 bf16}; do
        stage "bench-defer-$q" timeout "${BENCH_S:-130}" python3 -m ktinject.bench decode --quant "$q" \
          --defer "${DEFER:-0,1,2,3}" --tokens "${TOKENS:-32}" --defer-rounds "${ROUNDS:-3}"
      done ;;
    serve) stage serve python3 -m pytest -q -rs tests/serve/test_serve_gpu.py tests/serve/test_batch_invariance.py \
             tests/serve/test_serve_units.py ;;
    bench-serve) stage bench-serve python3 -m ktinject.bench serve ;;
    bench-prefix) stage bench-prefix python3 -m ktinject.bench prefix ;;
    bench-agents) stage bench-agents python3 -m ktinject.bench agents ;;
    # shellcheck disable=SC2086  # SOAK_ARGS: several options
    soak) stage soak python3 benchmarks/soak_serve.py --minutes "${SOAK_MIN:-5}" --disconnects "${SOAK_DISCONNECTS:-100}" \
            ${SOAK_ARGS:-} ;;
    soak-bg)  # detached (the soak outlives this command); soak-log in a later command collects it
      # shellcheck disable=SC2086
      nohup python3 benchmarks/soak_serve.py --minutes "${SOAK_MIN:-10}" --disconnects "${SOAK_DISCONNECTS:-100}" \
        ${SOAK_ARGS:-} > /tmp/ktinject-soak.log 2>&1 < /dev/null &
      echo "soak started (pid $!) for ${SOAK_MIN:-10} minutes: /tmp/ktinject-soak.log; the soak-log stage collects it"
      summary+=("soak-bg started pid $!") ;;
    soak-log)
      cp /tmp/ktinject-soak.log "$OUT/soak.log" 2>/dev/null || echo "no /tmp/ktinject-soak.log (machine released?)"
      tail -n 40 "$OUT/soak.log" 2>/dev/null
      summary+=("soak-log: $(grep -E '^# soak (PASSED|FAILED)' "$OUT/soak.log" 2>/dev/null || echo 'not finished')") ;;
    *) echo "unknown stage $s"; exit 2 ;;
  esac
done
echo "=== summary (commit $(git rev-parse --short HEAD 2>/dev/null), $(date -u +%F), $(nvidia-smi --query-gpu=name --format=csv,noheader 2>/dev/null))"
printf '%s\n' "${summary[@]}"
