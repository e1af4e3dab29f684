/* AVX2 (+FMA, F16C) kernels of the routed experts' backward and of training's expert products (ktk_bwd_kernels,
 * ../kernels.h), run by moe/backward.c, moe/project.c and moe/lora.c; their generic steps are the reference.
 *
 *   unpack:  one 16-row block of a stored matrix to float, a 16 x 16 tile at a time: bf16 by shift / mask, int8 and
 *            int4 by shifts to the signed value, int to float, * the row's or group's scale, 8 rows a vector; fp8
 *            through float16 (vcvtph2ps, as the AVX-512 kernels) * the block's scale; stored column-major (16 rows
 *            a column) and row-major. Values: the generic dequantization's bit for bit.
 *   gate_up: g = W x for up to 3 rows at once from the column-major block (16 outputs: two vectors of 8), the
 *            inputs broadcast from the float rows, c ascending.
 *   tprod:   out += W^T d from the row-major block: up to 4 rows x 2 vectors of 8 outputs in registers, j ascending
 *            (W1's j then W2's j per step), the last partial vectors masked.
 *   mdot, maxpy, ger: the expert LoRA loops, 8 columns at a time against up to 4 rows of M at once.
 *   bf16 products' entries: the conversions of convert.c, fp8's dequantization of fp8.c (int8, int4: unpack +
 *            bf16_pairs; mxfp4: the generic dequantization).
 * No few-rows path (few_rows 0). Every row's arithmetic is the same whatever rows it is grouped with: results depend
 * on neither the row count of a call nor the threads. Called concurrently: no mutable globals, no allocation.
 */
#include <stdint.h>
#include <immintrin.h>
#include "../../../include/ktinject.h"
#include "../kernels.h"

const ktk_bwd_kernels *ktk_bwd_kernels_avx2(void);
void ktk_avx2_dequant_fp8(const ktk_mat *w, int nb0, int nb1, uint16_t *dst);   /* fp8.c */

#pragma GCC push_options
#pragma GCC target("avx2,fma,f16c")

#ifndef KTK_AI
#define KTK_AI static inline __attribute__((always_inline))
#endif

/* lanes < n (n <= 8) all ones: the mask of a partial vector */
KTK_AI __m256i lanes(int n) {
    const __m256i idx = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
    return _mm256_cmpgt_epi32(_mm256_set1_epi32(n), idx);
}

/* ---- unpack ---- */
KTK_AI __m256 i2f(__m256i v, __m256 s) { return _mm256_mul_ps(_mm256_cvtepi32_ps(v), s); }

