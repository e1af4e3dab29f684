/* AVX-512 kernels (F/BW/VL), with AVX512_BF16 (vdpbf16ps) and AVX512_VNNI (vpdpbusd) used when the CPU has them.
 *
 * Four variants, picked by ktk_kernels_avx512() from CPUID (see cpu_bits; KTINJECT_AVX512_PLAIN=1 forces the plain
 * F/BW ones):
 *   bf16 "dp":    acc[16 outputs] += vdpbf16ps(broadcast x pair, packed W row (16 outputs x pair))
 *   bf16 plain:   W row -> even/odd f32 by shift/mask, two FMAs with broadcast x[c], x[c+1]
 *   int8 "vnni":  acc += vpdpbusd(broadcast (x + 128) as u8 x4, W row (16 outputs x 4 s8)); acc -= 128 * wsum
 *   int8 plain:   W row -> (w0,w2) / (w1,w3) int16 pairs by shifts, vpmaddwd with (x0,x2) / (x1,x3): exact int32
 *   int4:         int4.c (direct vnni / plain, dequantization to bf16); the driver is drive.h
 *   fp8:          fp8.c (direct FMA kernel, its gemv, dequantization to bf16); the bf16 variants: fp8_bf16.c
 *                 (vdpbf16ps on e4m3 bytes placed by vpermb, where the CPU has AVX512_VBMI)
 *   decode:       gemv.c (several matrices with one row each; bf16 both variants, int8 and int4 with VNNI)
 * Every variant is one register-blocked micro-kernel (MR rows x NB column blocks of 16 outputs, all of K), driven
 * by one loop (ktk_drive) that picks MR/NB from the row count: decode (n <= 4) keeps all rows in one group
 * so each weight byte is read from memory once, with NB streams in flight and software prefetch.
 * Layouts: see ../kernels.h. Called concurrently: no mutable globals, no allocation.
 */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <cpuid.h>
#include <immintrin.h>
#include "../kernels.h"

#include "drive.h"

/* ======================= bf16 with AVX512_BF16 ======================= */
#pragma GCC push_options
#pragma GCC target("avx512f,avx512bw,avx512vl,avx512bf16")

KTK_AI void mk_bf16_dp(const ktk_mat *w, const ktk_act *x, int b0, int t0, float *y, int64_t ldy,
                       const int MR, const int NB) {
    const int Kp = w->Kp;
    const int64_t bs = (int64_t)Kp * 16;                 /* elements per column block */
    const uint16_t *wb = w->data_bf16 + (int64_t)b0 * bs;
    const uint16_t *xr = x->x_bf16 + (int64_t)t0 * Kp;
    __m512 acc[6][4];
#pragma GCC unroll 6
    for (int m = 0; m < MR; m++)
#pragma GCC unroll 4
        for (int b = 0; b < NB; b++) acc[m][b] = _mm512_setzero_ps();
#pragma GCC unroll 2
    for (int k = 0; k < Kp; k += 2) {                    /* one pair of inputs = one 64-byte row per block */
        __m512i wv[4];
#pragma GCC unroll 4
        for (int b = 0; b < NB; b++) {
            const uint16_t *p = wb + b * bs + (int64_t)k * 16;
            wv[b] = _mm512_loadu_si512((const void *)p);
            if (PF_BYTES) _mm_prefetch((const char *)p + PF_BYTES, PF_HINT);
        }
#pragma GCC unroll 6
        for (int m = 0; m < MR; m++) {
            int32_t xp;
            memcpy(&xp, xr + (int64_t)m * Kp + k, 4);
            const __m512bh xv = (__m512bh)_mm512_set1_epi32(xp);
#pragma GCC unroll 4
            for (int b = 0; b < NB; b++) acc[m][b] = _mm512_dpbf16_ps(acc[m][b], xv, (__m512bh)wv[b]);
        }
    }
#pragma GCC unroll 6
    for (int m = 0; m < MR; m++)
#pragma GCC unroll 4
        for (int b = 0; b < NB; b++) _mm512_storeu_ps(y + m * ldy + b * 16, acc[m][b]);
}

