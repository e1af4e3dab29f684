/* AVX-512 int4 (W4A8) kernels: the direct int4 x int8 kernel and the dequantization to bf16.
 *
 *   direct "vnni":  per 64-byte row of a block (16 outputs x 8 inputs as nibbles): two ternary-logic ops give
 *                   the two quads as u8 q + 8, vpdpbusd with broadcast s8 x quads; per group: - 8 * sum(x),
 *                   int32 -> float, fma with the group's 16 scales (int4_micro.h)
 *   direct plain:   the same with vpmaddubsw + vpmaddwd (AVX-512 BW, no VNNI): no saturation, since
 *                   |(q + 8) x0 + (q' + 8) x1| <= 2 * 15 * 127 and two of them add up to < 2^15
 *   dequant:        nibbles -> int32 by shifts, * scale, round to bf16 (nearest even; vcvtne2ps2bf16 where the CPU
 *                   has AVX512_BF16), pairs interleaved into the bf16 layout: the generic dequantization's bits
 * The table functions take the dequantizing path (ktk_int4_dequant_gemm with this table's gemm_bf16) from
 * KTK_AVX512_INT4_DEQUANT_ROWS rows (or when forced), else the direct kernel.
 * Layouts: see ../kernels.h. Called concurrently: no mutable globals, no allocation.
 */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <cpuid.h>
#include <immintrin.h>
#include "../kernels.h"
#include "drive.h"

/* Rows from which the dequantizing path (+ AVX-512 bf16 kernel) runs on a CPU without AMX. 0: never. vpdpbusd does
 * 64 multiply-adds per instruction against 32 for vdpbf16ps, and the dequantization is not free: the direct kernel
 * was faster at every row count measured (native/tests/test_kernels.c bench, TK_QUANT=int4; docs/performance.md). */
#define KTK_AVX512_INT4_DEQUANT_ROWS 0

#ifndef PF_SCALE_GROUPS
#define PF_SCALE_GROUPS 4   /* software prefetch distance of the scales, in groups (one 64-byte line each) */
#endif

/* (mr, nb) pairs the int4 drive produces: mrmax 4, accmax 8 (f and acc registers: 2 * MR * NB + 2 * NB <= 28) */
#define KTK512_INT4_CASES(BODY)                                                                                     \
    switch (mr * 8 + nb) {                                                                                         \
    case 8 + 1: BODY(1, 1); break; case 8 + 2: BODY(1, 2); break; case 8 + 3: BODY(1, 3); break;                   \
    case 8 + 4: BODY(1, 4); break; case 16 + 1: BODY(2, 1); break; case 16 + 2: BODY(2, 2); break;                 \
    case 16 + 3: BODY(2, 3); break; case 16 + 4: BODY(2, 4); break; case 24 + 1: BODY(3, 1); break;                \
    case 24 + 2: BODY(3, 2); break; case 32 + 1: BODY(4, 1); break; case 32 + 2: BODY(4, 2); break;                \
    default: abort();                                                                                              \
    }

const ktk_kernels *ktk_kernels_avx512(void);
void ktk_avx512_dequant_int4(const ktk_mat *w, int nb0, int nb1, uint16_t *dst);

#pragma GCC push_options
#pragma GCC target("avx512f,avx512bw,avx512vl")
/* ======================= direct, plain AVX-512 BW ======================= */
#define MK_INT4 mk_int4_plain
#define DP2(acc, lo, xl, hi, xh)                                                                                    \
    _mm512_add_epi32(acc, _mm512_madd_epi16(_mm512_add_epi16(_mm512_maddubs_epi16(lo, xl),                         \
                                                             _mm512_maddubs_epi16(hi, xh)),                        \
                                            _mm512_set1_epi16(1)))
#include "int4_micro.h"
#undef MK_INT4
#undef DP2

static void micro_int4_plain(const ktk_mat *w, const ktk_act *x, int b0, int t0, float *y, int64_t ldy, int mr,
                             int nb) {
#define BODY(M, B) mk_int4_plain(w, x, b0, t0, y, ldy, M, B)
    KTK512_INT4_CASES(BODY)
#undef BODY
}

