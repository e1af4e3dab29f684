/* AMX int4 (W4A8): the AVX-512 VNNI direct kernel for few rows; from KTK_AMX_INT4_DEQUANT_ROWS rows, the weights of
 * the called block range are dequantized to bf16 (AVX-512, into the caller's workspace) and run through the AMX
 * table's gemm_bf16 (AMX-BF16 tiles, or AVX-512 below its own crossover). Every AMX CPU has AVX-512 VNNI.
 * Layouts: see ../../kernels.h.
 */
#include <stdint.h>
#include "../../kernels.h"

/* Rows from which dequantizing + AMX-BF16 beats the direct VNNI kernel. Measured (native/tests/test_kernels.c
 * bench, TK_QUANT=int4 TK_ONLY=amx, "amx tiles" direct vs "dq"; 16 threads of the H100 machine's Xeon, G = 64,
 * GFLOPS direct / dequantizing, two runs, +-20% noise): W 768 x 2048: 16 rows 2232 / 1569 and 1150 / 1360, 32 rows
 * 1832 / 1693 and 2055 / 2774, 64 rows 2248 / 3549 and 2342 / 3769; W 2048 x 768: 16 rows 1564 / 1364 and
 * 1551 / 1440, 32 rows 1437 / 1817 and 1501 / 1709, 64 rows 1690 / 3141 and 1738 / 3499. The direct kernel levels
 * off at ~2 TFLOPS from 16 rows while AMX-BF16 keeps growing (3.4-4.3 TFLOPS at 64-128 rows): crossover ~16-32. */
#ifndef KTK_AMX_INT4_DEQUANT_ROWS
#define KTK_AMX_INT4_DEQUANT_ROWS 32
#endif

void ktk_avx512_gemm_int4_vnni_direct(const ktk_mat *w, int nb0, int nb1, const ktk_act *x, float *y, int64_t ldy);
void ktk_avx512_dequant_int4(const ktk_mat *w, int nb0, int nb1, uint16_t *dst);

void ktk_amx_gemm_int4(const ktk_mat *w, int nb0, int nb1, const ktk_act *x, float *y, int64_t ldy) {
    if (ktk_int4_dequant(w, x, KTK_AMX_INT4_DEQUANT_ROWS))
        ktk_int4_dequant_gemm(w, nb0, nb1, x, y, ldy, ktk_avx512_dequant_int4, ktk_kernels_amx()->gemm_bf16);
    else
        ktk_avx512_gemm_int4_vnni_direct(w, nb0, nb1, x, y, ldy);
}
