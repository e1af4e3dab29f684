/* mxfp4 (W4A16: e2m1 weights with an e8m0 power-of-two scale per output row and 32 inputs, bf16 activations)
 * reference kernels, and the pieces of the direct path shared by every ISA.
 *
 * direct:  y[t][j] = sum_g fmaf(p_g, 2^(e_jg - 127), .) (ascending g, from 0.0f), p_g = the fmaf sum of x[t][c] *
 *          e2m1(W[j][c]) over the group's 32 inputs (ascending, from 0.0f). The products are exact (bf16 x two
 *          significant bits); the ISA kernels run the same float operations in the same order per output lane, so
 *          they match this one bit for bit (subnormals included: nothing is flushed).
 * dequant: mxfp4 blocks -> bf16(e2m1 * 2^(e - 127)) in the bf16 packed layout (exact), then the ISA's gemm_bf16
 *          (fp8's ktk_fp8_dequant_gemm: a chunk of blocks that fits the caller's workspace at a time).
 * Layouts: see ../kernels.h. Only plain loops in the reference: this file is the truth for the kernel tests.
 */
#include <math.h>
#include <string.h>

#include "../kernels.h"

static inline uint8_t q_f4(const ktk_mat *w, int n, int c) {
    const uint8_t b = w->data_f4[((int64_t)(n / 16) * (w->Kp / 8) + c / 8) * 64 + (n % 16) * 4 + (c % 8) / 2];
    return c % 2 ? b >> 4 : b & 15;
}

static inline float scale_f4(const ktk_mat *w, int n, int g) {
    return ktk_e8m0_to_f32(w->scale_e8[((int64_t)(n / 16) * (w->Kp / KTK_MXFP4_GROUP) + g) * 16 + n % 16]);
}

void ktk_generic_gemm_mxfp4_direct(const ktk_mat *w, int nb0, int nb1, const ktk_act *x, float *y, int64_t ldy) {
    const int ng = w->K / KTK_MXFP4_GROUP;
    for (int t = 0; t < x->n; t++)
        for (int j = nb0 * 16; j < nb1 * 16; j++) {
            float acc = 0.0f;
            for (int g = 0; g < ng; g++) {
                float p = 0.0f;
                for (int c = g * KTK_MXFP4_GROUP; c < (g + 1) * KTK_MXFP4_GROUP; c++)
                    p = fmaf(ktk_bf16_to_f32(x->x_bf16[(int64_t)t * x->Kp + c]), ktk_e2m1_to_f32(q_f4(w, j, c)), p);
                acc = fmaf(p, scale_f4(w, j, g), acc);
            }
            y[(int64_t)t * ldy + (j - nb0 * 16)] = acc;
        }
}

void ktk_generic_dequant_mxfp4(const ktk_mat *w, int nb0, int nb1, uint16_t *dst) {
    const int64_t Kp = w->Kp;
    for (int b = nb0; b < nb1; b++)
        for (int c = 0; c < Kp; c++)
            for (int r = 0; r < 16; r++) {
                const int n = b * 16 + r;
                const float v = ktk_e2m1_to_f32(q_f4(w, n, c)) * scale_f4(w, n, c / KTK_MXFP4_GROUP);
                dst[((int64_t)(b - nb0) * (Kp / 2) + c / 2) * 32 + r * 2 + c % 2] = ktk_f32_to_bf16(v);
            }
}

void ktk_mxfp4_rows(const ktk_act *x, int t0, int n, float *dst) {
    const int Kp = x->Kp;
    for (int t = 0; t < n; t++) {
        const uint16_t *xr = x->x_bf16 + (int64_t)(t0 + t) * Kp;
        float *d = dst + (int64_t)t * Kp;
        for (int c = 0; c < Kp; c++) {
            const uint32_t u = (uint32_t)xr[c] << 16;
            memcpy(&d[c], &u, 4);
        }
    }
}

/* The generic table's gemm_mxfp4: direct unless forced (as gemm_fp8). */
void ktk_generic_gemm_mxfp4(const ktk_mat *w, int nb0, int nb1, const ktk_act *x, float *y, int64_t ldy) {
    if (ktk_fp8_dequant(w, x, 0))
        ktk_fp8_dequant_gemm(w, nb0, nb1, x, y, ldy, ktk_generic_dequant_mxfp4, ktk_kernels_generic()->gemm_bf16);
    else
        ktk_generic_gemm_mxfp4_direct(w, nb0, nb1, x, y, ldy);
}