void ktk_avx512_gemm_int4_plain_direct(const ktk_mat *w, int nb0, int nb1, const ktk_act *x, float *y, int64_t ldy) {
    ktk_drive(micro_int4_plain, 4, 4, 8, w, nb0, nb1, x, y, ldy);
}

/* ======================= dequantization to bf16 ======================= */
/* bf16 bits of f in the high half of each int32 lane, round to nearest even (ktk_f32_to_bf16 for non-NaN; a NaN
 * product of a NaN scale stays a NaN) */
KTK_AI __m512i bf16_hi(__m512 f) {
    const __m512i u = _mm512_castps_si512(f);
    const __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(1));
    return _mm512_add_epi32(u, _mm512_add_epi32(lsb, _mm512_set1_epi32(0x7fff)));
}

/* q at nibble position pos (0..7, from bit 0) of each int32 lane, sign-extended */
#define NIB(v, pos) _mm512_srai_epi32(_mm512_slli_epi32(v, 28 - 4 * (pos)), 28)

void ktk_avx512_dequant_int4_plain(const ktk_mat *w, int nb0, int nb1, uint16_t *dst) {   /* tests */
    const int Kp = w->Kp, G = w->group, ng = Kp / G;
    const __m512i himask = _mm512_set1_epi32((int)0xffff0000u);
    for (int b = nb0; b < nb1; b++) {
        const uint8_t *src = w->data_i4 + (int64_t)b * Kp * 8;
        uint16_t *out = dst + (int64_t)(b - nb0) * 16 * Kp;
        for (int r = 0; r < Kp / 8; r++) {                /* inputs 8r..8r+7 -> 4 pair rows of 64 bytes */
            const __m512i v = _mm512_loadu_si512((const void *)(src + (int64_t)r * 64));
            const __m512 sc = _mm512_loadu_ps(w->scale + ((int64_t)b * ng + r * 8 / G) * 16);
#pragma GCC unroll 4
            for (int p = 0; p < 4; p++) {                 /* pair p: inputs 8r + 2p, 8r + 2p + 1 */
                const int k0 = 2 * p, k1 = 2 * p + 1;     /* input k: byte k % 4, nibble k / 4 */
                const __m512i q0 = NIB(v, (k0 % 4) * 2 + k0 / 4), q1 = NIB(v, (k1 % 4) * 2 + k1 / 4);
                const __m512i e = bf16_hi(_mm512_mul_ps(_mm512_cvtepi32_ps(q0), sc));
                const __m512i o = bf16_hi(_mm512_mul_ps(_mm512_cvtepi32_ps(q1), sc));
                const __m512i row = _mm512_or_si512(_mm512_srli_epi32(e, 16), _mm512_and_si512(o, himask));
                _mm512_storeu_si512((void *)(out + ((int64_t)r * 4 + p) * 32), row);
            }
        }
    }
}

static void gemm_int4_plain(const ktk_mat *w, int nb0, int nb1, const ktk_act *x, float *y, int64_t ldy) {
    if (ktk_int4_dequant(w, x, KTK_AVX512_INT4_DEQUANT_ROWS))
        ktk_int4_dequant_gemm(w, nb0, nb1, x, y, ldy, ktk_avx512_dequant_int4, ktk_kernels_avx512()->gemm_bf16);
    else
        ktk_avx512_gemm_int4_plain_direct(w, nb0, nb1, x, y, ldy);
}
#pragma GCC pop_options

/* ======================= dequantization with AVX512_BF16 ======================= */
#pragma GCC push_options
#pragma GCC target("avx512f,avx512bw,avx512vl,avx512bf16")
/* as ktk_avx512_dequant_int4_plain, the rounding and interleaving by vcvtne2ps2bf16 + one permute (about half the
 * instructions); vcvtne2ps2bf16 flushes denormal products (|q * scale| < 2^-126) to zero, the only difference */
