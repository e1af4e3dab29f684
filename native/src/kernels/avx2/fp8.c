/* AVX2 fp8 (W8A16) kernels: the direct kernel, a decode gemv and the dequantization to bf16.
 *
 *   direct:   x rows converted once per call to float times 2^a (ktk_fp8_rows, the caller's workspace); a 16-byte
 *             packed row (16 outputs of one input) is two vpmovsxbd of 8 bytes -> << 20 -> & 0x87f00000: floats of
 *             value e4m3 * 2^-120 (kernels.h), then vfmadd231ps with the input broadcast from its float row; per group
 *             p = sum of those products, acc = fma(p, the block's scale, acc); y = acc * 2^(120 - a): the float
 *             operations of the generic reference on scaled operands (bit-identical where nothing leaves the normal
 *             range). MR rows x NB blocks, MR * NB <= 2 (n = 3, 4 rows spill their 2 * MR accumulators, touched once
 *             per group).
 *   gemv:     M matrices with one row each (ktk_gemv_fn), up to 3 weight streams at a time (16 ymm registers),
 *             each accumulator as the direct kernel's with one row: bit-identical to it.
 *   dequant:  the same conversion, * 2^120 (exact), * scale, rounded to bf16 (nearest even) and interleaved in pairs:
 *             the generic dequantization's bits.
 * gemm_fp8 takes the dequantizing path (+ this table's gemm_bf16) when forced (or from KTK_AVX2_FP8_DEQUANT_ROWS
 * rows, if set), else the direct kernel. Layouts: see ../kernels.h. Called concurrently: no mutable globals, no allocation.
 */
#include <stdint.h>
#include <stdlib.h>
#include <immintrin.h>
#include "../kernels.h"

#define KTK_AI static inline __attribute__((always_inline))
#ifndef PF_BYTES
#define PF_BYTES 1024   /* software prefetch distance, per weight stream (0: none) */
#endif

/* Rows from which gemm_fp8 dequantizes to bf16 and runs this table's FMA bf16 kernel; 0: never (forced only). The
 * direct kernel was faster at every row count measured (native/tests/test_kernels.c bench, TK_QUANT=fp8): it does the
 * same FMAs per weight as the bf16 kernel, which the dequantization only adds to (-D for A/B builds). */
#ifndef KTK_AVX2_FP8_DEQUANT_ROWS
#define KTK_AVX2_FP8_DEQUANT_ROWS 0
#endif

const ktk_kernels *ktk_kernels_avx2(void);

#pragma GCC push_options
#pragma GCC target("avx2,fma")

/* 8 e4m3 bytes at p -> 8 floats of value e4m3 * 2^-120 */
KTK_AI __m256 f8x8(const uint8_t *p, __m256i mask) {
    const __m256i v = _mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)p));
    return _mm256_castsi256_ps(_mm256_and_si256(_mm256_slli_epi32(v, 20), mask));
}

KTK_AI void mk_fp8(const ktk_mat *w, const float *xf, const float *post, int b0, float *y, int64_t ldy, const int MR,
                   const int NB) {
    const int Kp = w->Kp, G = w->group, ng = ktk_fp8_groups(w);
    const int64_t bs = (int64_t)Kp * 16;                 /* bytes per column block */
    const uint8_t *wb = w->data_f8 + (int64_t)b0 * bs;
    const float *sb = w->scale + (int64_t)b0 * ng;
    const __m256i mask = _mm256_set1_epi32((int)0x87f00000u);
    __m256 acc[4][2][2];
#pragma GCC unroll 4
    for (int m = 0; m < MR; m++)
#pragma GCC unroll 2
        for (int b = 0; b < NB; b++) acc[m][b][0] = acc[m][b][1] = _mm256_setzero_ps();
    for (int g = 0; g < ng; g++) {
        const int c0 = g * G, c1 = c0 + G < Kp ? c0 + G : Kp;   /* a multiple of 16 inputs */
        __m256 p[4][2][2];
#pragma GCC unroll 4
        for (int m = 0; m < MR; m++)
#pragma GCC unroll 2
            for (int b = 0; b < NB; b++) p[m][b][0] = p[m][b][1] = _mm256_setzero_ps();
        for (int c = c0; c < c1; c += 4) {               /* 4 inputs: one 64-byte line per block */
#pragma GCC unroll 2
            for (int b = 0; b < NB; b++)
                if (PF_BYTES) _mm_prefetch((const char *)(wb + b * bs + (int64_t)c * 16) + PF_BYTES, _MM_HINT_T0);
#pragma GCC unroll 4
            for (int i = 0; i < 4; i++)
#pragma GCC unroll 2
                for (int b = 0; b < NB; b++) {
                    const uint8_t *q = wb + b * bs + (int64_t)(c + i) * 16;
                    const __m256 w0 = f8x8(q, mask), w1 = f8x8(q + 8, mask);
#pragma GCC unroll 4
                    for (int m = 0; m < MR; m++) {
                        const __m256 xv = _mm256_broadcast_ss(xf + (int64_t)m * Kp + c + i);
                        p[m][b][0] = _mm256_fmadd_ps(xv, w0, p[m][b][0]);
                        p[m][b][1] = _mm256_fmadd_ps(xv, w1, p[m][b][1]);
                    }
                }
        }
#pragma GCC unroll 2
        for (int b = 0; b < NB; b++) {
            const __m256 s = _mm256_broadcast_ss(sb + (int64_t)b * ng + g);
#pragma GCC unroll 4
            for (int m = 0; m < MR; m++) {
                acc[m][b][0] = _mm256_fmadd_ps(p[m][b][0], s, acc[m][b][0]);
                acc[m][b][1] = _mm256_fmadd_ps(p[m][b][1], s, acc[m][b][1]);
            }
        }
    }
#pragma GCC unroll 4
    for (int m = 0; m < MR; m++) {
        const __m256 pf = _mm256_broadcast_ss(post + m);
#pragma GCC unroll 2
        for (int b = 0; b < NB; b++) {
            _mm256_storeu_ps(y + m * ldy + b * 16, _mm256_mul_ps(acc[m][b][0], pf));
            _mm256_storeu_ps(y + m * ldy + b * 16 + 8, _mm256_mul_ps(acc[m][b][1], pf));
        }
    }
}

