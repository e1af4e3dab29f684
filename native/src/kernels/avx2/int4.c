/* AVX2 int4 (W4A8) kernel: a simple register-blocked direct kernel (MR rows x NB blocks, MR * NB <= 2).
 *
 * A 64-byte packed row (16 outputs x 8 inputs as nibbles) is two 256-bit halves of 8 outputs each; per half:
 * xor 0x88 + and / shift + and give the two quads as u8 q + 8; vpmaddubsw with the broadcast s8 x quads (pairs
 * <= 2 * 15 * 127, two of them < 2^15: no saturation), vpmaddwd with ones -> int32. Per group: - 8 * sum(x), int32
 * -> float, fma with the group's scales; then * x_scale: the float operations of the generic reference (bit-exact).
 * The dequantizing path (forced only: with the FMA bf16 kernel it does not pay here) uses the generic dequantization.
 * Layouts: see ../kernels.h. Called concurrently: no mutable globals, no allocation.
 */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <immintrin.h>
#include "../kernels.h"

#define KTK_AI static inline __attribute__((always_inline))
#ifndef PF_BYTES
#define PF_BYTES 1024   /* software prefetch distance, per weight stream (0: none) */
#endif

const ktk_kernels *ktk_kernels_avx2(void);

#pragma GCC push_options
#pragma GCC target("avx2,fma")

/* sum of the G (a multiple of 32) int8 values at p */
KTK_AI int32_t xsum256(const int8_t *p, int G) {
    const __m256i flip = _mm256_set1_epi8((char)0x80), zero = _mm256_setzero_si256();
    __m256i s = zero;
    for (int i = 0; i < G; i += 32)
        s = _mm256_add_epi64(s, _mm256_sad_epu8(_mm256_xor_si256(_mm256_loadu_si256((const __m256i *)(p + i)), flip),
                                                zero));
    const __m128i h = _mm_add_epi64(_mm256_castsi256_si128(s), _mm256_extracti128_si256(s, 1));
    return (int32_t)(_mm_cvtsi128_si64(h) + _mm_extract_epi64(h, 1)) - 128 * G;
}