static void micro_bf16_dp(const ktk_mat *w, const ktk_act *x, int b0, int t0, float *y, int64_t ldy, int mr,
                          int nb) {
#define BODY(M, B) mk_bf16_dp(w, x, b0, t0, y, ldy, M, B)
    KTK512_CASES(BODY)
#undef BODY
}

void ktk_avx512_gemm_bf16_dp(const ktk_mat *w, int nb0, int nb1, const ktk_act *x, float *y, int64_t ldy) {
    ktk_drive(micro_bf16_dp, 6, 4, 24, w, nb0, nb1, x, y, ldy);
}
#pragma GCC pop_options

/* ======================= int8 with AVX512_VNNI ======================= */
#pragma GCC push_options
#pragma GCC target("avx512f,avx512bw,avx512vl,avx512vnni")

KTK_AI void mk_int8_vnni(const ktk_mat *w, const ktk_act *x, int b0, int t0, float *y, int64_t ldy,
                         const int MR, const int NB) {
    const int Kp = w->Kp;
    const int64_t bs = (int64_t)Kp * 16;                 /* bytes per column block */
    const int8_t *wb = w->data_i8 + (int64_t)b0 * bs;
    const int8_t *xr = x->x_i8 + (int64_t)t0 * Kp;
    const __m512i flip = _mm512_set1_epi8((char)0x80);
    __m512i acc[6][4];
    int32_t xu[6][16] __attribute__((aligned(64)));    /* x + 128 as u8, 4 per int32, for one chunk of 64 */
#pragma GCC unroll 6
    for (int m = 0; m < MR; m++)
#pragma GCC unroll 4
        for (int b = 0; b < NB; b++) acc[m][b] = _mm512_setzero_si512();
    for (int kc = 0; kc < Kp; kc += 64) {
#pragma GCC unroll 6
        for (int m = 0; m < MR; m++) {
            const __m512i v = _mm512_loadu_si512((const void *)(xr + (int64_t)m * Kp + kc));
            _mm512_store_si512((void *)xu[m], _mm512_xor_si512(v, flip));
        }
#pragma GCC unroll 4
        for (int g = 0; g < 16; g++) {
            __m512i wv[4];
#pragma GCC unroll 4
            for (int b = 0; b < NB; b++) {
                const int8_t *p = wb + b * bs + (int64_t)kc * 16 + g * 64;
                wv[b] = _mm512_loadu_si512((const void *)p);
                if (PF_BYTES) _mm_prefetch((const char *)p + PF_BYTES, PF_HINT);
            }
#pragma GCC unroll 6
            for (int m = 0; m < MR; m++) {
                const __m512i xv = _mm512_set1_epi32(xu[m][g]);
#pragma GCC unroll 4
                for (int b = 0; b < NB; b++) acc[m][b] = _mm512_dpbusd_epi32(acc[m][b], xv, wv[b]);
            }
        }
    }
#pragma GCC unroll 4
    for (int b = 0; b < NB; b++) {
        const int j = (b0 + b) * 16;
        const __m512i corr = _mm512_slli_epi32(_mm512_loadu_si512((const void *)(w->wsum + j)), 7);
        const __m512 sc = _mm512_loadu_ps(w->scale + j);
#pragma GCC unroll 6
        for (int m = 0; m < MR; m++) {
            const __m512 f = _mm512_cvtepi32_ps(_mm512_sub_epi32(acc[m][b], corr));
            _mm512_storeu_ps(y + m * ldy + b * 16,
                             _mm512_mul_ps(_mm512_mul_ps(f, _mm512_set1_ps(x->x_scale[t0 + m])), sc));
        }
    }
}

static void micro_int8_vnni(const ktk_mat *w, const ktk_act *x, int b0, int t0, float *y, int64_t ldy, int mr,
                            int nb) {
#define BODY(M, B) mk_int8_vnni(w, x, b0, t0, y, ldy, M, B)
    KTK512_CASES(BODY)
#undef BODY
}

void ktk_avx512_gemm_int8_vnni(const ktk_mat *w, int nb0, int nb1, const ktk_act *x, float *y, int64_t ldy) {
    ktk_drive(micro_int8_vnni, 6, 4, 24, w, nb0, nb1, x, y, ldy);
}
#pragma GCC pop_options