/* z[c][j] = W[16b + j][16t + c] as float, for c, j < 16 */
static void tile(const ktk_mat *w, int b, int t, float z[16][16]) {
    switch (w->quant) {
    case KTK_QUANT_BF16: {
        const uint16_t *p = w->data_bf16 + ((int64_t)b * (w->Kp / 2) + (int64_t)t * 8) * 32;
        const __m256i hi = _mm256_set1_epi32((int)0xffff0000u);
        for (int r = 0; r < 8; r++)
            for (int h = 0; h < 2; h++) {   /* rows 8h .. 8h + 7: one 32-bit lane each, columns 2r and 2r + 1 */
                const __m256i v = _mm256_loadu_si256((const __m256i *)(p + r * 32 + h * 16));
                _mm256_storeu_ps(z[2 * r] + 8 * h, _mm256_castsi256_ps(_mm256_slli_epi32(v, 16)));
                _mm256_storeu_ps(z[2 * r + 1] + 8 * h, _mm256_castsi256_ps(_mm256_and_si256(v, hi)));
            }
        break;
    }
    case KTK_QUANT_INT8: {
        const int8_t *p = w->data_i8 + ((int64_t)b * (w->Kp / 4) + (int64_t)t * 4) * 64;
        for (int h = 0; h < 2; h++) {
            const __m256 s = _mm256_loadu_ps(w->scale + (int64_t)b * 16 + 8 * h);
            for (int r = 0; r < 4; r++) {   /* columns 4r .. 4r + 3: the bytes of each row's lane */
                const __m256i v = _mm256_loadu_si256((const __m256i *)(p + r * 64 + h * 32));
                for (int k = 0; k < 4; k++) {
                    const __m256i q = _mm256_srai_epi32(_mm256_sllv_epi32(v, _mm256_set1_epi32(24 - 8 * k)), 24);
                    _mm256_storeu_ps(z[4 * r + k] + 8 * h, i2f(q, s));
                }
            }
        }
        break;
    }
    case KTK_QUANT_INT4: {
        const uint8_t *p = w->data_i4 + ((int64_t)b * (w->Kp / 8) + (int64_t)t * 2) * 64;
        const int ng = w->Kp / w->group;
        static const int shift[8] = {28, 20, 12, 4, 24, 16, 8, 0};   /* column 8r + k: its nibble to the top */
        for (int h = 0; h < 2; h++) {
            const __m256 s = _mm256_loadu_ps(w->scale + ((int64_t)b * ng + t * 16 / w->group) * 16 + 8 * h);
            for (int r = 0; r < 2; r++) {
                const __m256i v = _mm256_loadu_si256((const __m256i *)(p + r * 64 + h * 32));
                for (int k = 0; k < 8; k++) {
                    const __m256i q = _mm256_srai_epi32(_mm256_sllv_epi32(v, _mm256_set1_epi32(shift[k])), 28);
                    _mm256_storeu_ps(z[8 * r + k] + 8 * h, i2f(q, s));
                }
            }
        }
        break;
    }
    default: {   /* KTK_QUANT_FP8 (the callers run the generic step for any other format) */
        /* e4m3 byte, sign-extended to 16 bits, << 7, & 0xbf80: the float16 bits of e4m3 * 2^-8 (exact, subnormals
         * included), * 2^8, * the scale; exponent and mantissa all ones: NaN (as avx512/backward.c) */
        const uint8_t *p = w->data_f8 + ((int64_t)b * w->Kp + (int64_t)t * 16) * 16;
        const __m256 s = _mm256_set1_ps(w->scale[(int64_t)b * ktk_fp8_groups(w) + t * 16 / w->group]);
        const __m256 up = _mm256_set1_ps(256.0f), nan = _mm256_set1_ps(__builtin_nanf(""));
        const __m128i keep = _mm_set1_epi16((short)0xbf80), em = _mm_set1_epi16(0x3f80);
        for (int c = 0; c < 16; c++)
            for (int h = 0; h < 2; h++) {
                const __m128i v = _mm_cvtepi8_epi16(_mm_loadl_epi64((const __m128i *)(p + c * 16 + 8 * h)));
                const __m128i f16 = _mm_and_si128(_mm_slli_epi16(v, 7), keep);
                const __m256 isnan = _mm256_castsi256_ps(_mm256_cvtepi16_epi32(
                    _mm_cmpeq_epi16(_mm_and_si128(f16, em), em)));
                const __m256 f = _mm256_mul_ps(_mm256_mul_ps(_mm256_cvtph_ps(f16), up), s);
                _mm256_storeu_ps(z[c] + 8 * h, _mm256_blendv_ps(f, nan, isnan));
            }
        break;
    }
    }
}

static void unpack(const ktk_mat *w, int b, float *wt, float *wr, int64_t ldr) {
    const int tiles = (w->K + 15) / 16;
    float z[16][16];
    for (int t = 0; t < tiles; t++) {
        tile(w, b, t, z);
        if (wt)
            for (int c = 0; c < 16; c++) {
                _mm256_storeu_ps(wt + ((int64_t)t * 16 + c) * 16, _mm256_loadu_ps(z[c]));
                _mm256_storeu_ps(wt + ((int64_t)t * 16 + c) * 16 + 8, _mm256_loadu_ps(z[c] + 8));
            }
        if (wr)
            for (int j = 0; j < 16; j++)
                for (int c = 0; c < 16; c++) wr[(int64_t)j * ldr + (int64_t)t * 16 + c] = z[c][j];
    }
}