KTK_AI void mk_int4(const ktk_mat *w, const ktk_act *x, int b0, int t0, float *y, int64_t ldy, const int MR,
                    const int NB) {
    const int Kp = w->Kp, G = w->group, ng = Kp / G, rows = G / 8;
    const int64_t bs = (int64_t)Kp * 8;
    const uint8_t *wb = w->data_i4 + (int64_t)b0 * bs;
    const float *sb = w->scale + (int64_t)b0 * ng * 16;
    const int8_t *xr = x->x_i8 + (int64_t)t0 * Kp;
    const __m256i c88 = _mm256_set1_epi8((char)0x88), c0f = _mm256_set1_epi8(0x0f), ones = _mm256_set1_epi16(1);
    __m256 f[2][2][2];
#pragma GCC unroll 2
    for (int m = 0; m < MR; m++)
#pragma GCC unroll 2
        for (int b = 0; b < NB; b++) f[m][b][0] = f[m][b][1] = _mm256_setzero_ps();
    for (int g = 0; g < ng; g++) {
        const int k0 = g * G;
        const uint8_t *wg = wb + (int64_t)k0 * 8;
        __m256i acc[2][2][2];
#pragma GCC unroll 2
        for (int m = 0; m < MR; m++)
#pragma GCC unroll 2
            for (int b = 0; b < NB; b++) acc[m][b][0] = acc[m][b][1] = _mm256_setzero_si256();
        for (int r = 0; r < rows; r++) {
            __m256i xl[2], xh[2];
#pragma GCC unroll 2
            for (int m = 0; m < MR; m++) {
                int32_t a, c;
                memcpy(&a, xr + (int64_t)m * Kp + k0 + r * 8, 4);
                memcpy(&c, xr + (int64_t)m * Kp + k0 + r * 8 + 4, 4);
                xl[m] = _mm256_set1_epi32(a);
                xh[m] = _mm256_set1_epi32(c);
            }
#pragma GCC unroll 2
            for (int b = 0; b < NB; b++) {
                const uint8_t *p = wg + b * bs + r * 64;
                if (PF_BYTES) _mm_prefetch((const char *)p + PF_BYTES, _MM_HINT_T0);
#pragma GCC unroll 2
                for (int h = 0; h < 2; h++) {
                    const __m256i v = _mm256_xor_si256(_mm256_loadu_si256((const __m256i *)(p + h * 32)), c88);
                    const __m256i lo = _mm256_and_si256(v, c0f), hi = _mm256_and_si256(_mm256_srli_epi16(v, 4), c0f);
#pragma GCC unroll 2
                    for (int m = 0; m < MR; m++) {
                        const __m256i s = _mm256_add_epi16(_mm256_maddubs_epi16(lo, xl[m]),
                                                           _mm256_maddubs_epi16(hi, xh[m]));
                        acc[m][b][h] = _mm256_add_epi32(acc[m][b][h], _mm256_madd_epi16(s, ones));
                    }
                }
            }
        }
#pragma GCC unroll 2
        for (int m = 0; m < MR; m++) {
            const __m256i corr = _mm256_set1_epi32(8 * xsum256(xr + (int64_t)m * Kp + k0, G));
#pragma GCC unroll 2
            for (int b = 0; b < NB; b++)
#pragma GCC unroll 2
                for (int h = 0; h < 2; h++) {
                    const __m256 sc = _mm256_loadu_ps(sb + ((int64_t)b * ng + g) * 16 + h * 8);
                    const __m256 d = _mm256_cvtepi32_ps(_mm256_sub_epi32(acc[m][b][h], corr));
                    f[m][b][h] = _mm256_fmadd_ps(d, sc, f[m][b][h]);
                }
        }
    }
#pragma GCC unroll 2
    for (int m = 0; m < MR; m++) {
        const __m256 xs = _mm256_set1_ps(x->x_scale[t0 + m]);
#pragma GCC unroll 2
        for (int b = 0; b < NB; b++)
#pragma GCC unroll 2
            for (int h = 0; h < 2; h++) _mm256_storeu_ps(y + m * ldy + b * 16 + h * 8, _mm256_mul_ps(f[m][b][h], xs));
    }
}

static void micro_int4(const ktk_mat *w, const ktk_act *x, int b0, int t0, float *y, int64_t ldy, int mr, int nb) {
    if (mr == 2) mk_int4(w, x, b0, t0, y, ldy, 2, 1);
    else if (nb == 2) mk_int4(w, x, b0, t0, y, ldy, 1, 2);
    else mk_int4(w, x, b0, t0, y, ldy, 1, 1);
}
#pragma GCC pop_options

/* Rows in pairs (a lone last row), blocks in pairs for one row: decode reads each weight byte once. */
void ktk_avx2_gemm_int4_direct(const ktk_mat *w, int nb0, int nb1, const ktk_act *x, float *y, int64_t ldy) {
    const int n = x->n;
    const int nbg = n == 1 ? 2 : 1;
    for (int b = nb0; b < nb1; b += nbg) {
        const int nb = nb1 - b < nbg ? nb1 - b : nbg;
        for (int t = 0; t < n; t += 2)
            micro_int4(w, x, b, t, y + (int64_t)t * ldy + (int64_t)(b - nb0) * 16, ldy, n - t >= 2 ? 2 : 1, nb);
    }
}

void ktk_avx2_gemm_int4(const ktk_mat *w, int nb0, int nb1, const ktk_act *x, float *y, int64_t ldy) {
    if (ktk_int4_dequant(w, x, 0))
        ktk_int4_dequant_gemm(w, nb0, nb1, x, y, ldy, ktk_generic_dequant_int4, ktk_kernels_avx2()->gemm_bf16);
    else
        ktk_avx2_gemm_int4_direct(w, nb0, nb1, x, y, ldy);
}
