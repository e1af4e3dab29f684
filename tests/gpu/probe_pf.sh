#!/usr/bin/env bash
# Decode kernel A/B on the GPU machine's CPU: software prefetch distance (PF_BYTES) for the AVX-512 kernels,
# DeepSeek-V3 gate/up shape (2048 x 7168) and Qwen3 (768 x 2048), one token. Not a test.
set -u
for pf in ${PFS:-0 512 1024 2048}; do
  cc -O2 -pthread -DPF_BYTES=$pf native/tests/test_kernels.c native/src/kernels/*/*.c -lm -o /tmp/tk_pf$pf || exit 1
done
for shape in "2048 7168" "768 2048"; do
  for pf in ${PFS:-0 512 1024 2048}; do
    echo "PF_BYTES=$pf shape $shape: $(TK_ONLY=avx512 TK_QUANT=${QUANTS:-bf16,int8} /tmp/tk_pf$pf bench ${THREADS:-16} $shape 1 | grep 'n=1 ' | tr '\n' ' ')"
  done
done