/* ---- g, u = W x ---- */
KTK_AI void gate_up_mr(const float *wtg, const float *wtu, int Kt, const float *x, int64_t ldx, float *g, float *u,
                      const int MR) {
    __m256 acc[3][4];   /* per row: g outputs 0-7, 8-15, u outputs 0-7, 8-15 */
#pragma GCC unroll 3
    for (int m = 0; m < MR; m++)
#pragma GCC unroll 4
        for (int q = 0; q < 4; q++) acc[m][q] = _mm256_setzero_ps();
    for (int c = 0; c < Kt; c++) {
        const float *pg = wtg + (int64_t)c * 16, *pu = wtu + (int64_t)c * 16;
        const __m256 g0 = _mm256_loadu_ps(pg), g1 = _mm256_loadu_ps(pg + 8);
        const __m256 u0 = _mm256_loadu_ps(pu), u1 = _mm256_loadu_ps(pu + 8);
#pragma GCC unroll 3
        for (int m = 0; m < MR; m++) {
            const __m256 xv = _mm256_set1_ps(x[m * ldx + c]);
            acc[m][0] = _mm256_fmadd_ps(xv, g0, acc[m][0]);
            acc[m][1] = _mm256_fmadd_ps(xv, g1, acc[m][1]);
            acc[m][2] = _mm256_fmadd_ps(xv, u0, acc[m][2]);
            acc[m][3] = _mm256_fmadd_ps(xv, u1, acc[m][3]);
        }
    }
#pragma GCC unroll 3
    for (int m = 0; m < MR; m++) {
        _mm256_storeu_ps(g + m * 16, acc[m][0]);
        _mm256_storeu_ps(g + m * 16 + 8, acc[m][1]);
        _mm256_storeu_ps(u + m * 16, acc[m][2]);
        _mm256_storeu_ps(u + m * 16 + 8, acc[m][3]);
    }
}

static void gate_up(const float *wtg, const float *wtu, int Kt, const float *x, int64_t ldx, int n, float *g,
                    float *u) {
    for (int i = 0; i < n; i += 3) {
        const float *xi = x + i * ldx;
        switch (n - i < 3 ? n - i : 3) {
        case 1: gate_up_mr(wtg, wtu, Kt, xi, ldx, g + i * 16, u + i * 16, 1); break;
        case 2: gate_up_mr(wtg, wtu, Kt, xi, ldx, g + i * 16, u + i * 16, 2); break;
        default: gate_up_mr(wtg, wtu, Kt, xi, ldx, g + i * 16, u + i * 16, 3); break;
        }
    }
}

/* ---- out += W^T d ---- */
/* MR rows x 2 vectors of 8 outputs from c0 (lanes below `valid` of the 16 written); W1 (and W2 when TWO) rows ldw
 * apart */
KTK_AI void tprod_mr(const float *w1, const float *d1, const float *w2, const float *d2, int64_t ldd, int64_t ldw,
                    int c0, int valid, float *out, int64_t ldo, const int MR, const int TWO) {
    const __m256i m0 = lanes(valid), m1 = lanes(valid - 8);
    __m256 acc[4][2];
#pragma GCC unroll 4
    for (int m = 0; m < MR; m++) {
        acc[m][0] = _mm256_maskload_ps(out + m * ldo + c0, m0);
        acc[m][1] = _mm256_maskload_ps(out + m * ldo + c0 + 8, m1);
    }
    for (int j = 0; j < 16; j++) {
        const __m256 a0 = _mm256_maskload_ps(w1 + j * ldw + c0, m0), a1 = _mm256_maskload_ps(w1 + j * ldw + c0 + 8, m1);
#pragma GCC unroll 4
        for (int m = 0; m < MR; m++) {
            const __m256 dv = _mm256_set1_ps(d1[m * ldd + j]);
            acc[m][0] = _mm256_fmadd_ps(dv, a0, acc[m][0]);
            acc[m][1] = _mm256_fmadd_ps(dv, a1, acc[m][1]);
        }
        if (!TWO) continue;
        const __m256 b0 = _mm256_maskload_ps(w2 + j * ldw + c0, m0), b1 = _mm256_maskload_ps(w2 + j * ldw + c0 + 8, m1);
#pragma GCC unroll 4
        for (int m = 0; m < MR; m++) {
            const __m256 dv = _mm256_set1_ps(d2[m * ldd + j]);
            acc[m][0] = _mm256_fmadd_ps(dv, b0, acc[m][0]);
            acc[m][1] = _mm256_fmadd_ps(dv, b1, acc[m][1]);
        }
    }
#pragma GCC unroll 4
    for (int m = 0; m < MR; m++) {
        _mm256_maskstore_ps(out + m * ldo + c0, m0, acc[m][0]);
        _mm256_maskstore_ps(out + m * ldo + c0 + 8, m1, acc[m][1]);
    }
}