/* (mr, nb) of ktk_fp8_direct with mrmax 4, nbmax 2, accmax 2 */
static void micro_fp8(const ktk_mat *w, const float *xf, const float *post, int b0, float *y, int64_t ldy, int mr,
                      int nb) {
    switch (mr * 8 + nb) {
    case 8 + 1: mk_fp8(w, xf, post, b0, y, ldy, 1, 1); break;
    case 8 + 2: mk_fp8(w, xf, post, b0, y, ldy, 1, 2); break;
    case 16 + 1: mk_fp8(w, xf, post, b0, y, ldy, 2, 1); break;
    case 24 + 1: mk_fp8(w, xf, post, b0, y, ldy, 3, 1); break;
    case 32 + 1: mk_fp8(w, xf, post, b0, y, ldy, 4, 1); break;
    default: abort();
    }
}

/* Decode: MS (<= 3) matrices w[0..MS) with one float row each (xf rows Kp apart), block b0 of each -> y[m] + yo. */
KTK_AI void mv_fp8(const ktk_mat *const *w, const float *xf, const float *post, int b0, float *const *y, int yo,
                   const int MS) {
    const int Kp = w[0]->Kp, G = w[0]->group, ng = ktk_fp8_groups(w[0]);
    const int64_t bs = (int64_t)Kp * 16;
    const __m256i mask = _mm256_set1_epi32((int)0x87f00000u);
    const uint8_t *wb[3];
    const float *sb[3];
    __m256 acc[3][2];
#pragma GCC unroll 3
    for (int m = 0; m < MS; m++) {
        wb[m] = w[m]->data_f8 + (int64_t)b0 * bs;
        sb[m] = w[m]->scale + (int64_t)b0 * ng;
        acc[m][0] = acc[m][1] = _mm256_setzero_ps();
    }
    for (int g = 0; g < ng; g++) {
        const int c0 = g * G, c1 = c0 + G < Kp ? c0 + G : Kp;
        __m256 p[3][2];
#pragma GCC unroll 3
        for (int m = 0; m < MS; m++) p[m][0] = p[m][1] = _mm256_setzero_ps();
        for (int c = c0; c < c1; c += 4) {
#pragma GCC unroll 3
            for (int m = 0; m < MS; m++)
                if (PF_BYTES) _mm_prefetch((const char *)(wb[m] + (int64_t)c * 16) + PF_BYTES, _MM_HINT_T0);
#pragma GCC unroll 4
            for (int i = 0; i < 4; i++)
#pragma GCC unroll 3
                for (int m = 0; m < MS; m++) {
                    const uint8_t *q = wb[m] + (int64_t)(c + i) * 16;
                    const __m256 xv = _mm256_broadcast_ss(xf + (int64_t)m * Kp + c + i);
                    p[m][0] = _mm256_fmadd_ps(xv, f8x8(q, mask), p[m][0]);
                    p[m][1] = _mm256_fmadd_ps(xv, f8x8(q + 8, mask), p[m][1]);
                }
        }
#pragma GCC unroll 3
        for (int m = 0; m < MS; m++) {
            const __m256 s = _mm256_broadcast_ss(sb[m] + g);
            acc[m][0] = _mm256_fmadd_ps(p[m][0], s, acc[m][0]);
            acc[m][1] = _mm256_fmadd_ps(p[m][1], s, acc[m][1]);
        }
    }
#pragma GCC unroll 3
    for (int m = 0; m < MS; m++) {
        const __m256 pf = _mm256_broadcast_ss(post + m);
        _mm256_storeu_ps(y[m] + yo, _mm256_mul_ps(acc[m][0], pf));
        _mm256_storeu_ps(y[m] + yo + 8, _mm256_mul_ps(acc[m][1], pf));
    }
}

