/* AVX-512 BF16 fp8 (W8A16) kernels of the avx512+bf16 variants: the direct kernel and the decode gemv with vdpbf16ps
 * (AVX512_BF16) on e4m3 bytes placed as bf16 by vpermb (AVX512_VBMI). Without VBMI, and on Intel's cores (where
 * vdpbf16ps is the slower instruction: cpu_dp), the table entries run fp8.c's FMA kernels (ktk_avx512_fp8_dp_kernels).
 *
 *   x:        rows converted once per call to float times 2^a (ktk_fp8_rows, the caller's workspace), then in place
 *             to bf16 pairs: uint32 p = bf16(x[c] 2^a) << 16 | bf16(x[c + 1] 2^a) (c even; exact: x is bf16).
 *   weights:  one 64-byte packed line = inputs c..c+3 x 16 outputs; vpermb puts the byte of (output n, input c) in
 *             the high byte of word 2n + 1 and that of input c + 1 in word 2n (zmm A; c + 2, c + 3: zmm B), then
 *             vpsraw 4 and vpandd 0x87f0 give per word the bf16 of e4m3 * 2^-120 (sign to bit 15, exponent and
 *             mantissa to bits 10..4); the low bytes vpermb leaves there are shifted out or masked off.
 *   products: p = vdpbf16ps(p, A, pair c); p = vdpbf16ps(p, B, pair c + 2): per lane, as Intel documents it, p +
 *             w[c] x[c] (odd word first: why input c goes to word 2n + 1), rounded, then + w[c + 1] x[c + 1], rounded:
 *             bf16 products are exact in float, so these are the generic reference's fmaf steps in its order on the
 *             scaled operands (vdpbf16ps flushes subnormal inputs and results to zero: outside the normal range the
 *             contract of kernels.h does not promise bits anyway).
 *   subnormals: e4m3 codes with exponent 0 and mantissa != 0 would be bf16 subnormals, flushed. A line holding one
 *             (vptestnmb 0x78, masked vptestmb 0x07: rare in real checkpoints) takes a branch that runs its four
 *             inputs as exact float FMAs in the same order: weights as e4m3 * 2^-112 and x * 2^(a - 8), both normal
 *             (no microcode assists for subnormal operands), the same products.
 *   per group p as above; acc = fma(p, the block's scale, acc); y = acc * 2^(120 - a), as fp8.c's kernels.
 * So where vdpbf16ps rounds as documented the results are fp8.c's bits (so on Intel's cores, where the harness runs
 * these kernels although the tables do not): the kernel harness requires that where its probe finds the documented
 * rounding, and elsewhere a tolerance (kernels.h). The gemv runs the same instructions per (matrix, block) as the
 * direct kernel with one row: bit-identical to it on every CPU.
 * Layouts: see ../kernels.h. Called concurrently: no mutable globals but the idempotent CPUID cache, no allocation.
 */
#include <stdint.h>
#include <stdlib.h>
#include <cpuid.h>
#include <immintrin.h>
#include "../kernels.h"
#include "drive.h"
#include "fp8.h"

/* Whether the table entries run the vdpbf16ps kernels: AVX512_VBMI (CPUID leaf 7 ECX bit 1) on a CPU not made by
 * Intel. On Intel's AVX-512 BF16 cores vdpbf16ps is slower than two FMAs (a fraction of their throughput, twice
 * their latency: docs/performance.md), and these kernels lost to fp8.c's at every row count with the weights in L2
 * and from 2 rows with them streamed; on AMD's cores it is the faster instruction (avx512/gemm.c's bf16 kernels).
 * Read once (an idempotent int: racing first calls are harmless). */
static int cpu_dp(void) {
    static volatile int cached = -1;
    int v = cached;
    if (v >= 0) return v;
    unsigned a, b, c, d;
    const int intel = __get_cpuid(0, &a, &b, &c, &d) && b == 0x756e6547u && d == 0x49656e69u &&
                      c == 0x6c65746eu;   /* "GenuineIntel" */
    v = !intel && __get_cpuid_count(7, 0, &a, &b, &c, &d) && ((c >> 1) & 1);
    cached = v;
    return v;
}

#pragma GCC push_options
#pragma GCC target("avx512f,avx512bw,avx512vl,avx512bf16,avx512vbmi")

/* Float rows of ktk_fp8_rows at xf (rows Kp apart) -> pair rows at the same address (rows Kp / 2 apart; writes stay
 * behind reads). vpermt2w picks the high words of floats 2j + 1 (-> word 2j) and 2j (-> word 2j + 1). */
