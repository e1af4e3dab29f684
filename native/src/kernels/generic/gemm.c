/* Generic reference kernels: scalar, obviously correct, the test oracle for every other ISA.
 *
 * bf16: y[t][j] = sum_{c < K} x[t][c] * W[j][c], float accumulation in ascending c.
 * int8: exact int32 dot product, then * x_scale[t] * scale[j].
 * int4: int4.c; fp8: fp8.c.
 * Layouts: see ../kernels.h. Only c < K is visited (the padding is zero anyway). x is read from its tile-order
 * copy where one is given (the reference for that layout; the table does not ask for it: tile_rows 0).
 */
#include "../kernels.h"

/* bf16 W element (n, c) in the packed layout. */
static inline float w_bf16(const ktk_mat *w, int n, int c) {
    int64_t idx = ((int64_t)(n / 16) * (w->Kp / 2) + c / 2) * 32 + (n % 16) * 2 + c % 2;
    return ktk_bf16_to_f32(w->data_bf16[idx]);
}

/* int8 W element (n, c) in the packed layout. */
static inline int32_t w_i8(const ktk_mat *w, int n, int c) {
    int64_t idx = ((int64_t)(n / 16) * (w->Kp / 4) + c / 4) * 64 + (n % 16) * 4 + c % 4;
    return w->data_i8[idx];
}

/* Element c of row t of x (es bytes each: rows at `rows`), from the tile-order copy where x has one. */
static inline const void *x_at(const ktk_act *x, const void *rows, int es, int t, int c) {
    const int64_t o = (int64_t)c * es, rb = (int64_t)x->Kp * es;
    if (!x->tiles) return (const char *)rows + t * rb + o;
    return (const char *)x->tiles + ((int64_t)(t / 16) * (rb / 64) + o / 64) * 1024 + (t % 16) * 64 + o % 64;
}

static void gemm_bf16_generic(const ktk_mat *w, int nb0, int nb1, const ktk_act *x, float *y, int64_t ldy) {
    for (int t = 0; t < x->n; t++) {
        for (int j = nb0 * 16; j < nb1 * 16; j++) {
            float acc = 0.0f;
            for (int c = 0; c < w->K; c++)
                acc += ktk_bf16_to_f32(*(const uint16_t *)x_at(x, x->x_bf16, 2, t, c)) * w_bf16(w, j, c);
            y[(int64_t)t * ldy + (j - nb0 * 16)] = acc;
        }
    }
}

static void gemm_int8_generic(const ktk_mat *w, int nb0, int nb1, const ktk_act *x, float *y, int64_t ldy) {
    for (int t = 0; t < x->n; t++) {
        for (int j = nb0 * 16; j < nb1 * 16; j++) {
            int32_t acc = 0;
            for (int c = 0; c < w->K; c++) acc += (int32_t)*(const int8_t *)x_at(x, x->x_i8, 1, t, c) * w_i8(w, j, c);
            y[(int64_t)t * ldy + (j - nb0 * 16)] = (float)acc * x->x_scale[t] * w->scale[j];
        }
    }
}

void ktk_generic_gemm_int4(const ktk_mat *w, int nb0, int nb1, const ktk_act *x, float *y, int64_t ldy); /* int4.c */
void ktk_generic_gemm_fp8(const ktk_mat *w, int nb0, int nb1, const ktk_act *x, float *y, int64_t ldy);  /* fp8.c */

static const ktk_kernels generic_table = {.name = "generic", .gemm_bf16 = gemm_bf16_generic,
                                          .gemm_int8 = gemm_int8_generic, .gemm_int4 = ktk_generic_gemm_int4,
                                          .gemm_fp8 = ktk_generic_gemm_fp8, .gemm_mxfp4 = ktk_generic_gemm_mxfp4};

const ktk_kernels *ktk_kernels_generic(void) { return &generic_table; }