/* ======================= plain AVX-512 F/BW (no BF16, no VNNI) ======================= */
#pragma GCC push_options
#pragma GCC target("avx512f,avx512bw,avx512vl")

KTK_AI void mk_bf16_plain(const ktk_mat *w, const ktk_act *x, int b0, int t0, float *y, int64_t ldy,
                          const int MR, const int NB) {
    const int Kp = w->Kp;
    const int64_t bs = (int64_t)Kp * 16;
    const uint16_t *wb = w->data_bf16 + (int64_t)b0 * bs;
    const uint16_t *xr = x->x_bf16 + (int64_t)t0 * Kp;
    const __m512i hi = _mm512_set1_epi32((int)0xffff0000u);
    __m512 acc[6][4];
    float xf[6][64] __attribute__((aligned(64)));       /* x as f32 for one chunk of 64 inputs */
#pragma GCC unroll 6
    for (int m = 0; m < MR; m++)
#pragma GCC unroll 4
        for (int b = 0; b < NB; b++) acc[m][b] = _mm512_setzero_ps();
    for (int kc = 0; kc < Kp; kc += 64) {
#pragma GCC unroll 6
        for (int m = 0; m < MR; m++)
#pragma GCC unroll 4
            for (int i = 0; i < 4; i++) {
                const __m256i h = _mm256_loadu_si256((const __m256i *)(xr + (int64_t)m * Kp + kc + i * 16));
                _mm512_store_ps(xf[m] + i * 16, _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16)));
            }
#pragma GCC unroll 2
        for (int p = 0; p < 32; p++) {
            __m512 we[4], wo[4];
#pragma GCC unroll 4
            for (int b = 0; b < NB; b++) {
                const uint16_t *q = wb + b * bs + (int64_t)(kc + 2 * p) * 16;
                const __m512i v = _mm512_loadu_si512((const void *)q);
                if (PF_BYTES) _mm_prefetch((const char *)q + PF_BYTES, PF_HINT);
                we[b] = _mm512_castsi512_ps(_mm512_slli_epi32(v, 16));
                wo[b] = _mm512_castsi512_ps(_mm512_and_si512(v, hi));
            }
#pragma GCC unroll 6
            for (int m = 0; m < MR; m++) {
                const __m512 xe = _mm512_set1_ps(xf[m][2 * p]), xo = _mm512_set1_ps(xf[m][2 * p + 1]);
#pragma GCC unroll 4
                for (int b = 0; b < NB; b++)
                    acc[m][b] = _mm512_fmadd_ps(wo[b], xo, _mm512_fmadd_ps(we[b], xe, acc[m][b]));
            }
        }
    }
#pragma GCC unroll 6
    for (int m = 0; m < MR; m++)
#pragma GCC unroll 4
        for (int b = 0; b < NB; b++) _mm512_storeu_ps(y + m * ldy + b * 16, acc[m][b]);
}

static void micro_bf16_plain(const ktk_mat *w, const ktk_act *x, int b0, int t0, float *y, int64_t ldy, int mr,
                             int nb) {
#define BODY(M, B) mk_bf16_plain(w, x, b0, t0, y, ldy, M, B)
    KTK512_CASES(BODY)
#undef BODY
}

void ktk_avx512_gemm_bf16_plain(const ktk_mat *w, int nb0, int nb1, const ktk_act *x, float *y, int64_t ldy) {
    ktk_drive(micro_bf16_plain, 6, 4, 18, w, nb0, nb1, x, y, ldy);
}

/* (w0,w1,w2,w3) bytes per int32 lane -> int16 pairs (w0,w2) and (w1,w3) */
KTK_AI __m512i even_i16(__m512i v) { return _mm512_srai_epi16(_mm512_slli_epi16(v, 8), 8); }
KTK_AI __m512i odd_i16(__m512i v) { return _mm512_srai_epi16(v, 8); }

