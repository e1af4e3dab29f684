/* AVX-512 fp8 (W8A16) kernels: the direct FMA kernel, its decode gemv and the dequantization to bf16 (AVX-512 F/BW:
 * every variant of the table, and the AMX table below its crossover), and the gemm_fp8 table entries (the
 * avx512+bf16 variants' direct kernel and gemv, with vdpbf16ps: fp8_bf16.c).
 *
 *   direct:   x rows converted once per call to float times 2^a (ktk_fp8_rows, the caller's workspace); a 16-byte
 *             packed row (16 outputs of one input): vpmovsxbd -> vpslld 20 -> vpandd 0x87f00000, floats of value
 *             e4m3 * 2^-120 (kernels.h), then vfmadd231ps with the input broadcast from its float row ({1to16}); per
 *             group p = sum of those products, acc = fma(p, the block's scale, acc); y = acc * 2^(120 - a): the
 *             float operations of the generic reference on scaled operands (bit-identical where nothing leaves the
 *             normal range). MR <= 4 rows share each converted weight vector; NB blocks, MR * NB <= 8 (p and acc:
 *             16 zmm). e4m3 subnormal codes become float subnormals: exact, but Intel cores take a microcode assist
 *             for each FMA with a subnormal operand (slow on data with many of them; fp8_bf16.c avoids it).
 *   gemv:     M matrices with one row each (ktk_gemv_fn): M x NB weight streams in one loop over K (NB <= 2 for
 *             M <= 4, else 1), each accumulator as the direct kernel's with one row: bit-identical to it.
 *   dequant:  the same conversion, * 2^120 (exact), * scale, rounded to bf16 (nearest even, by integer ops: the
 *             generic dequantization's bits, denormal products included) and interleaved in pairs.
 * gemm_fp8 takes the dequantizing path (+ the table's gemm_bf16) from KTK_AVX512_FP8_DEQUANT_ROWS rows (FMA direct
 * kernel) or KTK_AVX512_FP8_DP_DEQUANT_ROWS rows (vdpbf16ps direct kernel) or when forced, else the direct kernel.
 * Layouts: see ../kernels.h. Called concurrently: no mutable globals, no allocation.
 */
#include <stdint.h>
#include <stdlib.h>
#include <immintrin.h>
#include "../kernels.h"
#include "drive.h"
#include "fp8.h"

/* Rows from which gemm_fp8 dequantizes to bf16 and runs the table's bf16 kernel on a CPU without AMX; 0: never
 * (forced only). The crossovers of the two direct kernels, in one place (A/B: the kernel bench, TK_QUANT=fp8, its
 * "dq" columns; figures in docs/performance.md). FMA: a starting point, not measured (on AVX2 the direct kernel won
 * at every row count). */
#ifndef KTK_AVX512_FP8_DEQUANT_ROWS
#define KTK_AVX512_FP8_DEQUANT_ROWS 16
#endif
#ifndef KTK_AVX512_FP8_DP_DEQUANT_ROWS
#define KTK_AVX512_FP8_DP_DEQUANT_ROWS 16
#endif

const ktk_kernels *ktk_kernels_avx512(void);

#pragma GCC push_options
#pragma GCC target("avx512f,avx512bw,avx512vl")

/* the 16 e4m3 bytes at p -> 16 floats of value e4m3 * 2^-120 */
KTK_AI __m512 f8x16(const uint8_t *p, __m512i mask) {
    const __m512i v = _mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)p));
    return _mm512_castsi512_ps(_mm512_and_si512(_mm512_slli_epi32(v, 20), mask));
}

