/* AVX-512 decode kernels (ktk_gemv_fn, kernels.h): M matrices, one row of x each, all M x NB weight streams read
 * in one loop over K.
 *
 * Why: a one-token forward reads every weight byte once, and a core's read bandwidth is bound by the memory
 * requests it keeps in flight. The gemm micro-kernels of gemm.c / int4.c stream NB <= 4 blocks of one matrix at a
 * time (their rows share the weights); here gate and up of an expert (M = 2), or the down matrices of up to 8
 * experts (M = 8), stream together, NB <= 2 blocks of each (measured, below): 4 and up to 16 streams per thread,
 * as in the best variant of the memory read probe (ktinject.bench.memory: 16 streams per thread, 1 KB prefetch).
 * Used by default where measured faster (kernels.h: gemv_default): the AMX table. On a small AVX-512 machine the
 * same A/B gave no gain over the item path, so the AVX-512 tables provide them without using them by default.
 * Each (matrix, block) accumulator sees exactly the operations of the gemm kernel of the same variant with one row
 * (gemm.c: mk_bf16_dp, mk_bf16_plain, mk_int8_vnni; int4_micro.h with vpdpbusd), in the same order, so the results
 * are bit-identical to it (tested). Register budget: M x NB accumulators <= 16 (int4: float + int32 per pair, <= 8).
 * Variants without VNNI for int8/int4 have no gemv (NULL: the forward takes its item path).
 */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <immintrin.h>
#include "../kernels.h"
#include "drive.h"
#include "gemv.h"

#ifndef PF_SCALE_GROUPS
#define PF_SCALE_GROUPS 4   /* as int4.c */
#endif

/* switch (M, NB) -> FN(w, x, b0, y, yo, M, NB) with constants (an always-inline body). NB <= 2 blocks per matrix:
 * in a sweep of one-token forwards against the item path, NB <= 2 was the best of NB 1, <= 2 and <= 4
 * (docs/performance.md). bf16, int8: M <= 8 (<= 16 accumulators); int4 (a float and an int32 accumulator each):
 * NB 1 from M = 5. */
#define KTK_GEMV_CASES16(FN)                                                                                      \
    switch (M * 8 + NB) {                                                                                          \
    case 8 + 1: FN(w, x, b0, y, yo, 1, 1); break; case 8 + 2: FN(w, x, b0, y, yo, 1, 2); break; case 16 + 1: FN(w, x, b0, y, yo, 2, 1); break;                  \
    case 16 + 2: FN(w, x, b0, y, yo, 2, 2); break; case 24 + 1: FN(w, x, b0, y, yo, 3, 1); break; case 24 + 2: FN(w, x, b0, y, yo, 3, 2); break;                \
    case 32 + 1: FN(w, x, b0, y, yo, 4, 1); break; case 32 + 2: FN(w, x, b0, y, yo, 4, 2); break; case 40 + 1: FN(w, x, b0, y, yo, 5, 1); break;                \
    case 40 + 2: FN(w, x, b0, y, yo, 5, 2); break; case 48 + 1: FN(w, x, b0, y, yo, 6, 1); break; case 48 + 2: FN(w, x, b0, y, yo, 6, 2); break;                \
    case 56 + 1: FN(w, x, b0, y, yo, 7, 1); break; case 56 + 2: FN(w, x, b0, y, yo, 7, 2); break; case 64 + 1: FN(w, x, b0, y, yo, 8, 1); break;                \
    case 64 + 2: FN(w, x, b0, y, yo, 8, 2); break;                                                                                \
    default: abort();                                                                                              \
    }
#ifndef KTK_GEMV_NB
#define KTK_GEMV_NB 2   /* blocks per matrix at most (A/B builds: KTINJECT_CFLAGS=-DKTK_GEMV_NB=1) */
#endif
static inline int nbmax16(int M) { (void)M; return KTK_GEMV_NB; }

#define KTK_GEMV_CASES8(FN)                                                                                       \
    switch (M * 8 + NB) {                                                                                          \
    case 8 + 1: FN(w, x, b0, y, yo, 1, 1); break; case 8 + 2: FN(w, x, b0, y, yo, 1, 2); break; case 16 + 1: FN(w, x, b0, y, yo, 2, 1); break;                  \
    case 16 + 2: FN(w, x, b0, y, yo, 2, 2); break; case 24 + 1: FN(w, x, b0, y, yo, 3, 1); break; case 24 + 2: FN(w, x, b0, y, yo, 3, 2); break;                \
    case 32 + 1: FN(w, x, b0, y, yo, 4, 1); break; case 32 + 2: FN(w, x, b0, y, yo, 4, 2); break; case 40 + 1: FN(w, x, b0, y, yo, 5, 1); break;                \
    case 48 + 1: FN(w, x, b0, y, yo, 6, 1); break; case 56 + 1: FN(w, x, b0, y, yo, 7, 1); break; case 64 + 1: FN(w, x, b0, y, yo, 8, 1); break;                \
    default: abort();                                                                                              \
    }