static void dequant_int4_bf16(const ktk_mat *w, int nb0, int nb1, uint16_t *dst) {
    const int Kp = w->Kp, G = w->group, ng = Kp / G;
    const __m512i inter = _mm512_set_epi16(31, 15, 30, 14, 29, 13, 28, 12, 27, 11, 26, 10, 25, 9, 24, 8, 23, 7, 22, 6,
                                           21, 5, 20, 4, 19, 3, 18, 2, 17, 1, 16, 0);   /* e0 o0 e1 o1 ... */
    for (int b = nb0; b < nb1; b++) {
        const uint8_t *src = w->data_i4 + (int64_t)b * Kp * 8;
        uint16_t *out = dst + (int64_t)(b - nb0) * 16 * Kp;
        for (int r = 0; r < Kp / 8; r++) {
            const __m512i v = _mm512_loadu_si512((const void *)(src + (int64_t)r * 64));
            const __m512 sc = _mm512_loadu_ps(w->scale + ((int64_t)b * ng + r * 8 / G) * 16);
#pragma GCC unroll 4
            for (int p = 0; p < 4; p++) {
                const int k0 = 2 * p, k1 = 2 * p + 1;
                const __m512 e = _mm512_mul_ps(_mm512_cvtepi32_ps(NIB(v, (k0 % 4) * 2 + k0 / 4)), sc);
                const __m512 o = _mm512_mul_ps(_mm512_cvtepi32_ps(NIB(v, (k1 % 4) * 2 + k1 / 4)), sc);
                const __m512i eo = (__m512i)_mm512_cvtne2ps_pbh(o, e);   /* bf16(e) in the low half, bf16(o) high */
                _mm512_storeu_si512((void *)(out + ((int64_t)r * 4 + p) * 32), _mm512_permutexvar_epi16(inter, eo));
            }
        }
    }
}
#pragma GCC pop_options
#undef NIB

/* AVX512_BF16 (CPUID leaf 7 sub-leaf 1, EAX bit 5), read once (an idempotent cache: racing first calls agree) */
static int has_bf16(void) {
    static volatile int cached = -1;
    int v = cached;
    if (v < 0) {
        unsigned a, b, c, d;
        v = __get_cpuid_count(7, 0, &a, &b, &c, &d) && a >= 1 && __get_cpuid_count(7, 1, &a, &b, &c, &d) &&
            ((a >> 5) & 1);
        cached = v;
    }
    return v;
}

void ktk_avx512_dequant_int4(const ktk_mat *w, int nb0, int nb1, uint16_t *dst) {
    if (has_bf16()) dequant_int4_bf16(w, nb0, nb1, dst);
    else ktk_avx512_dequant_int4_plain(w, nb0, nb1, dst);
}

/* ======================= direct, AVX512_VNNI ======================= */
#pragma GCC push_options
#pragma GCC target("avx512f,avx512bw,avx512vl,avx512vnni")
#define MK_INT4 mk_int4_vnni
#define DP2(acc, lo, xl, hi, xh) _mm512_dpbusd_epi32(_mm512_dpbusd_epi32(acc, lo, xl), hi, xh)
#include "int4_micro.h"
#undef MK_INT4
#undef DP2

static void micro_int4_vnni(const ktk_mat *w, const ktk_act *x, int b0, int t0, float *y, int64_t ldy, int mr,
                            int nb) {
#define BODY(M, B) mk_int4_vnni(w, x, b0, t0, y, ldy, M, B)
    KTK512_INT4_CASES(BODY)
#undef BODY
}

void ktk_avx512_gemm_int4_vnni_direct(const ktk_mat *w, int nb0, int nb1, const ktk_act *x, float *y, int64_t ldy) {
    ktk_drive(micro_int4_vnni, 4, 4, 8, w, nb0, nb1, x, y, ldy);
}
#pragma GCC pop_options

/* ======================= table entries ======================= */
void ktk_avx512_gemm_int4_plain(const ktk_mat *w, int nb0, int nb1, const ktk_act *x, float *y, int64_t ldy) {
    gemm_int4_plain(w, nb0, nb1, x, y, ldy);
}

void ktk_avx512_gemm_int4_vnni(const ktk_mat *w, int nb0, int nb1, const ktk_act *x, float *y, int64_t ldy) {
    if (ktk_int4_dequant(w, x, KTK_AVX512_INT4_DEQUANT_ROWS))
        ktk_int4_dequant_gemm(w, nb0, nb1, x, y, ldy, ktk_avx512_dequant_int4, ktk_kernels_avx512()->gemm_bf16);
    else
        ktk_avx512_gemm_int4_vnni_direct(w, nb0, nb1, x, y, ldy);
}