/* bf16 bits of f in the high half of each int32 lane, round to nearest even (ktk_f32_to_bf16 for non-NaN) */
KTK_AI __m256i bf16_hi(__m256 f) {
    const __m256i u = _mm256_castps_si256(f);
    const __m256i lsb = _mm256_and_si256(_mm256_srli_epi32(u, 16), _mm256_set1_epi32(1));
    return _mm256_add_epi32(u, _mm256_add_epi32(lsb, _mm256_set1_epi32(0x7fff)));
}

void ktk_avx2_dequant_fp8(const ktk_mat *w, int nb0, int nb1, uint16_t *dst) {
    const int Kp = w->Kp, G = w->group, ng = ktk_fp8_groups(w);
    const __m256i mask = _mm256_set1_epi32((int)0x87f00000u), himask = _mm256_set1_epi32((int)0xffff0000u);
    const __m256 two120 = _mm256_set1_ps(0x1p120f);
    for (int b = nb0; b < nb1; b++) {
        const uint8_t *src = w->data_f8 + (int64_t)b * Kp * 16;
        uint16_t *out = dst + (int64_t)(b - nb0) * 16 * Kp;
        for (int c = 0; c < Kp; c += 2) {                /* inputs c, c + 1: one group (G is a multiple of 16) */
            const __m256 s = _mm256_broadcast_ss(w->scale + (int64_t)b * ng + c / G);
#pragma GCC unroll 2
            for (int h = 0; h < 2; h++) {                /* outputs 8h .. 8h + 7 */
                const __m256 e = _mm256_mul_ps(_mm256_mul_ps(f8x8(src + (int64_t)c * 16 + 8 * h, mask), two120), s);
                const __m256 o = _mm256_mul_ps(_mm256_mul_ps(f8x8(src + (int64_t)c * 16 + 16 + 8 * h, mask), two120),
                                               s);
                const __m256i row = _mm256_or_si256(_mm256_srli_epi32(bf16_hi(e), 16),
                                                    _mm256_and_si256(bf16_hi(o), himask));
                _mm256_storeu_si256((__m256i *)(out + (int64_t)c / 2 * 32 + 16 * h), row);
            }
        }
    }
}

void ktk_avx2_gemm_fp8_direct(const ktk_mat *w, int nb0, int nb1, const ktk_act *x, float *y, int64_t ldy) {
    ktk_fp8_direct(w, nb0, nb1, x, y, ldy, micro_fp8, 4, 2, 2);
}

void ktk_avx2_gemm_fp8(const ktk_mat *w, int nb0, int nb1, const ktk_act *x, float *y, int64_t ldy) {
    if (ktk_fp8_dequant(w, x, KTK_AVX2_FP8_DEQUANT_ROWS))
        ktk_fp8_dequant_gemm(w, nb0, nb1, x, y, ldy, ktk_avx2_dequant_fp8, ktk_kernels_avx2()->gemm_bf16);
    else
        ktk_avx2_gemm_fp8_direct(w, nb0, nb1, x, y, ldy);
}

/* Decode: each block of every matrix, the matrices three at a time; x[0]->work holds the M float rows (too small:
 * the direct kernel per matrix, the same bits). */
void ktk_avx2_gemv_fp8(int M, const ktk_mat *const *w, int nb0, int nb1, const ktk_act *const *x, float *const *y) {
    if (M < 1 || M > KTK_GEMV_MAX) abort();
    const int Kp = w[0]->Kp;
    if (!x[0]->work || x[0]->work_bytes < ktk_fp8_rows_bytes(Kp, M)) {
        for (int m = 0; m < M; m++) ktk_avx2_gemm_fp8_direct(w[m], nb0, nb1, x[m], y[m], (int64_t)(nb1 - nb0) * 16);
        return;
    }
    float *xf = x[0]->work, post[KTK_GEMV_MAX];
    for (int m = 0; m < M; m++) ktk_fp8_rows(x[m], 0, 1, xf + (int64_t)m * Kp, post + m);
    for (int b = nb0; b < nb1; b++)
        for (int m0 = 0; m0 < M; m0 += 3) {
            const int ms = M - m0 < 3 ? M - m0 : 3, yo = (b - nb0) * 16;
            const float *xm = xf + (int64_t)m0 * Kp;
            if (ms == 3) mv_fp8(w + m0, xm, post + m0, b, y + m0, yo, 3);
            else if (ms == 2) mv_fp8(w + m0, xm, post + m0, b, y + m0, yo, 2);
            else mv_fp8(w + m0, xm, post + m0, b, y + m0, yo, 1);
        }
}
#pragma GCC pop_options