static inline int nbmax8(int M) { return M <= 4 ? KTK_GEMV_NB : 1; }

typedef void (*gemv_micro)(const ktk_mat *const *w, const ktk_act *const *x, int b0, float *const *y, int yo, int M,
                           int NB);

/* blocks [nb0, nb1) in groups of NB <= nbmax; y[m] + (b - nb0) * 16 */
static inline void gemv_drive(gemv_micro micro, int nbmax, int M, const ktk_mat *const *w, int nb0, int nb1,
                              const ktk_act *const *x, float *const *y) {
    if (M < 1 || M > KTK_GEMV_MAX) abort();
    for (int b = nb0; b < nb1; b += nbmax) {
        const int nb = nb1 - b < nbmax ? nb1 - b : nbmax;
        micro(w, x, b, y, (b - nb0) * 16, M, nb);
    }
}

/* A variant's entry point ktk_avx512_gemv_NAME (ktk_gemv_fn) and its micro-kernel: CASES (above) instantiates the
 * always-inline BODYFN for each (M, NB); NBMAX(M) caps NB. Expanded inside the variant's target region. */
#define KTK_GEMV_ENTRY(NAME, BODYFN, CASES, NBMAX)                                                                  \
    static void micro_##NAME(const ktk_mat *const *w, const ktk_act *const *x, int b0, float *const *y, int yo,    \
                             int M, int NB) {                                                                      \
        CASES(BODYFN)                                                                                              \
    }                                                                                                              \
    void ktk_avx512_gemv_##NAME(int M, const ktk_mat *const *w, int nb0, int nb1, const ktk_act *const *x,         \
                                float *const *y) {                                                                 \
        gemv_drive(micro_##NAME, NBMAX(M), M, w, nb0, nb1, x, y);                                                  \
    }

/* ======================= bf16 with AVX512_BF16 (as mk_bf16_dp) ======================= */
#pragma GCC push_options
#pragma GCC target("avx512f,avx512bw,avx512vl,avx512bf16")
KTK_AI void mv_bf16_dp(const ktk_mat *const *w, const ktk_act *const *x, int b0, float *const *y, int yo,
                       const int M, const int NB) {
    const int Kp = w[0]->Kp;
    const int64_t bs = (int64_t)Kp * 16;
    const uint16_t *wb[KTK_GEMV_MAX], *xr[KTK_GEMV_MAX];
    __m512 acc[KTK_GEMV_MAX][2];
#pragma GCC unroll 8
    for (int m = 0; m < M; m++) {
        wb[m] = w[m]->data_bf16 + (int64_t)b0 * bs;
        xr[m] = x[m]->x_bf16;
#pragma GCC unroll 2
        for (int b = 0; b < NB; b++) acc[m][b] = _mm512_setzero_ps();
    }
    for (int k = 0; k < Kp; k += 2) {
#pragma GCC unroll 8
        for (int m = 0; m < M; m++) {
            int32_t xp;
            memcpy(&xp, xr[m] + k, 4);
            const __m512bh xv = (__m512bh)_mm512_set1_epi32(xp);
#pragma GCC unroll 2
            for (int b = 0; b < NB; b++) {
                const uint16_t *p = wb[m] + b * bs + (int64_t)k * 16;
                const __m512i v = _mm512_loadu_si512((const void *)p);
                if (PF_BYTES) _mm_prefetch((const char *)p + PF_BYTES, PF_HINT);
                acc[m][b] = _mm512_dpbf16_ps(acc[m][b], xv, (__m512bh)v);
            }
        }
    }
#pragma GCC unroll 8
    for (int m = 0; m < M; m++)
#pragma GCC unroll 2
        for (int b = 0; b < NB; b++) _mm512_storeu_ps(y[m] + yo + b * 16, acc[m][b]);
}

KTK_GEMV_ENTRY(bf16_dp, mv_bf16_dp, KTK_GEMV_CASES16, nbmax16)
#pragma GCC pop_options

/* ======================= bf16, plain AVX-512 F (as mk_bf16_plain) ======================= */
#pragma GCC push_options
#pragma GCC target("avx512f,avx512bw,avx512vl")
KTK_AI void mv_bf16_plain(const ktk_mat *const *w, const ktk_act *const *x, int b0, float *const *y, int yo,
                          const int M, const int NB) {
    const int Kp = w[0]->Kp;
    const int64_t bs = (int64_t)Kp * 16;
    const __m512i hi = _mm512_set1_epi32((int)0xffff0000u);
    const uint16_t *wb[KTK_GEMV_MAX], *xr[KTK_GEMV_MAX];
    __m512 acc[KTK_GEMV_MAX][2];
    float xf[KTK_GEMV_MAX][64] __attribute__((aligned(64)));   /* x as f32 for one chunk of 64 inputs */
#pragma GCC unroll 8
    for (int m = 0; m < M; m++) {
        wb[m] = w[m]->data_bf16 + (int64_t)b0 * bs;
        xr[m] = x[m]->x_bf16;
#pragma GCC unroll 2
        for (int b = 0; b < NB; b++) acc[m][b] = _mm512_setzero_ps();
    }
    for (int kc = 0; kc < Kp; kc += 64) {
#pragma GCC unroll 8
        for (int m = 0; m < M; m++)
#pragma GCC unroll 4
            for (int i = 0; i < 4; i++) {
                const __m256i h = _mm256_loadu_si256((const __m256i *)(xr[m] + kc + i * 16));
                _mm512_store_ps(xf[m] + i * 16, _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16)));
            }
        for (int p = 0; p < 32; p++) {
#pragma GCC unroll 8
            for (int m = 0; m < M; m++) {
                const __m512 xe = _mm512_set1_ps(xf[m][2 * p]), xo = _mm512_set1_ps(xf[m][2 * p + 1]);
#pragma GCC unroll 2
                for (int b = 0; b < NB; b++) {
                    const uint16_t *q = wb[m] + b * bs + (int64_t)(kc + 2 * p) * 16;
                    const __m512i v = _mm512_loadu_si512((const void *)q);
                    if (PF_BYTES) _mm_prefetch((const char *)q + PF_BYTES, PF_HINT);
                    const __m512 we = _mm512_castsi512_ps(_mm512_slli_epi32(v, 16));
                    const __m512 wo = _mm512_castsi512_ps(_mm512_and_si512(v, hi));
                    acc[m][b] = _mm512_fmadd_ps(wo, xo, _mm512_fmadd_ps(we, xe, acc[m][b]));
                }
            }
        }
    }