KTK_AI void mk_fp8(const ktk_mat *w, const float *xf, const float *post, int b0, float *y, int64_t ldy, const int MR,
                   const int NB) {
    const int Kp = w->Kp, G = w->group, ng = ktk_fp8_groups(w);
    const int64_t bs = (int64_t)Kp * 16;                 /* bytes per column block */
    const uint8_t *wb = w->data_f8 + (int64_t)b0 * bs;
    const float *sb = w->scale + (int64_t)b0 * ng;
    const __m512i mask = _mm512_set1_epi32((int)0x87f00000u);
    __m512 acc[4][4];
#pragma GCC unroll 4
    for (int m = 0; m < MR; m++)
#pragma GCC unroll 4
        for (int b = 0; b < NB; b++) acc[m][b] = _mm512_setzero_ps();
    for (int g = 0; g < ng; g++) {
        const int c0 = g * G, c1 = c0 + G < Kp ? c0 + G : Kp;   /* a multiple of 16 inputs */
        __m512 p[4][4];
#pragma GCC unroll 4
        for (int m = 0; m < MR; m++)
#pragma GCC unroll 4
            for (int b = 0; b < NB; b++) p[m][b] = _mm512_setzero_ps();
        for (int c = c0; c < c1; c += 4) {               /* 4 inputs: one 64-byte line per block */
#pragma GCC unroll 4
            for (int b = 0; b < NB; b++)
                if (PF_BYTES) _mm_prefetch((const char *)(wb + b * bs + (int64_t)c * 16) + PF_BYTES, PF_HINT);
#pragma GCC unroll 4
            for (int i = 0; i < 4; i++) {
                __m512 wv[4];
#pragma GCC unroll 4
                for (int b = 0; b < NB; b++) wv[b] = f8x16(wb + b * bs + (int64_t)(c + i) * 16, mask);
#pragma GCC unroll 4
                for (int m = 0; m < MR; m++) {
                    const __m512 xv = _mm512_set1_ps(xf[(int64_t)m * Kp + c + i]);
#pragma GCC unroll 4
                    for (int b = 0; b < NB; b++) p[m][b] = _mm512_fmadd_ps(xv, wv[b], p[m][b]);
                }
            }
        }
#pragma GCC unroll 4
        for (int b = 0; b < NB; b++) {
            const __m512 s = _mm512_set1_ps(sb[(int64_t)b * ng + g]);
#pragma GCC unroll 4
            for (int m = 0; m < MR; m++) acc[m][b] = _mm512_fmadd_ps(p[m][b], s, acc[m][b]);
        }
    }
#pragma GCC unroll 4
    for (int m = 0; m < MR; m++) {
        const __m512 pf = _mm512_set1_ps(post[m]);
#pragma GCC unroll 4
        for (int b = 0; b < NB; b++) _mm512_storeu_ps(y + m * ldy + b * 16, _mm512_mul_ps(acc[m][b], pf));
    }
}

/* (mr, nb) of ktk_fp8_direct with mrmax 4, nbmax 4, accmax 8 */
static void micro_fp8(const ktk_mat *w, const float *xf, const float *post, int b0, float *y, int64_t ldy, int mr,
                      int nb) {
#define MK(M, B) mk_fp8(w, xf, post, b0, y, ldy, M, B)
    switch (mr * 8 + nb) {
    case 8 + 1: MK(1, 1); break; case 8 + 2: MK(1, 2); break; case 8 + 3: MK(1, 3); break; case 8 + 4: MK(1, 4); break;
    case 16 + 1: MK(2, 1); break; case 16 + 2: MK(2, 2); break; case 16 + 3: MK(2, 3); break;
    case 16 + 4: MK(2, 4); break; case 24 + 1: MK(3, 1); break; case 24 + 2: MK(3, 2); break;
    case 32 + 1: MK(4, 1); break; case 32 + 2: MK(4, 2); break;
    default: abort();
    }
#undef MK
}

void ktk_avx512_gemm_fp8_direct(const ktk_mat *w, int nb0, int nb1, const ktk_act *x, float *y, int64_t ldy) {
    ktk_fp8_direct(w, nb0, nb1, x, y, ldy, micro_fp8, 4, 4, 8);
}

