/* AVX2 + FMA kernels.
 *
 * A packed 64-byte weight row (16 outputs x 2 bf16 inputs, or 16 outputs x 4 int8 inputs) is two 256-bit halves
 * of 8 outputs each.
 *   bf16: half -> even/odd f32 (shift / mask), two FMAs with broadcast x[c], x[c+1] (x converted to f32 per chunk).
 *   int8: half -> int16 pairs (w0,w2) / (w1,w3) by shifts, vpmaddwd with broadcast (x0,x2) / (x1,x3): exact int32.
 *   int4: int4.c; fp8: fp8.c.
 * One register-blocked micro-kernel per type (MR rows x NB column blocks, MR * NB <= 4 so the 2 * MR * NB ymm
 * accumulators fit), driven by ../drive.h like the AVX-512 ones: decode keeps all rows of n <= 4 in one group.
 * Layouts: see ../kernels.h. Called concurrently: no mutable globals, no allocation.
 */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <immintrin.h>
#include "../kernels.h"
#include "../drive.h"

#define KTK_AI static inline __attribute__((always_inline))
#ifndef PF_BYTES
#define PF_BYTES 1024   /* software prefetch distance, per weight stream (0: none) */
#endif
#define ACC_MAX 4       /* max MR * NB */

#define KTK256_CASES(BODY)                                                                                          \
    switch (mr * 8 + nb) {                                                                                         \
    case 8 + 1: BODY(1, 1); break; case 8 + 2: BODY(1, 2); break; case 8 + 3: BODY(1, 3); break;                   \
    case 8 + 4: BODY(1, 4); break; case 16 + 1: BODY(2, 1); break; case 16 + 2: BODY(2, 2); break;                 \
    case 24 + 1: BODY(3, 1); break; case 32 + 1: BODY(4, 1); break;                                                \
    default: abort();                                                                                              \
    }

#pragma GCC push_options
#pragma GCC target("avx2,fma")

KTK_AI void mk_bf16(const ktk_mat *w, const ktk_act *x, int b0, int t0, float *y, int64_t ldy, const int MR,
                    const int NB) {
    const int Kp = w->Kp;
    const int64_t bs = (int64_t)Kp * 16;
    const uint16_t *wb = w->data_bf16 + (int64_t)b0 * bs;
    const uint16_t *xr = x->x_bf16 + (int64_t)t0 * Kp;
    const __m256i hi = _mm256_set1_epi32((int)0xffff0000u);
    __m256 acc[4][4][2];
    float xf[4][64] __attribute__((aligned(32)));
#pragma GCC unroll 4
    for (int m = 0; m < MR; m++)
#pragma GCC unroll 4
        for (int b = 0; b < NB; b++) acc[m][b][0] = acc[m][b][1] = _mm256_setzero_ps();
    for (int kc = 0; kc < Kp; kc += 64) {
#pragma GCC unroll 4
        for (int m = 0; m < MR; m++)
#pragma GCC unroll 8
            for (int i = 0; i < 8; i++) {
                const __m128i h = _mm_loadu_si128((const __m128i *)(xr + (int64_t)m * Kp + kc + i * 8));
                _mm256_store_ps(xf[m] + i * 8, _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16)));
            }
#pragma GCC unroll 2
        for (int p = 0; p < 32; p++) {
#pragma GCC unroll 4
            for (int b = 0; b < NB; b++) {
                const uint16_t *q = wb + b * bs + (int64_t)(kc + 2 * p) * 16;
                if (PF_BYTES) _mm_prefetch((const char *)q + PF_BYTES, _MM_HINT_T0);
#pragma GCC unroll 2
                for (int h = 0; h < 2; h++) {
                    const __m256i v = _mm256_loadu_si256((const __m256i *)(q + h * 16));
                    const __m256 we = _mm256_castsi256_ps(_mm256_slli_epi32(v, 16));
                    const __m256 wo = _mm256_castsi256_ps(_mm256_and_si256(v, hi));
#pragma GCC unroll 4
                    for (int m = 0; m < MR; m++)
                        acc[m][b][h] = _mm256_fmadd_ps(wo, _mm256_broadcast_ss(&xf[m][2 * p + 1]),
                                                       _mm256_fmadd_ps(we, _mm256_broadcast_ss(&xf[m][2 * p]),
                                                                       acc[m][b][h]));
                }
            }
        }
    }
#pragma GCC unroll 4
    for (int m = 0; m < MR; m++)
#pragma GCC unroll 4
        for (int b = 0; b < NB; b++) {
            _mm256_storeu_ps(y + m * ldy + b * 16, acc[m][b][0]);
            _mm256_storeu_ps(y + m * ldy + b * 16 + 8, acc[m][b][1]);
        }
}

/* (w0,w1,w2,w3) bytes per int32 lane -> int16 pairs (w0,w2) and (w1,w3) */
KTK_AI __m256i even_i16(__m256i v) { return _mm256_srai_epi16(_mm256_slli_epi16(v, 8), 8); }
KTK_AI __m256i odd_i16(__m256i v) { return _mm256_srai_epi16(v, 8); }