#pragma GCC unroll 8
    for (int m = 0; m < M; m++)
#pragma GCC unroll 2
        for (int b = 0; b < NB; b++) _mm512_storeu_ps(y[m] + yo + b * 16, acc[m][b]);
}

KTK_GEMV_ENTRY(bf16_plain, mv_bf16_plain, KTK_GEMV_CASES16, nbmax16)
#pragma GCC pop_options

/* ======================= int8 with AVX512_VNNI (as mk_int8_vnni) ======================= */
#pragma GCC push_options
#pragma GCC target("avx512f,avx512bw,avx512vl,avx512vnni")
KTK_AI void mv_int8_vnni(const ktk_mat *const *w, const ktk_act *const *x, int b0, float *const *y, int yo,
                         const int M, const int NB) {
    const int Kp = w[0]->Kp;
    const int64_t bs = (int64_t)Kp * 16;
    const __m512i flip = _mm512_set1_epi8((char)0x80);
    const int8_t *wb[KTK_GEMV_MAX], *xr[KTK_GEMV_MAX];
    __m512i acc[KTK_GEMV_MAX][2];
    int32_t xu[KTK_GEMV_MAX][16] __attribute__((aligned(64)));   /* x + 128 as u8, 4 per int32, one chunk of 64 */
#pragma GCC unroll 8
    for (int m = 0; m < M; m++) {
        wb[m] = w[m]->data_i8 + (int64_t)b0 * bs;
        xr[m] = x[m]->x_i8;
#pragma GCC unroll 2
        for (int b = 0; b < NB; b++) acc[m][b] = _mm512_setzero_si512();
    }
    for (int kc = 0; kc < Kp; kc += 64) {
#pragma GCC unroll 8
        for (int m = 0; m < M; m++)
            _mm512_store_si512((void *)xu[m], _mm512_xor_si512(_mm512_loadu_si512((const void *)(xr[m] + kc)), flip));
        for (int g = 0; g < 16; g++) {
#pragma GCC unroll 8
            for (int m = 0; m < M; m++) {
                const __m512i xv = _mm512_set1_epi32(xu[m][g]);
#pragma GCC unroll 2
                for (int b = 0; b < NB; b++) {
                    const int8_t *p = wb[m] + b * bs + (int64_t)kc * 16 + g * 64;
                    const __m512i v = _mm512_loadu_si512((const void *)p);
                    if (PF_BYTES) _mm_prefetch((const char *)p + PF_BYTES, PF_HINT);
                    acc[m][b] = _mm512_dpbusd_epi32(acc[m][b], xv, v);
                }
            }
        }
    }
#pragma GCC unroll 8
    for (int m = 0; m < M; m++) {
        const __m512 xs = _mm512_set1_ps(x[m]->x_scale[0]);
#pragma GCC unroll 2
        for (int b = 0; b < NB; b++) {
            const int j = (b0 + b) * 16;
            const __m512i corr = _mm512_slli_epi32(_mm512_loadu_si512((const void *)(w[m]->wsum + j)), 7);
            const __m512 sc = _mm512_loadu_ps(w[m]->scale + j);
            const __m512 f = _mm512_cvtepi32_ps(_mm512_sub_epi32(acc[m][b], corr));
            _mm512_storeu_ps(y[m] + yo + b * 16, _mm512_mul_ps(_mm512_mul_ps(f, xs), sc));
        }
    }
}

