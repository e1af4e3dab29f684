/* AMX fp8 (W8A16): the AVX-512 direct FMA kernel for few rows; from KTK_AMX_FP8_DEQUANT_ROWS rows, the weights of the
 * called block range are dequantized to bf16(e4m3 * scale) (AVX-512, into the caller's workspace) and run through the
 * AMX table's gemm_bf16 (AMX-BF16 tiles, on the forward's tile-order copy of x where it gives one).
 * Layouts: see ../kernels.h.
 */
#include <stdint.h>
#include "../kernels.h"

#include "amx.h"

void ktk_avx512_gemm_fp8_direct(const ktk_mat *w, int nb0, int nb1, const ktk_act *x, float *y, int64_t ldy);
void ktk_avx512_dequant_fp8(const ktk_mat *w, int nb0, int nb1, uint16_t *dst);

void ktk_amx_gemm_fp8(const ktk_mat *w, int nb0, int nb1, const ktk_act *x, float *y, int64_t ldy) {
    if (ktk_fp8_dequant(w, x, KTK_AMX_FP8_DEQUANT_ROWS))
        ktk_fp8_dequant_gemm(w, nb0, nb1, x, y, ldy, ktk_avx512_dequant_fp8, ktk_kernels_amx()->gemm_bf16);
    else
        ktk_avx512_gemm_fp8_direct(w, nb0, nb1, x, y, ldy);
}
