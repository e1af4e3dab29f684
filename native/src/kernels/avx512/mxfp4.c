/* AVX-512 mxfp4 (W4A16) kernels: the direct FMA kernel (prefill rows and, one row at a time, the decode gemv), the
 * dequantization to bf16, and the gemm_mxfp4 entry of the avx512 tables (and of the AMX table, which runs these:
 * no AMX code for mxfp4).
 *
 *   direct:  x rows converted once per call to float (ktk_mxfp4_rows, the caller's workspace); one 64-byte packed
 *            row holds 8 inputs of 16 outputs, one 32-bit lane per output (kernels.h): vpermps with the 16 e2m1
 *            values as its table reads the low 4 bits of each lane, so the lane shifted right by 0, 4, .. 28 gives
 *            the floats of inputs 8r .. 8r + 7 (exact), then vfmadd231ps with the input broadcast from its float
 *            row; per group of 32 p = sum of those products, acc = fma(p, 2^(e - 127), acc), the 16 scales of a
 *            group made from their e8m0 bytes by vpmovzxbd, << 23 (the exponent field) and an unsigned max with
 *            0x00400000 (e 0: 2^-127, a subnormal): the generic reference's float operations in its order, bit for
 *            bit. MR <= 4 rows share each decoded weight vector; NB blocks, MR * NB <= 8 (p and acc: 16 zmm).
 *   gemv:    M matrices with one row each (ktk_gemv_fn), each as the direct kernel with one row and up to 4 blocks
 *            (4 weight streams): bit-identical to it.
 *   dequant: the same decoding, times the scales (exact), the floats' upper halves (exact bf16) interleaved in
 *            pairs: the generic dequantization's bits.
 * gemm_mxfp4 takes the dequantizing path (+ the table's gemm_bf16) from KTK_AVX512_MXFP4_DEQUANT_ROWS rows or when
 * forced, else the direct kernel. Layouts: see ../kernels.h. Called concurrently: no mutable globals, no allocation.
 */
#include <stdint.h>
#include <stdlib.h>
#include <immintrin.h>
#include "../kernels.h"
#include "drive.h"

/* Rows from which gemm_mxfp4 dequantizes to bf16 and runs the table's bf16 kernel; 0: never (forced only). A
 * starting point (the kernel bench, TK_QUANT=mxfp4, A/B the "dq" column). */
#ifndef KTK_AVX512_MXFP4_DEQUANT_ROWS
#define KTK_AVX512_MXFP4_DEQUANT_ROWS 16
#endif

const ktk_kernels *ktk_kernels_avx512(void);

#pragma GCC push_options
#pragma GCC target("avx512f,avx512bw,avx512vl")

KTK_AI __m512 e2m1_lut(void) {
    return _mm512_setr_ps(0.0f, 0.5f, 1.0f, 1.5f, 2.0f, 3.0f, 4.0f, 6.0f, -0.0f, -0.5f, -1.0f, -1.5f, -2.0f, -3.0f,
                          -4.0f, -6.0f);
}

/* the 16 scales 2^(e - 127) of one (block, group) from its 16 e8m0 bytes */
KTK_AI __m512 e8x16(const uint8_t *p) {
    const __m512i e = _mm512_slli_epi32(_mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)p)), 23);
    return _mm512_castsi512_ps(_mm512_max_epu32(e, _mm512_set1_epi32(0x00400000)));
}

