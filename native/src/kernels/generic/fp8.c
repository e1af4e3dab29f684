/* fp8 (W8A16: float8 e4m3 weights with block scales, bf16 activations) reference kernels, and the pieces of the
 * direct and the dequantizing paths shared by every ISA.
 *
 * direct:  y[t][j] = sum_g fmaf(p_g, scale[j/16][g], .) (ascending g, from 0.0f), p_g = the fmaf sum of x[t][c] *
 *          e4m3(W[j][c]) over the group's inputs c < K (ascending, from 0.0f). The ISA kernels run the same float
 *          operations on scaled operands (x * 2^a, w * 2^-120: kernels.h) and scale back by a power of two, so they
 *          match this one bit for bit where nothing leaves the normal range.
 * dequant: fp8 blocks -> bf16(e4m3 * scale) in the bf16 packed layout (a chunk of blocks that fits the caller's
 *          workspace), then the ISA's gemm_bf16 on the bf16 activations.
 * Layouts: see ../kernels.h. Only plain loops in the reference: this file is the truth for the kernel tests.
 */
#include <math.h>
#include <string.h>

#include "../kernels.h"
#include "../../../include/ktinject.h"

static inline uint8_t q_f8(const ktk_mat *w, int n, int c) {
    return w->data_f8[((int64_t)(n / 16) * w->Kp + c) * 16 + n % 16];
}

static inline float scale_f8(const ktk_mat *w, int n, int g) {
    return w->scale[(int64_t)(n / 16) * ktk_fp8_groups(w) + g];
}

/* Element c of row t of x, from the tile-order copy where x has one (as the generic bf16 kernel reads it). */
static inline float x_f8(const ktk_act *x, int t, int c) {
    const int64_t o = (int64_t)c * 2, rb = (int64_t)x->Kp * 2;
    if (!x->tiles) return ktk_bf16_to_f32(x->x_bf16[(int64_t)t * x->Kp + c]);
    const char *p = (const char *)x->tiles + ((int64_t)(t / 16) * (rb / 64) + o / 64) * 1024 + (t % 16) * 64 + o % 64;
    uint16_t h;
    memcpy(&h, p, 2);
    return ktk_bf16_to_f32(h);
}

void ktk_generic_gemm_fp8_direct(const ktk_mat *w, int nb0, int nb1, const ktk_act *x, float *y, int64_t ldy) {
    const int G = w->group, ng = ktk_fp8_groups(w);
    for (int t = 0; t < x->n; t++)
        for (int j = nb0 * 16; j < nb1 * 16; j++) {
            float acc = 0.0f;
            for (int g = 0; g < ng; g++) {
                float p = 0.0f;
                for (int c = g * G; c < (g + 1) * G && c < w->K; c++)
                    p = fmaf(x_f8(x, t, c), ktk_e4m3_to_f32(q_f8(w, j, c)), p);
                acc = fmaf(p, scale_f8(w, j, g), acc);
            }
            y[(int64_t)t * ldy + (j - nb0 * 16)] = acc;
        }
}

void ktk_generic_dequant_fp8(const ktk_mat *w, int nb0, int nb1, uint16_t *dst) {
    const int64_t Kp = w->Kp;
    for (int b = nb0; b < nb1; b++)
        for (int c = 0; c < Kp; c++)
            for (int r = 0; r < 16; r++) {
                const int n = b * 16 + r;
                const float v = ktk_e4m3_to_f32(q_f8(w, n, c)) * scale_f8(w, n, c / w->group);
                dst[((int64_t)(b - nb0) * (Kp / 2) + c / 2) * 32 + r * 2 + c % 2] = ktk_f32_to_bf16(v);
            }
}

void ktk_fp8_dequant_gemm(const ktk_mat *w, int nb0, int nb1, const ktk_act *x, float *y, int64_t ldy,
                          ktk_dequant_fn dq, ktk_gemm_fn gemm_bf16) {
    const int chunk = (int)(x->work_bytes / ktk_int4_work_bytes(w->Kp, 1));   /* >= 1: checked by ktk_fp8_dequant */
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
}