KTK_AI void mk_int8_plain(const ktk_mat *w, const ktk_act *x, int b0, int t0, float *y, int64_t ldy,
                          const int MR, const int NB) {
    const int Kp = w->Kp;
    const int64_t bs = (int64_t)Kp * 16;
    const int8_t *wb = w->data_i8 + (int64_t)b0 * bs;
    const int8_t *xr = x->x_i8 + (int64_t)t0 * Kp;
    __m512i acc[6][4];
    int32_t xe[6][16] __attribute__((aligned(64))), xo[6][16] __attribute__((aligned(64)));
#pragma GCC unroll 6
    for (int m = 0; m < MR; m++)
#pragma GCC unroll 4
        for (int b = 0; b < NB; b++) acc[m][b] = _mm512_setzero_si512();
    for (int kc = 0; kc < Kp; kc += 64) {
#pragma GCC unroll 6
        for (int m = 0; m < MR; m++) {
            const __m512i v = _mm512_loadu_si512((const void *)(xr + (int64_t)m * Kp + kc));
            _mm512_store_si512((void *)xe[m], even_i16(v));
            _mm512_store_si512((void *)xo[m], odd_i16(v));
        }
#pragma GCC unroll 2
        for (int g = 0; g < 16; g++) {
            __m512i we[4], wo[4];
#pragma GCC unroll 4
            for (int b = 0; b < NB; b++) {
                const int8_t *q = wb + b * bs + (int64_t)kc * 16 + g * 64;
                const __m512i v = _mm512_loadu_si512((const void *)q);
                if (PF_BYTES) _mm_prefetch((const char *)q + PF_BYTES, PF_HINT);
                we[b] = even_i16(v);
                wo[b] = odd_i16(v);
            }
#pragma GCC unroll 6
            for (int m = 0; m < MR; m++) {
                const __m512i e = _mm512_set1_epi32(xe[m][g]), o = _mm512_set1_epi32(xo[m][g]);
#pragma GCC unroll 4
                for (int b = 0; b < NB; b++)
                    acc[m][b] = _mm512_add_epi32(acc[m][b], _mm512_add_epi32(_mm512_madd_epi16(we[b], e),
                                                                             _mm512_madd_epi16(wo[b], o)));
            }
        }
    }
#pragma GCC unroll 4
    for (int b = 0; b < NB; b++) {
        const __m512 sc = _mm512_loadu_ps(w->scale + (b0 + b) * 16);
#pragma GCC unroll 6
        for (int m = 0; m < MR; m++) {
            const __m512 f = _mm512_cvtepi32_ps(acc[m][b]);
            _mm512_storeu_ps(y + m * ldy + b * 16,
                             _mm512_mul_ps(_mm512_mul_ps(f, _mm512_set1_ps(x->x_scale[t0 + m])), sc));
        }
    }
}

static void micro_int8_plain(const ktk_mat *w, const ktk_act *x, int b0, int t0, float *y, int64_t ldy, int mr,
                             int nb) {
#define BODY(M, B) mk_int8_plain(w, x, b0, t0, y, ldy, M, B)
    KTK512_CASES(BODY)
#undef BODY
}

static void gemm_int8_plain(const ktk_mat *w, int nb0, int nb1, const ktk_act *x, float *y, int64_t ldy) {
    ktk_drive(micro_int8_plain, 6, 4, 18, w, nb0, nb1, x, y, ldy);
}
#pragma GCC pop_options

/* ======================= table ======================= */
/* int4: int4.c */
void ktk_avx512_gemm_int4_plain(const ktk_mat *w, int nb0, int nb1, const ktk_act *x, float *y, int64_t ldy);
void ktk_avx512_gemm_int4_vnni(const ktk_mat *w, int nb0, int nb1, const ktk_act *x, float *y, int64_t ldy);

/* decode kernels: gemv.c */
#include "gemv.h"

/* fp8: fp8.c (FMA kernels), fp8_bf16.c (vdpbf16ps: the bf16 variants); the dequantizing path runs the variant's bf16
 * kernel */
#include "fp8.h"

/* mxfp4: mxfp4.c (FMA direct kernel, its gemv, dequantization to bf16; the dequantizing path runs the table's bf16
 * kernel) */
void ktk_avx512_gemm_mxfp4(const ktk_mat *w, int nb0, int nb1, const ktk_act *x, float *y, int64_t ldy);
void ktk_avx512_gemv_mxfp4(int M, const ktk_mat *const *w, int nb0, int nb1, const ktk_act *const *x,
                           float *const *y);