static void rows_to_pairs(float *xf, int rows, int Kp) {
    uint32_t *dst = (uint32_t *)xf;
    uint16_t ix[32];
    for (int j = 0; j < 16; j++) ix[2 * j] = (uint16_t)(4 * j + 3), ix[2 * j + 1] = (uint16_t)(4 * j + 1);
    const __m512i idx = _mm512_loadu_si512((const void *)ix);
    for (int t = 0; t < rows; t++)
        for (int c = 0; c < Kp; c += 32) {   /* Kp % 64 == 0 */
            const __m512i lo = _mm512_loadu_si512((const void *)(xf + (int64_t)t * Kp + c));
            const __m512i hi = _mm512_loadu_si512((const void *)(xf + (int64_t)t * Kp + c + 16));
            _mm512_storeu_si512((void *)(dst + (int64_t)t * (Kp / 2) + c / 2), _mm512_permutex2var_epi16(lo, idx, hi));
        }
}

typedef struct { __m512i ia, ib, m87f0, e78, m07; } consts;

KTK_AI consts make_consts(void) {
    uint8_t a[64], b[64];
    for (int n = 0; n < 16; n++) {   /* high bytes: word 2n + 1 <- input c (line byte n), word 2n <- input c + 1 */
        a[4 * n] = a[4 * n + 2] = b[4 * n] = b[4 * n + 2] = 0;
        a[4 * n + 3] = (uint8_t)n, a[4 * n + 1] = (uint8_t)(16 + n);
        b[4 * n + 3] = (uint8_t)(32 + n), b[4 * n + 1] = (uint8_t)(48 + n);
    }
    consts k;
    k.ia = _mm512_loadu_si512((const void *)a);
    k.ib = _mm512_loadu_si512((const void *)b);
    k.m87f0 = _mm512_set1_epi16((short)0x87f0);
    k.e78 = _mm512_set1_epi8(0x78);
    k.m07 = _mm512_set1_epi8(0x07);
    return k;
}

/* bytes of e4m3 codes with exponent 0 and mantissa != 0 */
KTK_AI __mmask64 subnormals(__m512i L, const consts *k) {
    return _mm512_mask_test_epi8_mask(_mm512_testn_epi8_mask(L, k->e78), L, k->m07);
}

KTK_AI __m512bh bf16_of(__m512i L, __m512i idx, const consts *k) {
    return (__m512bh)_mm512_and_si512(_mm512_srai_epi16(_mm512_permutexvar_epi8(idx, L), 4), k->m87f0);
}

/* The 16 codes of line lane i as floats of value e4m3 * 2^-112 (normal for every code but 0). */
KTK_AI __m128i lane_of(__m512i L, int i) {  /* (a literal per case: the immediate needs no constant folding) */
    switch (i) {
    case 0: return _mm512_extracti32x4_epi32(L, 0);
    case 1: return _mm512_extracti32x4_epi32(L, 1);
    case 2: return _mm512_extracti32x4_epi32(L, 2);
    default: return _mm512_extracti32x4_epi32(L, 3);
    }
}

KTK_AI __m512 f8x16_normal(__m512i L, int i) {
    const __m512i v = _mm512_cvtepi8_epi32(lane_of(L, i));
    const __m512i mag = _mm512_and_si512(v, _mm512_set1_epi32(0x7f));
    const __m512i nrm = _mm512_add_epi32(_mm512_slli_epi32(mag, 20), _mm512_set1_epi32(8 << 23));
    const __m512i sub = _mm512_castps_si512(_mm512_mul_ps(_mm512_cvtepi32_ps(mag), _mm512_set1_ps(0x1p-121f)));
    const __m512i f = _mm512_mask_blend_epi32(_mm512_cmpge_epi32_mask(mag, _mm512_set1_epi32(8)), sub, nrm);
    return _mm512_castsi512_ps(_mm512_or_si512(f, _mm512_and_si512(v, _mm512_set1_epi32((int)0x80000000u))));
}

/* The rare branch: inputs c..c+3 of one line as four float FMAs for each of MR pair rows xp (Kp / 2 apart). */
KTK_AI void line_exact(__m512i L, const uint32_t *xp, int64_t xs, int c, __m512 *p, int pstride, const int MR) {
    __m512 wf[4];
#pragma GCC unroll 4
    for (int i = 0; i < 4; i++) wf[i] = f8x16_normal(L, i);
    const __m512 down = _mm512_set1_ps(0x1p-8f);
#pragma GCC unroll 4
    for (int m = 0; m < MR; m++) {
#pragma GCC unroll 2
        for (int h = 0; h < 2; h++) {
            const __m512i pr = _mm512_set1_epi32((int)xp[m * xs + c / 2 + h]);
            const __m512 x0 = _mm512_castsi512_ps(_mm512_and_si512(pr, _mm512_set1_epi32((int)0xffff0000u)));
            const __m512 x1 = _mm512_castsi512_ps(_mm512_slli_epi32(pr, 16));
            p[m * pstride] = _mm512_fmadd_ps(_mm512_mul_ps(x0, down), wf[2 * h], p[m * pstride]);
            p[m * pstride] = _mm512_fmadd_ps(_mm512_mul_ps(x1, down), wf[2 * h + 1], p[m * pstride]);
        }
    }
}