KTK_AI void mk_mxfp4(const ktk_mat *w, const float *xf, int b0, float *y, int64_t ldy, const int MR, const int NB) {
    const int Kp = w->Kp, ng = w->K / KTK_MXFP4_GROUP, sg = Kp / KTK_MXFP4_GROUP;
    const int64_t bs = (int64_t)Kp * 8, ss = (int64_t)sg * 16;   /* bytes per column block: weights, scales */
    const uint8_t *wb = w->data_f4 + (int64_t)b0 * bs, *sb = w->scale_e8 + (int64_t)b0 * ss;
    const __m512 lut = e2m1_lut();
    __m512 acc[4][4];
#pragma GCC unroll 4
    for (int m = 0; m < MR; m++)
#pragma GCC unroll 4
        for (int b = 0; b < NB; b++) acc[m][b] = _mm512_setzero_ps();
    for (int g = 0; g < ng; g++) {
        __m512 p[4][4];
#pragma GCC unroll 4
        for (int m = 0; m < MR; m++)
#pragma GCC unroll 4
            for (int b = 0; b < NB; b++) p[m][b] = _mm512_setzero_ps();
#pragma GCC unroll 4
        for (int r = 0; r < 4; r++) {   /* 4 rows of 64 bytes: 8 inputs each */
            const int c0 = g * KTK_MXFP4_GROUP + r * 8;
            __m512i v[4];
#pragma GCC unroll 4
            for (int b = 0; b < NB; b++) {
                const uint8_t *src = wb + b * bs + (int64_t)(c0 / 8) * 64;
                if (PF_BYTES) _mm_prefetch((const char *)src + PF_BYTES, PF_HINT);
                v[b] = _mm512_loadu_si512((const void *)src);
            }
#pragma GCC unroll 8
            for (int k = 0; k < 8; k++) {
                __m512 wv[4];
#pragma GCC unroll 4
                for (int b = 0; b < NB; b++) {
                    wv[b] = _mm512_permutexvar_ps(v[b], lut);
                    v[b] = _mm512_srli_epi32(v[b], 4);
                }
#pragma GCC unroll 4
                for (int m = 0; m < MR; m++) {
                    const __m512 xv = _mm512_set1_ps(xf[(int64_t)m * Kp + c0 + k]);
#pragma GCC unroll 4
                    for (int b = 0; b < NB; b++) p[m][b] = _mm512_fmadd_ps(xv, wv[b], p[m][b]);
                }
            }
        }
#pragma GCC unroll 4
        for (int b = 0; b < NB; b++) {
            const __m512 s = e8x16(sb + b * ss + (int64_t)g * 16);
#pragma GCC unroll 4
            for (int m = 0; m < MR; m++) acc[m][b] = _mm512_fmadd_ps(p[m][b], s, acc[m][b]);
        }
    }
#pragma GCC unroll 4
    for (int m = 0; m < MR; m++)
#pragma GCC unroll 4
        for (int b = 0; b < NB; b++) _mm512_storeu_ps(y + m * ldy + b * 16, acc[m][b]);
}

static void micro_mxfp4(const ktk_mat *w, const float *xf, int b0, float *y, int64_t ldy, int mr, int nb) {
#define MK(M, B) mk_mxfp4(w, xf, b0, y, ldy, M, B)
    switch (mr * 8 + nb) {
    case 8 + 1: MK(1, 1); break; case 8 + 2: MK(1, 2); break; case 8 + 3: MK(1, 3); break; case 8 + 4: MK(1, 4); break;
    case 16 + 1: MK(2, 1); break; case 16 + 2: MK(2, 2); break; case 16 + 3: MK(2, 3); break;
    case 16 + 4: MK(2, 4); break; case 24 + 1: MK(3, 1); break; case 24 + 2: MK(3, 2); break;
    case 32 + 1: MK(4, 1); break; case 32 + 2: MK(4, 2); break;
    default: abort();
    }
#undef MK
}

/* Rows of float x (Kp apart) x blocks [nb0, nb1): balanced row groups of at most 4, blocks in groups of
 * min(4, 8 / rows of the group). */
static void direct_rows(const ktk_mat *w, int nb0, int nb1, const float *xf, int rows, float *y, int64_t ldy) {
    const int groups = (rows + 3) / 4, mrtop = (rows + groups - 1) / groups;
    const int nbg = 8 / mrtop > 4 ? 4 : 8 / mrtop;
    for (int b = nb0; b < nb1; b += nbg) {
        const int nb = nb1 - b < nbg ? nb1 - b : nbg;
        for (int g = 0, t = 0; g < groups; g++) {
            const int mr = (rows - t + (groups - g) - 1) / (groups - g);
            micro_mxfp4(w, xf + (int64_t)t * w->Kp, b, y + (int64_t)t * ldy + (int64_t)(b - nb0) * 16, ldy, mr, nb);
            t += mr;
        }
    }
}