#define MXFP4_ENTRIES .gemm_mxfp4 = ktk_avx512_gemm_mxfp4, .gemv_mxfp4 = ktk_avx512_gemv_mxfp4

static const ktk_kernels table_plain = {.name = "avx512", .gemm_bf16 = ktk_avx512_gemm_bf16_plain,
                                        .gemm_int8 = gemm_int8_plain, .gemm_int4 = ktk_avx512_gemm_int4_plain,
                                        .gemv_bf16 = ktk_avx512_gemv_bf16_plain, .gemm_fp8 = ktk_avx512_gemm_fp8,
                                        .gemv_fp8 = ktk_avx512_gemv_fp8, MXFP4_ENTRIES};
static const ktk_kernels table_bf16 = {.name = "avx512+bf16", .gemm_bf16 = ktk_avx512_gemm_bf16_dp,
                                       .gemm_int8 = gemm_int8_plain, .gemm_int4 = ktk_avx512_gemm_int4_plain,
                                       .gemv_bf16 = ktk_avx512_gemv_bf16_dp, .gemm_fp8 = ktk_avx512_gemm_fp8_dp,
                                       .gemv_fp8 = ktk_avx512_gemv_fp8_dp, MXFP4_ENTRIES};
static const ktk_kernels table_vnni = {.name = "avx512+vnni", .gemm_bf16 = ktk_avx512_gemm_bf16_plain,
                                       .gemm_int8 = ktk_avx512_gemm_int8_vnni, .gemm_int4 = ktk_avx512_gemm_int4_vnni,
                                       .gemv_bf16 = ktk_avx512_gemv_bf16_plain, .gemv_int8 = ktk_avx512_gemv_int8_vnni,
                                       .gemv_int4 = ktk_avx512_gemv_int4_vnni, .gemm_fp8 = ktk_avx512_gemm_fp8,
                                       .gemv_fp8 = ktk_avx512_gemv_fp8, MXFP4_ENTRIES};
static const ktk_kernels table_both = {.name = "avx512+bf16+vnni", .gemm_bf16 = ktk_avx512_gemm_bf16_dp,
                                       .gemm_int8 = ktk_avx512_gemm_int8_vnni, .gemm_int4 = ktk_avx512_gemm_int4_vnni,
                                       .gemv_bf16 = ktk_avx512_gemv_bf16_dp, .gemv_int8 = ktk_avx512_gemv_int8_vnni,
                                       .gemv_int4 = ktk_avx512_gemv_int4_vnni, .gemm_fp8 = ktk_avx512_gemm_fp8_dp,
                                       .gemv_fp8 = ktk_avx512_gemv_fp8_dp, MXFP4_ENTRIES};

/* CPUID bits, read once: 1 = use vdpbf16ps, 2 = AVX512_VNNI (leaf 7: ECX bit 11; sub-leaf 1: EAX bit 5 =
 * AVX512_BF16; EDX bit 22 = AMX-BF16). vdpbf16ps is used only on CPUs without AMX: on the AMX Xeons it ran
 * slower than the shift + FMA kernel, while on AMD's AVX-512 cores it is faster than FMA (docs/performance.md).
 * The cache is an idempotent int (every thread computes the same value), so racing first calls are harmless. */
static int cpu_bits(void) {
    static volatile int cached = -1;
    int v = cached;
    if (v >= 0) return v;
    unsigned a, b, c, d;
    v = 0;
    if (__get_cpuid_count(7, 0, &a, &b, &c, &d)) {
        const int amx_bf16 = (d >> 22) & 1;
        if ((c >> 11) & 1) v |= 2;
        if (a >= 1 && __get_cpuid_count(7, 1, &a, &b, &c, &d) && ((a >> 5) & 1) && !amx_bf16) v |= 1;
    }
    cached = v;
    return v;
}

/* The variant for this CPU; KTINJECT_AVX512_PLAIN=1 (read at each call) forces the plain F/BW kernels (tests). */
const ktk_kernels *ktk_kernels_avx512(void) {
    int v = cpu_bits();
    const char *env = getenv("KTINJECT_AVX512_PLAIN");
    if (env && env[0] && env[0] != '0') v = 0;
    static const ktk_kernels *const tables[4] = {&table_plain, &table_bf16, &table_vnni, &table_both};
    return tables[v];
}