/* Decode: M matrices w[0..M) with one float row each (xf rows Kp apart), NB blocks from b0 of each -> y[m] + yo. */
KTK_AI void mv_fp8(const ktk_mat *const *w, const float *xf, const float *post, int b0, float *const *y, int yo,
                   const int M, const int NB) {
    const int Kp = w[0]->Kp, G = w[0]->group, ng = ktk_fp8_groups(w[0]);
    const int64_t bs = (int64_t)Kp * 16;
    const __m512i mask = _mm512_set1_epi32((int)0x87f00000u);
    const uint8_t *wb[KTK_GEMV_MAX];
    const float *sb[KTK_GEMV_MAX];
    __m512 acc[KTK_GEMV_MAX][2];
#pragma GCC unroll 8
    for (int m = 0; m < M; m++) {
        wb[m] = w[m]->data_f8 + (int64_t)b0 * bs;
        sb[m] = w[m]->scale + (int64_t)b0 * ng;
#pragma GCC unroll 2
        for (int b = 0; b < NB; b++) acc[m][b] = _mm512_setzero_ps();
    }
    for (int g = 0; g < ng; g++) {
        const int c0 = g * G, c1 = c0 + G < Kp ? c0 + G : Kp;
        __m512 p[KTK_GEMV_MAX][2];
#pragma GCC unroll 8
        for (int m = 0; m < M; m++)
#pragma GCC unroll 2
            for (int b = 0; b < NB; b++) p[m][b] = _mm512_setzero_ps();
        for (int c = c0; c < c1; c += 4) {
#pragma GCC unroll 8
            for (int m = 0; m < M; m++)
#pragma GCC unroll 2
                for (int b = 0; b < NB; b++)
                    if (PF_BYTES)
                        _mm_prefetch((const char *)(wb[m] + b * bs + (int64_t)c * 16) + PF_BYTES, PF_HINT);
#pragma GCC unroll 4
            for (int i = 0; i < 4; i++)
#pragma GCC unroll 8
                for (int m = 0; m < M; m++) {
                    const __m512 xv = _mm512_set1_ps(xf[(int64_t)m * Kp + c + i]);
#pragma GCC unroll 2
                    for (int b = 0; b < NB; b++)
                        p[m][b] = _mm512_fmadd_ps(xv, f8x16(wb[m] + b * bs + (int64_t)(c + i) * 16, mask), p[m][b]);
                }
        }
#pragma GCC unroll 8
        for (int m = 0; m < M; m++)
#pragma GCC unroll 2
            for (int b = 0; b < NB; b++)
                acc[m][b] = _mm512_fmadd_ps(p[m][b], _mm512_set1_ps(sb[m][(int64_t)b * ng + g]), acc[m][b]);
    }
#pragma GCC unroll 8
    for (int m = 0; m < M; m++) {
        const __m512 pf = _mm512_set1_ps(post[m]);
#pragma GCC unroll 2
        for (int b = 0; b < NB; b++) _mm512_storeu_ps(y[m] + yo + b * 16, _mm512_mul_ps(acc[m][b], pf));
    }
}

static void micro_gemv_fp8(const ktk_mat *const *w, const float *xf, const float *post, int b0, float *const *y,
                           int yo, int M, int NB) {
#define MV(MM, B) mv_fp8(w, xf, post, b0, y, yo, MM, B)
    switch (M * 8 + NB) {
    case 8 + 1: MV(1, 1); break; case 8 + 2: MV(1, 2); break; case 16 + 1: MV(2, 1); break;
    case 16 + 2: MV(2, 2); break; case 24 + 1: MV(3, 1); break; case 24 + 2: MV(3, 2); break;
    case 32 + 1: MV(4, 1); break; case 32 + 2: MV(4, 2); break; case 40 + 1: MV(5, 1); break;
    case 48 + 1: MV(6, 1); break; case 56 + 1: MV(7, 1); break; case 64 + 1: MV(8, 1); break;
    default: abort();
    }
#undef MV
}