KTK_AI void mk_int8(const ktk_mat *w, const ktk_act *x, int b0, int t0, float *y, int64_t ldy, const int MR,
                    const int NB) {
    const int Kp = w->Kp;
    const int64_t bs = (int64_t)Kp * 16;
    const int8_t *wb = w->data_i8 + (int64_t)b0 * bs;
    const int8_t *xr = x->x_i8 + (int64_t)t0 * Kp;
    __m256i acc[4][4][2];
    int32_t xe[4][16] __attribute__((aligned(32))), xo[4][16] __attribute__((aligned(32)));
#pragma GCC unroll 4
    for (int m = 0; m < MR; m++)
#pragma GCC unroll 4
        for (int b = 0; b < NB; b++) acc[m][b][0] = acc[m][b][1] = _mm256_setzero_si256();
    for (int kc = 0; kc < Kp; kc += 64) {
#pragma GCC unroll 4
        for (int m = 0; m < MR; m++)
#pragma GCC unroll 2
            for (int i = 0; i < 2; i++) {
                const __m256i v = _mm256_loadu_si256((const __m256i *)(xr + (int64_t)m * Kp + kc + i * 32));
                _mm256_store_si256((__m256i *)(xe[m] + i * 8), even_i16(v));
                _mm256_store_si256((__m256i *)(xo[m] + i * 8), odd_i16(v));
            }
#pragma GCC unroll 2
        for (int g = 0; g < 16; g++) {
#pragma GCC unroll 4
            for (int b = 0; b < NB; b++) {
                const int8_t *q = wb + b * bs + (int64_t)kc * 16 + g * 64;
                if (PF_BYTES) _mm_prefetch((const char *)q + PF_BYTES, _MM_HINT_T0);
#pragma GCC unroll 2
                for (int h = 0; h < 2; h++) {
                    const __m256i v = _mm256_loadu_si256((const __m256i *)(q + h * 32));
                    const __m256i we = even_i16(v), wo = odd_i16(v);
#pragma GCC unroll 4
                    for (int m = 0; m < MR; m++) {
                        const __m256i pe = _mm256_madd_epi16(we, _mm256_set1_epi32(xe[m][g]));
                        const __m256i po = _mm256_madd_epi16(wo, _mm256_set1_epi32(xo[m][g]));
                        acc[m][b][h] = _mm256_add_epi32(acc[m][b][h], _mm256_add_epi32(pe, po));
                    }
                }
            }
        }
    }
#pragma GCC unroll 4
    for (int b = 0; b < NB; b++)
#pragma GCC unroll 2
        for (int h = 0; h < 2; h++) {
            const __m256 sc = _mm256_loadu_ps(w->scale + (b0 + b) * 16 + h * 8);
#pragma GCC unroll 4
            for (int m = 0; m < MR; m++) {
                const __m256 f = _mm256_cvtepi32_ps(acc[m][b][h]);
                _mm256_storeu_ps(y + m * ldy + b * 16 + h * 8,
                                 _mm256_mul_ps(_mm256_mul_ps(f, _mm256_set1_ps(x->x_scale[t0 + m])), sc));
            }
        }
}

static void micro_bf16(const ktk_mat *w, const ktk_act *x, int b0, int t0, float *y, int64_t ldy, int mr, int nb) {
#define BODY(M, B) mk_bf16(w, x, b0, t0, y, ldy, M, B)
    KTK256_CASES(BODY)
#undef BODY
}

static void micro_int8(const ktk_mat *w, const ktk_act *x, int b0, int t0, float *y, int64_t ldy, int mr, int nb) {
#define BODY(M, B) mk_int8(w, x, b0, t0, y, ldy, M, B)
    KTK256_CASES(BODY)
#undef BODY
}
#pragma GCC pop_options

static void gemm_bf16_avx2(const ktk_mat *w, int nb0, int nb1, const ktk_act *x, float *y, int64_t ldy) {
    ktk_drive(micro_bf16, 4, ACC_MAX, ACC_MAX, w, nb0, nb1, x, y, ldy);
}

static void gemm_int8_avx2(const ktk_mat *w, int nb0, int nb1, const ktk_act *x, float *y, int64_t ldy) {
    ktk_drive(micro_int8, 4, ACC_MAX, ACC_MAX, w, nb0, nb1, x, y, ldy);
}

void ktk_avx2_gemm_int4(const ktk_mat *w, int nb0, int nb1, const ktk_act *x, float *y, int64_t ldy); /* int4.c */
/* fp8.c */
void ktk_avx2_gemm_fp8(const ktk_mat *w, int nb0, int nb1, const ktk_act *x, float *y, int64_t ldy);
void ktk_avx2_gemv_fp8(int M, const ktk_mat *const *w, int nb0, int nb1, const ktk_act *const *x, float *const *y);

/* gemv only for fp8, not used by default (KTINJECT_GEMV=1 takes it: tests) */
static const ktk_kernels avx2_table = {.name = "avx2", .gemm_bf16 = gemm_bf16_avx2, .gemm_int8 = gemm_int8_avx2,
                                       .gemm_int4 = ktk_avx2_gemm_int4, .gemm_fp8 = ktk_avx2_gemm_fp8,
                                       .gemv_fp8 = ktk_avx2_gemv_fp8,
                                       /* mxfp4: the generic kernels (no AVX2 mxfp4 kernel yet) */
                                       .gemm_mxfp4 = ktk_generic_gemm_mxfp4};

const ktk_kernels *ktk_kernels_avx2(void) { return &avx2_table; }
