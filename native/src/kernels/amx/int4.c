/* AMX int4 (W4A8): the AVX-512 VNNI direct kernel for few rows; from KTK_AMX_INT4_DEQUANT_ROWS rows, the weights of
 * the called block range are dequantized to bf16 (AVX-512, into the caller's workspace) and run through the AMX
 * table's gemm_bf16 (AMX-BF16 tiles, or AVX-512 below its own crossover). Every AMX CPU has AVX-512 VNNI.
 * Layouts: see ../kernels.h.
 */
#include <stdint.h>
#include "../kernels.h"

#include "amx.h"

void ktk_avx512_gemm_int4_vnni_direct(const ktk_mat *w, int nb0, int nb1, const ktk_act *x, float *y, int64_t ldy);
void ktk_avx512_dequant_int4(const ktk_mat *w, int nb0, int nb1, uint16_t *dst);

void ktk_amx_gemm_int4(const ktk_mat *w, int nb0, int nb1, const ktk_act *x, float *y, int64_t ldy) {
    if (ktk_int4_dequant(w, x, KTK_AMX_INT4_DEQUANT_ROWS))
        ktk_int4_dequant_gemm(w, nb0, nb1, x, y, ldy, ktk_avx512_dequant_int4, ktk_kernels_amx()->gemm_bf16);
    else
        ktk_avx512_gemm_int4_vnni_direct(w, nb0, nb1, x, y, ldy);
}