KTK_GEMV_ENTRY(int8_vnni, mv_int8_vnni, KTK_GEMV_CASES16, nbmax16)

/* ======================= int4 x int8 with AVX512_VNNI (as int4_micro.h with vpdpbusd) ======================= */
KTK_AI void mv_int4_vnni(const ktk_mat *const *w, const ktk_act *const *x, int b0, float *const *y, int yo,
                         const int M, const int NB) {
    const int Kp = w[0]->Kp, G = w[0]->group, ng = Kp / G, rows = G / 8;
    const int64_t bs = (int64_t)Kp * 8;                  /* bytes per column block */
    const __m512i c88 = _mm512_set1_epi8((char)0x88), c0f = _mm512_set1_epi8(0x0f);
    const uint8_t *wb[KTK_GEMV_MAX];
    const float *sb[KTK_GEMV_MAX];
    const int8_t *xr[KTK_GEMV_MAX];
    __m512 f[KTK_GEMV_MAX][2];
#pragma GCC unroll 8
    for (int m = 0; m < M; m++) {
        wb[m] = w[m]->data_i4 + (int64_t)b0 * bs;
        sb[m] = w[m]->scale + (int64_t)b0 * ng * 16;
        xr[m] = x[m]->x_i8;
#pragma GCC unroll 2
        for (int b = 0; b < NB; b++) f[m][b] = _mm512_setzero_ps();
    }
    for (int g = 0; g < ng; g++) {
        const int k0 = g * G;
        __m512i acc[KTK_GEMV_MAX][2];
#pragma GCC unroll 8
        for (int m = 0; m < M; m++)
#pragma GCC unroll 2
            for (int b = 0; b < NB; b++) acc[m][b] = _mm512_setzero_si512();
        for (int r = 0; r < rows; r++) {                 /* 8 inputs: 64 bytes per block */
#pragma GCC unroll 8
            for (int m = 0; m < M; m++) {
                int32_t a, c;
                memcpy(&a, xr[m] + k0 + r * 8, 4);
                memcpy(&c, xr[m] + k0 + r * 8 + 4, 4);
                const __m512i xl = _mm512_set1_epi32(a), xh = _mm512_set1_epi32(c);
#pragma GCC unroll 2
                for (int b = 0; b < NB; b++) {
                    const uint8_t *p = wb[m] + b * bs + (int64_t)k0 * 8 + r * 64;
                    const __m512i v = _mm512_loadu_si512((const void *)p);
                    if (PF_BYTES) _mm_prefetch((const char *)p + PF_BYTES, PF_HINT);
                    const __m512i lo = _mm512_ternarylogic_epi32(v, c88, c0f, 0x28);      /* (v ^ 0x88) & 0x0f */
                    const __m512i hi = _mm512_ternarylogic_epi32(_mm512_srli_epi16(v, 4), c88, c0f, 0x28);
                    acc[m][b] = _mm512_dpbusd_epi32(_mm512_dpbusd_epi32(acc[m][b], lo, xl), hi, xh);
                }
            }
        }
#pragma GCC unroll 8
        for (int m = 0; m < M; m++) {
            const __m512i corr = _mm512_set1_epi32(8 * ktk512_xsum(xr[m] + k0, G));
#pragma GCC unroll 2
            for (int b = 0; b < NB; b++) {
                const float *ps = sb[m] + ((int64_t)b * ng + g) * 16;
                if (PF_BYTES) _mm_prefetch((const char *)(ps + 16 * PF_SCALE_GROUPS), PF_HINT);
                const __m512 d = _mm512_cvtepi32_ps(_mm512_sub_epi32(acc[m][b], corr));
                f[m][b] = _mm512_fmadd_ps(d, _mm512_loadu_ps(ps), f[m][b]);
            }
        }
    }
#pragma GCC unroll 8
    for (int m = 0; m < M; m++) {
        const __m512 xs = _mm512_set1_ps(x[m]->x_scale[0]);
#pragma GCC unroll 2
        for (int b = 0; b < NB; b++) _mm512_storeu_ps(y[m] + yo + b * 16, _mm512_mul_ps(f[m][b], xs));
    }
}

KTK_GEMV_ENTRY(int4_vnni, mv_int4_vnni, KTK_GEMV_CASES8, nbmax8)
#pragma GCC pop_options
