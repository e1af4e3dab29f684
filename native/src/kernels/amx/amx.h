/* Row thresholds of the AMX table (gemm.c, int4.c): where AMX tiles take over from the AVX-512 kernels; the table's
 * tile_rows (act.tiles from the forward) follow them. */
#ifndef KTK_AMX_H
#define KTK_AMX_H
/* Rows from which AMX beats AVX-512, in forward-shaped kernel calls (native/tests/test_kernels.c bench) and in whole
 * forwards (python -m ktinject.bench kernels crossover): below them the calls are bound by memory and the AVX-512
 * kernels are as fast or faster (docs/performance.md has the figures). */
#define KTK_AMX_MIN_ROWS_BF16 8
#define KTK_AMX_MIN_ROWS_INT8 12

/* Rows from which dequantizing + AMX-BF16 beats the direct VNNI kernel (native/tests/test_kernels.c bench,
 * TK_QUANT=int4 TK_ONLY=amx, "amx tiles" direct vs "dq"): the direct kernel levels off from a few dozen rows while
 * AMX-BF16 keeps growing with the rows; the crossover lies between 16 and 32 rows (docs/performance.md). */
#ifndef KTK_AMX_INT4_DEQUANT_ROWS
#define KTK_AMX_INT4_DEQUANT_ROWS 32
#endif

/* Rows from which gemm_fp8 dequantizes to bf16 and runs AMX-BF16 instead of the direct AVX-512 FMA kernel: a
 * starting point at the bf16 crossover, not measured yet (the kernel bench, TK_QUANT=fp8 TK_ONLY=amx, A/B); also the
 * rows from which the forward gives fp8 experts' x and h in tile order (tile_rows). */
#ifndef KTK_AMX_FP8_DEQUANT_ROWS
#define KTK_AMX_FP8_DEQUANT_ROWS 8
#endif
#endif
