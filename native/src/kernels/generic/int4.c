/* int4 (W4A8) reference kernels and the dequantizing path shared by every ISA.
 *
 * direct:  y[t][j] = x_scale[t] * sum_g fmaf((float)d_g, scale[j][g], .) with d_g the exact int32 dot product of
 *          x[t] and q[j] over group g (ascending g, from 0.0f): the ISA kernels do the same float operations, so
 *          they match this one bit for bit.
 * dequant: int4 blocks -> bf16(q * scale) in the bf16 packed layout (a chunk of blocks that fits the caller's
 *          workspace), then the ISA's gemm_bf16 on the activations as bf16 (x_bf16 = q exactly), then * x_scale[t].
 * Layouts: see ../kernels.h. Only plain loops here: this file is the truth for the kernel tests.
 */
#include <math.h>

#include "../kernels.h"
#include "../../../include/ktinject.h"

/* q of int4 element (n, c) in the packed layout */
static inline int32_t q_i4(const ktk_mat *w, int n, int c) {
    const uint8_t byte = w->data_i4[((int64_t)(n / 16) * (w->Kp / 8) + c / 8) * 64 + (n % 16) * 4 + c % 4];
    const int nib = (byte >> (4 * ((c / 4) % 2))) & 0xf;
    return nib >= 8 ? nib - 16 : nib;
}

static inline float scale_i4(const ktk_mat *w, int n, int g) {
    return w->scale[((int64_t)(n / 16) * (w->Kp / w->group) + g) * 16 + n % 16];
}

void ktk_generic_gemm_int4_direct(const ktk_mat *w, int nb0, int nb1, const ktk_act *x, float *y, int64_t ldy) {
    const int G = w->group, ng = w->Kp / G;
    for (int t = 0; t < x->n; t++) {
        const int8_t *xt = x->x_i8 + (int64_t)t * x->Kp;
        for (int j = nb0 * 16; j < nb1 * 16; j++) {
            float acc = 0.0f;
            for (int g = 0; g < ng; g++) {
                int32_t d = 0;
                for (int c = g * G; c < (g + 1) * G && c < w->K; c++) d += (int32_t)xt[c] * q_i4(w, j, c);
                acc = fmaf((float)d, scale_i4(w, j, g), acc);
            }
            y[(int64_t)t * ldy + (j - nb0 * 16)] = acc * x->x_scale[t];
        }
    }
}

void ktk_generic_dequant_int4(const ktk_mat *w, int nb0, int nb1, uint16_t *dst) {
    const int64_t Kp = w->Kp;
    for (int b = nb0; b < nb1; b++)
        for (int c = 0; c < Kp; c++)
            for (int r = 0; r < 16; r++) {
                const int n = b * 16 + r;
                const float v = (float)q_i4(w, n, c) * scale_i4(w, n, c / w->group);
                dst[((int64_t)(b - nb0) * (Kp / 2) + c / 2) * 32 + r * 2 + c % 2] = ktk_f32_to_bf16(v);
            }
}

void ktk_int4_dequant_gemm(const ktk_mat *w, int nb0, int nb1, const ktk_act *x, float *y, int64_t ldy,
                           ktk_dequant_fn dq, ktk_gemm_fn gemm_bf16) {
    const int64_t per_block = ktk_int4_work_bytes(w->Kp, 1);
    const int chunk = (int)(x->work_bytes / per_block);   /* >= 1: checked by ktk_int4_dequant */
    uint16_t *buf = x->work;
    const ktk_act xb = {x->n, x->Kp, x->x_bf16, NULL, NULL, NULL, NULL, 0, KTK_INT4_PATH_AUTO, x->tiles,
                        KTK_FP8_PATH_AUTO};
    for (int b = nb0; b < nb1; b += chunk) {
        const int b1 = nb1 - b < chunk ? nb1 : b + chunk;
        dq(w, b, b1, buf);
        const ktk_mat m = {(b1 - b) * 16, w->K, (b1 - b) * 16, w->Kp, KTK_QUANT_BF16, buf, NULL, NULL, NULL, NULL, 0,
                           NULL};
        gemm_bf16(&m, 0, b1 - b, &xb, y + (int64_t)(b - nb0) * 16, ldy);
    }
    const int cols = (nb1 - nb0) * 16;
    for (int t = 0; t < x->n; t++) {
        float *yt = y + (int64_t)t * ldy;
        const float s = x->x_scale[t];
        for (int j = 0; j < cols; j++) yt[j] *= s;
    }
}

/* The generic table's gemm_int4: direct unless forced (dequantizing + the generic gemm_bf16 never pays here). */
void ktk_generic_gemm_int4(const ktk_mat *w, int nb0, int nb1, const ktk_act *x, float *y, int64_t ldy) {
    if (ktk_int4_dequant(w, x, 0))
        ktk_int4_dequant_gemm(w, nb0, nb1, x, y, ldy, ktk_generic_dequant_int4, ktk_kernels_generic()->gemm_bf16);
    else
        ktk_generic_gemm_int4_direct(w, nb0, nb1, x, y, ldy);
}