void ktk_avx512_gemm_mxfp4_direct(const ktk_mat *w, int nb0, int nb1, const ktk_act *x, float *y, int64_t ldy) {
    const int n = x->n, Kp = w->Kp;
    if (n <= 0 || nb1 <= nb0) return;
    const int64_t fit = x->work ? x->work_bytes / ktk_fp8_rows_bytes(Kp, 1) : 0;
    if (fit < 1) {
        ktk_generic_gemm_mxfp4_direct(w, nb0, nb1, x, y, ldy);
        return;
    }
    const int chunk = fit < KTK_FP8_CHUNK_ROWS ? (int)fit : KTK_FP8_CHUNK_ROWS;
    float *xf = x->work;
    for (int t0 = 0; t0 < n; t0 += chunk) {
        const int rows = n - t0 < chunk ? n - t0 : chunk;
        ktk_mxfp4_rows(x, t0, rows, xf);
        direct_rows(w, nb0, nb1, xf, rows, y + (int64_t)t0 * ldy, ldy);
    }
}

/* Decode: each matrix's row as float in x[0]->work (one at a time), then the direct kernel with one row. */
void ktk_avx512_gemv_mxfp4(int M, const ktk_mat *const *w, int nb0, int nb1, const ktk_act *const *x,
                           float *const *y) {
    const int Kp = w[0]->Kp;
    const int fits = x[0]->work && x[0]->work_bytes >= ktk_fp8_rows_bytes(Kp, 1);
    for (int m = 0; m < M; m++) {
        if (!fits) {
            ktk_generic_gemm_mxfp4_direct(w[m], nb0, nb1, x[m], y[m], 16 * (nb1 - nb0));
            continue;
        }
        float *xf = x[0]->work;
        ktk_mxfp4_rows(x[m], 0, 1, xf);
        direct_rows(w[m], nb0, nb1, xf, 1, y[m], 16 * (nb1 - nb0));
    }
}

void ktk_avx512_dequant_mxfp4(const ktk_mat *w, int nb0, int nb1, uint16_t *dst) {
    const int Kp = w->Kp, sg = Kp / KTK_MXFP4_GROUP;
    const __m512 lut = e2m1_lut();
    const __m512i hi = _mm512_set1_epi32((int)0xffff0000u);
    for (int b = nb0; b < nb1; b++) {
        const uint8_t *wb = w->data_f4 + (int64_t)b * Kp * 8, *sb = w->scale_e8 + (int64_t)b * sg * 16;
        uint16_t *db = dst + (int64_t)(b - nb0) * 16 * Kp;
        for (int g = 0; g < sg; g++) {
            const __m512 s = e8x16(sb + (int64_t)g * 16);
            for (int r = 0; r < 4; r++) {
                const int c0 = g * KTK_MXFP4_GROUP + r * 8;
                __m512i v = _mm512_loadu_si512((const void *)(wb + (int64_t)(c0 / 8) * 64));
#pragma GCC unroll 4
                for (int k = 0; k < 8; k += 2) {   /* inputs c0 + k (even) and c0 + k + 1 -> one row of pairs */
                    const __m512i lo = _mm512_castps_si512(_mm512_mul_ps(_mm512_permutexvar_ps(v, lut), s));
                    v = _mm512_srli_epi32(v, 4);
                    const __m512i up = _mm512_castps_si512(_mm512_mul_ps(_mm512_permutexvar_ps(v, lut), s));
                    v = _mm512_srli_epi32(v, 4);
                    const __m512i pair = _mm512_or_si512(_mm512_srli_epi32(lo, 16), _mm512_and_si512(up, hi));
                    _mm512_storeu_si512((void *)(db + (int64_t)((c0 + k) / 2) * 32), pair);
                }
            }
        }
    }
}
#pragma GCC pop_options

/* The table entry: the dequantizing path from KTK_AVX512_MXFP4_DEQUANT_ROWS rows (or forced), else direct. */
void ktk_avx512_gemm_mxfp4(const ktk_mat *w, int nb0, int nb1, const ktk_act *x, float *y, int64_t ldy) {
    if (ktk_fp8_dequant(w, x, KTK_AVX512_MXFP4_DEQUANT_ROWS))
        ktk_fp8_dequant_gemm(w, nb0, nb1, x, y, ldy, ktk_avx512_dequant_mxfp4, ktk_kernels_avx512()->gemm_bf16);
    else
        ktk_avx512_gemm_mxfp4_direct(w, nb0, nb1, x, y, ldy);
}
