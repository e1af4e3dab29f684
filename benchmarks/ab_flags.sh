#!/usr/bin/env bash
# Interleaved A/B of native build flags (e.g. the kernels' prefetch distance) on a GPU machine's CPU, from the
# repository root (~4 minutes with two variants and two rounds):
#   VARIANTS="base: pf4k:-DPF_BYTES=4096" bash benchmarks/ab_flags.sh
# Each variant (NAME:FLAGS, flags joined by commas) is this tree built with KTINJECT_CFLAGS=FLAGS in its own copy
# (/tmp/ab-NAME); benchmarks/probe_cpu_decode.py runs ROUNDS (default 2) times for each, in turns, host steal read
# beside each. Logs under $OUT (default /tmp/ktinject-out). PROBE_ARGS replaces the probe's arguments.
set -uo pipefail
. benchmarks/stage_lib.sh
stage_setup
names=()
for v in ${VARIANTS:?VARIANTS=\"NAME:FLAGS ...\"}; do
  name=${v%%:*}; flags=${v#*:}; flags=${flags//,/ }
  rm -rf "/tmp/ab-$name"; mkdir -p "/tmp/ab-$name"
  git ls-files -z | xargs -0 cp --parents -t "/tmp/ab-$name"
  (cd "/tmp/ab-$name" && KTINJECT_CFLAGS="$flags" PYTHONPATH=/tmp/site python3 ktinject/native/build.py \
     > "$OUT/build-$name.log" 2>&1) || { echo "build $name failed"; tail -20 "$OUT/build-$name.log"; exit 1; }
  names+=("$name")
  echo "variant $name: KTINJECT_CFLAGS='$flags'"
done
args=${PROBE_ARGS:---layers 16 --quant int4 --threads 15 --batch 1,8 --passes 5}
for r in $(seq "${ROUNDS:-2}"); do
  for name in "${names[@]}"; do
    echo "=== round $r $name $(steal)"
    # shellcheck disable=SC2086
    (cd "/tmp/ab-$name" && PYTHONPATH=/tmp/site:/tmp/ab-$name timeout 200 python3 benchmarks/probe_cpu_decode.py $args 2>&1 \
      | grep -v Warning)
  done
done 2>&1 | tee "$OUT/ab.log" | grep -E "^===|B=|fit|read bandwidth"
echo "=== $(steal) $(date -u +%FT%TZ)"
