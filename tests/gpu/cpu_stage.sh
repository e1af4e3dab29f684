#!/usr/bin/env bash
# The decode step's CPU side and long-context deferral (issues 18, 20), one device call, from the repository root,
# carry .whl:   STEPS="tests profile threads longdefer" bash tests/gpu/cpu_stage.sh
#   tests      the GPU tests of the decode chain (fused, hostio, graph, deferral, KV cache, hot, serve; ~240 s)
#   profile    bench decode int4 --profile: kernel table of muted replays, the pool inside bare replays vs alone
#   threads    KTINJECT_THREADS=$THREADS_B vs the default, in turns (bench decode int4 --defer 0)
#   longdefer  bench decode int4 --defer $DEFER at a $PROMPT-token context (attention's share of the GPU part)
#   pipe       one-token pipeline on / off (KTINJECT_PIPE): probe_cpu_decode int4 batch 1 interleaved in one process,
#              then bench decode int4 --defer 0 with each, in turns ($ROUNDS)
#   batchpipe  the decode pipeline at batch $BATCH (KTINJECT_PIPE 0 / 1): probe_cpu_decode interleaved in one process,
#              then bench serve --streams 1,8 --layers 16 with each, in turns ($ROUNDS)
#   int8       bench decode int8 --defer 0 (issue 18's int8 figure through generate, three runs)
#   noise      bench decode int4 --noise 1 --noise-only with KTINJECT_PIPE=1, then =0 (decode with one busy core)
#   scaling    the host's CPU topology, then probe_cpu_decode.py int4 batch 1 over $SCALE_THREADS pool threads
#              (cold and cache-hot forwards, the read probe at each count): per-thread or shared limit?
# Logs under $OUT.
set -uo pipefail
. tests/gpu/stage_lib.sh
stage_setup
run() { PYTHONPATH=/tmp/site:$PWD "$@"; }
# pipe_ab NAME BATCH PASSES LIMIT PATTERN BENCH-ARGS...: the pipeline off / on (KTINJECT_PIPE) in probe_cpu_decode at
# BATCH, interleaved in one process, then `python -m ktinject.bench BENCH-ARGS` with each in turns ($ROUNDS rounds;
# the lines matching PATTERN shown)
pipe_ab() {
  local name=$1 batch=$2 passes=$3 limit=$4 pattern=$5; shift 5
  run timeout 150 python3 tests/gpu/probe_cpu_decode.py --layers 16 --quant int4 --threads 15 --batch "$batch" \
    --passes "$passes" --env KTINJECT_PIPE=0,1,0,1,0,1 > "$OUT/$name-probe.log" 2>&1
  echo "$name probe rc=$?"; grep -E "B=|profile" "$OUT/$name-probe.log" | cut -c1-250
  for r in $(seq "${ROUNDS:-1}"); do
    for v in 0 1; do
      echo "--- round $r KTINJECT_PIPE=$v $(steal)"
      KTINJECT_PIPE=$v PYTHONPATH=/tmp/site:$PWD timeout "$limit" python3 -m ktinject.bench "$@" \
        > "$OUT/$name-$v-$r.log" 2>&1
      grep -E "$pattern" "$OUT/$name-$v-$r.log" | cut -c1-300
    done
  done
}
for step in ${STEPS:-tests profile}; do
  echo "=== $step $(steal) $(date -u +%T)"
  case $step in
    tests)
      run timeout "${TESTS_S:-300}" python3 -m pytest -q -rs -m "gpu or amx" tests/test_fused_kernels.py \
        tests/test_hostio.py tests/gpu/test_graph_gpu.py tests/gpu/test_deferral_gpu.py tests/gpu/test_kv_cache_gpu.py \
        tests/gpu/test_hot_gpu.py tests/gpu/test_serve_gpu.py > "$OUT/tests.log" 2>&1
      echo "tests rc=$?"; grep -E "^(FAILED|ERROR)" "$OUT/tests.log" | head; tail -1 "$OUT/tests.log" ;;
    profile)
      run timeout 200 python3 -m ktinject.bench decode --quant int4 --tokens 32 --profile --hf-tokens 0 \
        > "$OUT/profile.log" 2>&1; echo "profile rc=$?"
      grep -E "^# native pool|waiting|muted|ktinject graph|CPU experts alone|roofline" "$OUT/profile.log" | cut -c1-300 ;;
    threads)
      for r in $(seq "${ROUNDS:-1}"); do
        for t in default "${THREADS_B:-16}"; do
          echo "--- round $r threads $t $(steal)"
          if [ $t = default ]; then env=(); else env=(KTINJECT_THREADS=$t); fi
          env "${env[@]}" PYTHONPATH=/tmp/site:$PWD timeout 200 python3 -m ktinject.bench decode --quant int4 \
            --defer 0 --tokens 32 --defer-rounds 3 > "$OUT/threads-$t-$r.log" 2>&1
          grep -E "^# injected|^# defer(: GPU|: CPU experts alone \|| 0)" "$OUT/threads-$t-$r.log" | cut -c1-260
        done
      done ;;
    longdefer)
      run timeout "${LONG_S:-280}" python3 -m ktinject.bench decode --quant int4 --defer "${DEFER:-0,2,3}" \
        --prompt "${PROMPT:-8192}" --tokens 32 --defer-rounds "${ROUNDS:-2}" > "$OUT/longdefer.log" 2>&1
      echo "longdefer rc=$?"; grep -E "^# (defer|injected)" "$OUT/longdefer.log" | cut -c1-300 ;;
    pipe)
      pipe_ab pipe 1 7 200 "^# defer(: GPU|: CPU experts alone|: CPU experts alone, a layer| 0)" decode --quant int4 \
        --defer 0 --tokens 32 --defer-rounds 3 ;;
    batchpipe)
      pipe_ab batchpipe "${BATCH:-8}" 5 240 "^\||^# (memory|batch|engine)" serve --quant int4 --streams 1,8 --layers 16 ;;
    int8)
      run timeout 240 python3 -m ktinject.bench decode --quant int8 --defer 0 --tokens 32 --defer-rounds 3 \
        > "$OUT/int8.log" 2>&1; echo "int8 rc=$?"
      grep -E "^# (injected|defer)" "$OUT/int8.log" | cut -c1-300 ;;
    noise)
      for v in 1 0; do
        echo "--- KTINJECT_PIPE=$v $(steal)"
        KTINJECT_PIPE=$v PYTHONPATH=/tmp/site:$PWD timeout 170 python3 -m ktinject.bench decode --quant int4 \
          --noise 1 --noise-only --tokens 32 > "$OUT/noise-$v.log" 2>&1
        grep -E "^# (noise|injected)" "$OUT/noise-$v.log" | cut -c1-300
      done ;;
    scaling)
      { lscpu; grep -m1 "model name" /proc/cpuinfo; grep MHz /proc/cpuinfo | sort | uniq -c | head -5; } \
        > "$OUT/lscpu.log" 2>&1
      grep -E "^(Model name|Thread|Core|Socket|NUMA node\(s\)|L2|L3|CPU\(s\))" "$OUT/lscpu.log"
      run timeout "${SCALE_S:-300}" python3 tests/gpu/probe_cpu_decode.py --layers 16 --quant int4 --batch 1 --hot \
        --passes 5 --threads "${SCALE_THREADS:-1,2,4,8,12,15,16}" > "$OUT/scaling.log" 2>&1
      echo "scaling rc=$?"; cut -c1-260 "$OUT/scaling.log" ;;
  esac
done
echo "=== end $(steal) $(date -u +%FT%TZ) $(nvidia-smi --query-gpu=name --format=csv,noheader 2>/dev/null)"