/* Exponent a of 2^a for a row whose largest |x| has bf16 bits amax: near 2^64 after scaling, a in [-7, 127] (so
 * 2^a and 2^(120 - a) are normal floats); zero and subnormal rows take 127, inf / NaN rows -7. */
static inline int row_shift(uint32_t amax) {
    const int m = (int)(amax >> 7) - 127, a = 64 - m;
    return a < -7 ? -7 : a > 127 ? 127 : a;
}

static inline float pow2f(int e) {   /* e in [-126, 127] */
    union { uint32_t u; float f; } v;
    v.u = (uint32_t)(e + 127) << 23;
    return v.f;
}

void ktk_fp8_rows(const ktk_act *x, int t0, int n, float *dst, float *post) {
    const int Kp = x->Kp;
    for (int t = 0; t < n; t++) {
        const uint16_t *xr = x->x_bf16 + (int64_t)(t0 + t) * Kp;
        int16_t amax = 0;
        for (int c = 0; c < Kp; c++) {   /* |x| as bits orders like the values (NaN above inf); int16: vectorizes */
            const int16_t b = (int16_t)(xr[c] & 0x7fff);
            amax = b > amax ? b : amax;
        }
        const int a = row_shift((uint32_t)amax);
        const float f = pow2f(a);
        float *d = dst + (int64_t)t * Kp;
        for (int c = 0; c < Kp; c++) {
            const uint32_t u = (uint32_t)xr[c] << 16;
            float v;
            memcpy(&v, &u, 4);
            d[c] = v * f;
        }
        post[t] = pow2f(120 - a);
    }
}

void ktk_fp8_direct(const ktk_mat *w, int nb0, int nb1, const ktk_act *x, float *y, int64_t ldy, ktk_fp8_micro micro,
                    int mrmax, int nbmax, int accmax) {
    const int n = x->n, Kp = w->Kp;
    if (n <= 0 || nb1 <= nb0) return;
    int64_t fit = x->work ? x->work_bytes / ktk_fp8_rows_bytes(Kp, 1) : 0;
    if (fit < 1) {
        ktk_generic_gemm_fp8_direct(w, nb0, nb1, x, y, ldy);
        return;
    }
    const int chunk = fit < KTK_FP8_CHUNK_ROWS ? (int)fit : KTK_FP8_CHUNK_ROWS;
    float *xf = x->work, post[KTK_FP8_CHUNK_ROWS];
    for (int t0 = 0; t0 < n; t0 += chunk) {
        const int rows = n - t0 < chunk ? n - t0 : chunk;
        ktk_fp8_rows(x, t0, rows, xf, post);
        const int groups = (rows + mrmax - 1) / mrmax, mrtop = (rows + groups - 1) / groups;
        int nbg = accmax / mrtop;
        nbg = nbg > nbmax ? nbmax : nbg < 1 ? 1 : nbg;
        for (int b = nb0; b < nb1; b += nbg) {
            const int nb = nb1 - b < nbg ? nb1 - b : nbg;
            for (int g = 0, t = 0; g < groups; g++) {   /* balanced row groups, as ktk_drive */
                const int mr = (rows - t + (groups - g) - 1) / (groups - g);
                micro(w, xf + (int64_t)t * Kp, post + t, b,
                      y + (int64_t)(t0 + t) * ldy + (int64_t)(b - nb0) * 16, ldy, mr, nb);
                t += mr;
            }
        }
    }
}

/* The generic table's gemm_fp8: direct unless forced (dequantizing + the generic gemm_bf16 never pays here). */
void ktk_generic_gemm_fp8(const ktk_mat *w, int nb0, int nb1, const ktk_act *x, float *y, int64_t ldy) {
    if (ktk_fp8_dequant(w, x, 0))
        ktk_fp8_dequant_gemm(w, nb0, nb1, x, y, ldy, ktk_generic_dequant_fp8, ktk_kernels_generic()->gemm_bf16);
    else
        ktk_generic_gemm_fp8_direct(w, nb0, nb1, x, y, ldy);
}
