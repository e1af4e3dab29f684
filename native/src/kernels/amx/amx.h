/* Row thresholds of the AMX table (gemm.c, int4.c): where AMX tiles take over from the AVX-512 kernels; the table's
 * tile_rows (act.tiles from the forward) follow them. */
#ifndef KTK_AMX_H
#define KTK_AMX_H
/* Rows from which AMX beats AVX-512 (16 threads, Xeon with AMX, W 2048 x 2048 / 768 x 2048 / 2048 x 7168, forward-
 * shaped calls; native/tests/test_kernels.c bench): bf16 8 rows 0.80 vs 0.70 TFLOPS (6 rows: equal, memory-bound);
 * int8 8 rows equal (1.47 TOPS), 12 rows 2.35 vs 1.85. Whole forwards (python -m ktinject.bench kernels crossover
 * sweep, Qwen3 layer, every expert at the same rows): bf16 from 8 rows (time ratio 0.93 at 8); int8 from 12 (0.92;
 * at 10 rows 1.00-1.40 over three runs). */
#define KTK_AMX_MIN_ROWS_BF16 8
#define KTK_AMX_MIN_ROWS_INT8 12

/* Rows from which dequantizing + AMX-BF16 beats the direct VNNI kernel. Measured (native/tests/test_kernels.c
 * bench, TK_QUANT=int4 TK_ONLY=amx, "amx tiles" direct vs "dq"; 16 threads of the H100 machine's Xeon, G = 64,
 * GFLOPS direct / dequantizing, two runs, +-20% noise): W 768 x 2048: 16 rows 2232 / 1569 and 1150 / 1360, 32 rows
 * 1832 / 1693 and 2055 / 2774, 64 rows 2248 / 3549 and 2342 / 3769; W 2048 x 768: 16 rows 1564 / 1364 and
 * 1551 / 1440, 32 rows 1437 / 1817 and 1501 / 1709, 64 rows 1690 / 3141 and 1738 / 3499. The direct kernel levels
 * off at ~2 TFLOPS from 16 rows while AMX-BF16 keeps growing (3.4-4.3 TFLOPS at 64-128 rows): crossover ~16-32. */
#ifndef KTK_AMX_INT4_DEQUANT_ROWS
#define KTK_AMX_INT4_DEQUANT_ROWS 32
#endif
#endif