KTK_AI void tprod_rows(const float *w1, const float *d1, const float *w2, const float *d2, int64_t ldd, int64_t ldw,
                      int K, float *out, int64_t ldo, const int MR, const int TWO) {
    for (int c = 0; c < K; c += 16) tprod_mr(w1, d1, w2, d2, ldd, ldw, c, K - c, out, ldo, MR, TWO);
}

#define TPROD_CASE(MR)                                                                                            \
    if (two) tprod_rows(w1, d1i, w2, d2i, ldd, ldw, K, oi, ldo, MR, 1);                                           \
    else tprod_rows(w1, d1i, w2, d2i, ldd, ldw, K, oi, ldo, MR, 0);                                               \
    break

static void tprod(const float *w1, const float *d1, const float *w2, const float *d2, int64_t ldd, int64_t ldw,
                  int K, int n, float *out, int64_t ldo) {
    const int two = w2 != NULL;
    for (int i = 0; i < n; i += 4) {
        const float *d1i = d1 + i * ldd, *d2i = two ? d2 + i * ldd : NULL;
        float *oi = out + i * ldo;
        switch (n - i < 4 ? n - i : 4) {
        case 1: TPROD_CASE(1);
        case 2: TPROD_CASE(2);
        case 3: TPROD_CASE(3);
        default: TPROD_CASE(4);
        }
    }
}

/* ---- the expert LoRA loops ---- */
KTK_AI float hadd(__m256 v) {
    const __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    const __m128 t = _mm_add_ps(s, _mm_movehl_ps(s, s));
    return _mm_cvtss_f32(_mm_add_ss(t, _mm_shuffle_ps(t, t, 1)));
}

static void mdot(const float *M, int64_t ldm, int rk, const float *x, int n, float *t) {
    for (int j0 = 0; j0 < rk; j0 += 4) {
        const int nj = rk - j0 < 4 ? rk - j0 : 4;
        __m256 acc[4];
        for (int j = 0; j < 4; j++) acc[j] = _mm256_setzero_ps();
        for (int i = 0; i < n; i += 8) {
            const __m256i m = lanes(n - i);
            const __m256 xv = _mm256_maskload_ps(x + i, m);
            for (int j = 0; j < nj; j++)
                acc[j] = _mm256_fmadd_ps(_mm256_maskload_ps(M + (int64_t)(j0 + j) * ldm + i, m), xv, acc[j]);
        }
        for (int j = 0; j < nj; j++) t[j0 + j] = hadd(acc[j]);
    }
}

static void maxpy(float *y, const float *M, int64_t ldm, int rk, const float *s, int n) {
    for (int i = 0; i < n; i += 8) {
        const __m256i m = lanes(n - i);
        __m256 acc = _mm256_maskload_ps(y + i, m);
        for (int j = 0; j < rk; j++)
            acc = _mm256_fmadd_ps(_mm256_set1_ps(s[j]), _mm256_maskload_ps(M + (int64_t)j * ldm + i, m), acc);
        _mm256_maskstore_ps(y + i, m, acc);
    }
}

static void ger(float *M, int64_t ldm, int rk, const float *s, const float *v, int n) {
    for (int i = 0; i < n; i += 8) {
        const __m256i m = lanes(n - i);
        const __m256 vv = _mm256_maskload_ps(v + i, m);
        for (int j = 0; j < rk; j++) {
            float *row = M + (int64_t)j * ldm + i;
            _mm256_maskstore_ps(row, m, _mm256_fmadd_ps(_mm256_set1_ps(s[j]), vv, _mm256_maskload_ps(row, m)));
        }
    }
}

#pragma GCC pop_options

const ktk_bwd_kernels *ktk_bwd_kernels_avx2(void) {
    static const ktk_bwd_kernels table = {.name = "avx2", .unpack = unpack, .gate_up = gate_up, .tprod = tprod,
                                          .few_rows = 0, .gate_up_packed = NULL, .tacc = NULL, .hsum = NULL,
                                          .mdot = mdot, .maxpy = maxpy, .ger = ger,
                                          .bf16_rows = ktk_avx2_bf16_rows, .bf16_pairs = ktk_avx2_bf16_pairs,
                                          .dequant_bf16 = {[KTK_QUANT_FP8] = ktk_avx2_dequant_fp8}};
    return &table;
}