/* x[0]->work holds the M float rows (too small: the direct kernel per matrix, the same bits). */
void ktk_avx512_gemv_fp8(int M, const ktk_mat *const *w, int nb0, int nb1, const ktk_act *const *x,
                         float *const *y) {
    if (M < 1 || M > KTK_GEMV_MAX) abort();
    const int Kp = w[0]->Kp, nbmax = M <= 4 ? 2 : 1;
    if (!x[0]->work || x[0]->work_bytes < ktk_fp8_rows_bytes(Kp, M)) {
        for (int m = 0; m < M; m++) ktk_avx512_gemm_fp8_direct(w[m], nb0, nb1, x[m], y[m], (int64_t)(nb1 - nb0) * 16);
        return;
    }
    float *xf = x[0]->work, post[KTK_GEMV_MAX];
    for (int m = 0; m < M; m++) ktk_fp8_rows(x[m], 0, 1, xf + (int64_t)m * Kp, post + m);
    for (int b = nb0; b < nb1; b += nbmax) {
        const int nb = nb1 - b < nbmax ? nb1 - b : nbmax;
        micro_gemv_fp8(w, xf, post, b, y, (b - nb0) * 16, M, nb);
    }
}

/* bf16 bits of f in the high half of each int32 lane, round to nearest even (ktk_f32_to_bf16 for non-NaN) */
KTK_AI __m512i bf16_hi(__m512 f) {
    const __m512i u = _mm512_castps_si512(f);
    const __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(1));
    return _mm512_add_epi32(u, _mm512_add_epi32(lsb, _mm512_set1_epi32(0x7fff)));
}

void ktk_avx512_dequant_fp8(const ktk_mat *w, int nb0, int nb1, uint16_t *dst) {
    const int Kp = w->Kp, G = w->group, ng = ktk_fp8_groups(w);
    const __m512i mask = _mm512_set1_epi32((int)0x87f00000u), himask = _mm512_set1_epi32((int)0xffff0000u);
    const __m512 two120 = _mm512_set1_ps(0x1p120f);
    for (int b = nb0; b < nb1; b++) {
        const uint8_t *src = w->data_f8 + (int64_t)b * Kp * 16;
        uint16_t *out = dst + (int64_t)(b - nb0) * 16 * Kp;
        for (int c = 0; c < Kp; c += 2) {                /* inputs c, c + 1: one group (G is a multiple of 16) */
            const __m512 s = _mm512_set1_ps(w->scale[(int64_t)b * ng + c / G]);
            const __m512 e = _mm512_mul_ps(_mm512_mul_ps(f8x16(src + (int64_t)c * 16, mask), two120), s);
            const __m512 o = _mm512_mul_ps(_mm512_mul_ps(f8x16(src + (int64_t)c * 16 + 16, mask), two120), s);
            const __m512i row = _mm512_or_si512(_mm512_srli_epi32(bf16_hi(e), 16),
                                                _mm512_and_si512(bf16_hi(o), himask));
            _mm512_storeu_si512((void *)(out + (int64_t)c / 2 * 32), row);
        }
    }
}
#pragma GCC pop_options

static void gemm_fp8(const ktk_mat *w, int nb0, int nb1, const ktk_act *x, float *y, int64_t ldy, ktk_gemm_fn direct,
                     int dequant_rows) {
    if (ktk_fp8_dequant(w, x, dequant_rows))
        ktk_fp8_dequant_gemm(w, nb0, nb1, x, y, ldy, ktk_avx512_dequant_fp8, ktk_kernels_avx512()->gemm_bf16);
    else
        direct(w, nb0, nb1, x, y, ldy);
}

/* The table entries (the bf16 kernel of the dequantizing path is the variant's): the FMA direct kernel, and for the
 * avx512+bf16 variants the vdpbf16ps one (fp8_bf16.c). */
void ktk_avx512_gemm_fp8(const ktk_mat *w, int nb0, int nb1, const ktk_act *x, float *y, int64_t ldy) {
    gemm_fp8(w, nb0, nb1, x, y, ldy, ktk_avx512_gemm_fp8_direct, KTK_AVX512_FP8_DEQUANT_ROWS);
}

void ktk_avx512_gemm_fp8_dp(const ktk_mat *w, int nb0, int nb1, const ktk_act *x, float *y, int64_t ldy) {
    if (ktk_avx512_fp8_dp_used())
        gemm_fp8(w, nb0, nb1, x, y, ldy, ktk_avx512_fp8_dp_kernels(1).direct, KTK_AVX512_FP8_DP_DEQUANT_ROWS);
    else
        ktk_avx512_gemm_fp8(w, nb0, nb1, x, y, ldy);
}
