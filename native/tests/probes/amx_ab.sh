#!/usr/bin/env bash
# Build and run the AMX kernel A/B (amx_ab.c). Variants: NAME:FLAGS pairs (default below), each a build of
# native/src/kernels/amx/gemm.c with FLAGS and its symbols renamed. Not a test. Usage:
#   bash native/tests/probes/amx_ab.sh [ROUNDS] [NAME:FLAGS ...]
set -eu
rounds=${1:-7}; shift || true
vars=("$@")
[ ${#vars[@]} -gt 0 ] || vars=("base:" "pipe:-DAMX_ORDER=1" "first:-DAMX_ORDER=2" "kc2k:-DKC_BYTES=2048"
                               "kc512:-DKC_BYTES=512" "nopack:-DAMX_PACK_MIN_ROWS_BF16=1000000"
                               "fakepack:-DKTK_TEST_BUILD -DAMX_FAKE_PACK=1")
d=$(mktemp -d)
: > /tmp/amx_ab_variants.h
objs=()
for v in "${vars[@]}"; do
  name=${v%%:*}; flags=${v#*:}
  cc -O2 -c $flags -Dktk_amx_gemm_bf16_tiles=v_${name}_bf16 -Dktk_amx_gemm_int8_tiles=v_${name}_int8 \
     -Dktk_kernels_amx=v_${name}_table native/src/kernels/amx/gemm.c -o $d/v_$name.o
  echo "V($name)" >> /tmp/amx_ab_variants.h
  objs+=($d/v_$name.o)
done
cc -O2 -pthread native/tests/probes/amx_ab.c native/src/kernels/*/*.c "${objs[@]}" -lm -o $d/amx_ab
$d/amx_ab "$rounds"