/* One line (inputs c..c+3) of one block into the partial sums p[m * pstride] of MR pair rows. */
KTK_AI void line_dp(const uint8_t *line, const uint32_t *xp, int64_t xs, int c, __m512 *p, int pstride,
                    const consts *k, const int MR) {
    const __m512i L = _mm512_loadu_si512((const void *)line);
    if (__builtin_expect(subnormals(L, k) != 0, 0)) {
        line_exact(L, xp, xs, c, p, pstride, MR);
        return;
    }
    const __m512bh A = bf16_of(L, k->ia, k), B = bf16_of(L, k->ib, k);
#pragma GCC unroll 4
    for (int m = 0; m < MR; m++) {
        const uint32_t *r = xp + m * xs + c / 2;
        p[m * pstride] = _mm512_dpbf16_ps(p[m * pstride], (__m512bh)_mm512_set1_epi32((int)r[0]), A);
        p[m * pstride] = _mm512_dpbf16_ps(p[m * pstride], (__m512bh)_mm512_set1_epi32((int)r[1]), B);
    }
}

KTK_AI void mk_fp8_dp(const ktk_mat *w, const uint32_t *xp, const float *post, int b0, float *y, int64_t ldy,
                      const int MR, const int NB) {
    const int Kp = w->Kp, G = w->group, ng = ktk_fp8_groups(w);
    const int64_t bs = (int64_t)Kp * 16, xs = Kp / 2;
    const uint8_t *wb = w->data_f8 + (int64_t)b0 * bs;
    const float *sb = w->scale + (int64_t)b0 * ng;
    const consts k = make_consts();
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
        for (int c = c0; c < c1; c += 4)
#pragma GCC unroll 4
            for (int b = 0; b < NB; b++) {
                const uint8_t *line = wb + b * bs + (int64_t)c * 16;
                if (PF_BYTES) _mm_prefetch((const char *)line + PF_BYTES, PF_HINT);
                line_dp(line, xp, xs, c, &p[0][b], 4, &k, MR);
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

/* (mr, nb) with mrmax 4, nbmax 4, accmax 8 (p and acc: 16 zmm) */
static void micro_fp8_dp(const ktk_mat *w, const uint32_t *xp, const float *post, int b0, float *y, int64_t ldy,
                         int mr, int nb) {
#define MK(M, B) mk_fp8_dp(w, xp, post, b0, y, ldy, M, B)
    switch (mr * 8 + nb) {
    case 8 + 1: MK(1, 1); break; case 8 + 2: MK(1, 2); break; case 8 + 3: MK(1, 3); break; case 8 + 4: MK(1, 4); break;
    case 16 + 1: MK(2, 1); break; case 16 + 2: MK(2, 2); break; case 16 + 3: MK(2, 3); break;
    case 16 + 4: MK(2, 4); break; case 24 + 1: MK(3, 1); break; case 24 + 2: MK(3, 2); break;
    case 32 + 1: MK(4, 1); break; case 32 + 2: MK(4, 2); break;
    default: abort();
    }
#undef MK
}

/* ktk_fp8_direct's row chunks and (row group, block group) walk, on pair rows. */
static void gemm_fp8_dp_direct(const ktk_mat *w, int nb0, int nb1, const ktk_act *x, float *y, int64_t ldy) {
    enum { MRMAX = 4, NBMAX = 4, ACCMAX = 8 };
    const int n = x->n, Kp = w->Kp;
    if (n <= 0 || nb1 <= nb0) return;
    const int64_t fit = x->work ? x->work_bytes / ktk_fp8_rows_bytes(Kp, 1) : 0;
    if (fit < 1) {
        ktk_generic_gemm_fp8_direct(w, nb0, nb1, x, y, ldy);
        return;
    }
    const int chunk = fit < KTK_FP8_CHUNK_ROWS ? (int)fit : KTK_FP8_CHUNK_ROWS;
    float *xf = x->work, post[KTK_FP8_CHUNK_ROWS];
    const uint32_t *xp = x->work;
    for (int t0 = 0; t0 < n; t0 += chunk) {
        const int rows = n - t0 < chunk ? n - t0 : chunk;
        ktk_fp8_rows(x, t0, rows, xf, post);
        rows_to_pairs(xf, rows, Kp);
        const int groups = (rows + MRMAX - 1) / MRMAX, mrtop = (rows + groups - 1) / groups;
        int nbg = ACCMAX / mrtop;
        nbg = nbg > NBMAX ? NBMAX : nbg < 1 ? 1 : nbg;
        for (int b = nb0; b < nb1; b += nbg) {
            const int nb = nb1 - b < nbg ? nb1 - b : nbg;
            for (int g = 0, t = 0; g < groups; g++) {   /* balanced row groups, as ktk_drive */
                const int mr = (rows - t + (groups - g) - 1) / (groups - g);
                micro_fp8_dp(w, xp + (int64_t)t * (Kp / 2), post + t, b,
                             y + (int64_t)(t0 + t) * ldy + (int64_t)(b - nb0) * 16, ldy, mr, nb);
                t += mr;
            }
        }
    }
}

/* Decode: M matrices w[0..M) with one pair row each (xp rows Kp / 2 apart), NB blocks from b0 -> y[m] + yo. */
KTK_AI void mv_fp8_dp(const ktk_mat *const *w, const uint32_t *xp, const float *post, int b0, float *const *y, int yo,
                      const int M, const int NB) {
    const int Kp = w[0]->Kp, G = w[0]->group, ng = ktk_fp8_groups(w[0]);
    const int64_t bs = (int64_t)Kp * 16, xs = Kp / 2;
    const consts k = make_consts();
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
        for (int c = c0; c < c1; c += 4)
#pragma GCC unroll 8
            for (int m = 0; m < M; m++)
#pragma GCC unroll 2
                for (int b = 0; b < NB; b++) {
                    const uint8_t *line = wb[m] + b * bs + (int64_t)c * 16;
                    if (PF_BYTES) _mm_prefetch((const char *)line + PF_BYTES, PF_HINT);
                    line_dp(line, xp + m * xs, xs, c, &p[m][b], 1, &k, 1);
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

static void micro_gemv_fp8_dp(const ktk_mat *const *w, const uint32_t *xp, const float *post, int b0,
                              float *const *y, int yo, int M, int NB) {
#define MV(MM, B) mv_fp8_dp(w, xp, post, b0, y, yo, MM, B)
    switch (M * 8 + NB) {
    case 8 + 1: MV(1, 1); break; case 8 + 2: MV(1, 2); break; case 16 + 1: MV(2, 1); break;
    case 16 + 2: MV(2, 2); break; case 24 + 1: MV(3, 1); break; case 24 + 2: MV(3, 2); break;
    case 32 + 1: MV(4, 1); break; case 32 + 2: MV(4, 2); break; case 40 + 1: MV(5, 1); break;
    case 48 + 1: MV(6, 1); break; case 56 + 1: MV(7, 1); break; case 64 + 1: MV(8, 1); break;
    default: abort();
    }
#undef MV
}

/* x[0]->work holds the M pair rows (too small: the direct kernel per matrix, the same bits). */
static void gemv_fp8_dp(int M, const ktk_mat *const *w, int nb0, int nb1, const ktk_act *const *x, float *const *y) {
    if (M < 1 || M > KTK_GEMV_MAX) abort();
    const int Kp = w[0]->Kp, nbmax = M <= 4 ? 2 : 1;
    if (!x[0]->work || x[0]->work_bytes < ktk_fp8_rows_bytes(Kp, M)) {
        for (int m = 0; m < M; m++) gemm_fp8_dp_direct(w[m], nb0, nb1, x[m], y[m], (int64_t)(nb1 - nb0) * 16);
        return;
    }
    float *xf = x[0]->work, post[KTK_GEMV_MAX];
    for (int m = 0; m < M; m++) ktk_fp8_rows(x[m], 0, 1, xf + (int64_t)m * Kp, post + m);
    rows_to_pairs(xf, M, Kp);
    for (int b = nb0; b < nb1; b += nbmax) {
        const int nb = nb1 - b < nbmax ? nb1 - b : nbmax;
        micro_gemv_fp8_dp(w, (const uint32_t *)xf, post, b, y, (b - nb0) * 16, M, nb);
    }
}
#pragma GCC pop_options

ktk_fp8_kernels ktk_avx512_fp8_dp_kernels(int use_dp) {
    ktk_fp8_kernels k = {ktk_avx512_gemm_fp8_direct, ktk_avx512_gemv_fp8};
    if (use_dp) k = (ktk_fp8_kernels){gemm_fp8_dp_direct, gemv_fp8_dp};
    return k;
}

int ktk_avx512_fp8_dp_used(void) { return cpu_dp(); }

void ktk_avx512_gemv_fp8_dp(int M, const ktk_mat *const *w, int nb0, int nb1, const ktk_act *const *x,
                            float *const *y) {
    ktk_avx512_fp8_dp_kernels(cpu_dp()).gemv(M, w, nb0, nb1, x, y);
}
