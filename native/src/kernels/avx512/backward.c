/* AVX-512 (F/BW/VL) kernels of the routed experts' backward (ktk_bwd_kernels, ../kernels.h), run by the rows step
 * of moe/backward.c; its generic step is their reference.
 *
 *   unpack:  one 16-row block of a stored matrix to float, in registers: a tile of 16 rows x 16 inputs becomes 16
 *            vectors of lanes = rows (bf16: the 64-byte pair rows by shift / mask; int8 and int4: shifts to the
 *            signed value, int to float, * the row's or group's scale; fp8: the byte placed as the float16 of value
 *            e4m3 * 2^-8 (exact, subnormals included; vcvtph2ps), * 2^8, * the block's scale, code 0x7f NaN), stored
 *            as the column-major tile (lanes = rows), then transposed in registers (16x16, 64 shuffles) and stored
 *            as the row-major tile (lanes = inputs). Values: the generic dequantization's bit for bit.
 *   gate_up: g = W x for up to 4 rows at once from the column-major block, every row's two sums (even and odd c)
 *            ascending in c, added at the end; the inputs broadcast from the float rows.
 *   tprod:   out += W^T d from the row-major block: up to 4 rows x 4 or 8 vectors of 16 outputs in registers,
 *            j ascending (W1's j then W2's j per step), the last partial vector masked.
 * Experts with at most few_rows rows in a chunk skip the float blocks (their dequantization and transposes cost more
 * than the rows' products): gate_up_packed as gate_up from the stored tiles; tacc: the transposed products summed per
 * lane (A[c] lane j += d[j] W[j][c], j ascending over blocks), hsum: A's 16 lanes added (after a transpose, lanes j
 * in ascending order) at the end of the chunk.
 * The bf16 products' entries: the AVX2 conversions (../avx2/convert.c), the dequantizations of int4.c, fp8.c, mxfp4.c.
 * Every row's arithmetic is the same whatever rows it is grouped with: results depend on neither the row count of
 * a call nor the threads. Called concurrently: no mutable globals, no allocation.
 */
#include <stdint.h>
#include <immintrin.h>
#include "../../../include/ktinject.h"
#include "../kernels.h"

const ktk_bwd_kernels *ktk_bwd_kernels_avx512(void);
/* the dequantizations to bf16 of int4.c, fp8.c, mxfp4.c (the bf16 products' weights) */
void ktk_avx512_dequant_int4(const ktk_mat *w, int nb0, int nb1, uint16_t *dst);
void ktk_avx512_dequant_fp8(const ktk_mat *w, int nb0, int nb1, uint16_t *dst);
void ktk_avx512_dequant_mxfp4(const ktk_mat *w, int nb0, int nb1, uint16_t *dst);

#pragma GCC push_options
#pragma GCC target("avx512f,avx512bw,avx512vl")

#ifndef KTK_AI
#define KTK_AI static inline __attribute__((always_inline))
#endif

/* 16x16 transpose: r[j] lane c -> r[c] lane j */
KTK_AI void transpose16(__m512 r[16]) {
    __m512 t[16];
#pragma GCC unroll 8
    for (int i = 0; i < 8; i++) {
        t[2 * i] = _mm512_unpacklo_ps(r[2 * i], r[2 * i + 1]);
        t[2 * i + 1] = _mm512_unpackhi_ps(r[2 * i], r[2 * i + 1]);
    }
#pragma GCC unroll 4
    for (int i = 0; i < 4; i++) {
        r[4 * i] = _mm512_shuffle_ps(t[4 * i], t[4 * i + 2], 0x44);
        r[4 * i + 1] = _mm512_shuffle_ps(t[4 * i], t[4 * i + 2], 0xee);
        r[4 * i + 2] = _mm512_shuffle_ps(t[4 * i + 1], t[4 * i + 3], 0x44);
        r[4 * i + 3] = _mm512_shuffle_ps(t[4 * i + 1], t[4 * i + 3], 0xee);
    }
#pragma GCC unroll 4
    for (int i = 0; i < 4; i++) {
        t[i] = _mm512_shuffle_f32x4(r[i], r[4 + i], 0x88);
        t[4 + i] = _mm512_shuffle_f32x4(r[i], r[4 + i], 0xdd);
        t[8 + i] = _mm512_shuffle_f32x4(r[8 + i], r[12 + i], 0x88);
        t[12 + i] = _mm512_shuffle_f32x4(r[8 + i], r[12 + i], 0xdd);
    }
#pragma GCC unroll 8
    for (int i = 0; i < 8; i++) {
        r[i] = _mm512_shuffle_f32x4(t[i], t[8 + i], 0x88);
        r[8 + i] = _mm512_shuffle_f32x4(t[i], t[8 + i], 0xdd);
    }
}

KTK_AI __m512 i2f(__m512i v, __m512 s) { return _mm512_mul_ps(_mm512_cvtepi32_ps(v), s); }

/* z[c] (lane j) = W[16b + j][16t + c] as float */
KTK_AI void tile_bf16(const ktk_mat *w, int b, int t, __m512 z[16]) {
    const uint16_t *p = w->data_bf16 + ((int64_t)b * (w->Kp / 2) + (int64_t)t * 8) * 32;
    const __m512i hi = _mm512_set1_epi32((int)0xffff0000u);
#pragma GCC unroll 8
    for (int r = 0; r < 8; r++) {
        const __m512i v = _mm512_loadu_si512((const void *)(p + r * 32));
        z[2 * r] = _mm512_castsi512_ps(_mm512_slli_epi32(v, 16));
        z[2 * r + 1] = _mm512_castsi512_ps(_mm512_and_si512(v, hi));
    }
}

KTK_AI void tile_int8(const ktk_mat *w, int b, int t, __m512 z[16]) {
    const int8_t *p = w->data_i8 + ((int64_t)b * (w->Kp / 4) + (int64_t)t * 4) * 64;
    const __m512 s = _mm512_loadu_ps(w->scale + (int64_t)b * 16);
#pragma GCC unroll 4
    for (int r = 0; r < 4; r++) {
        const __m512i v = _mm512_loadu_si512((const void *)(p + r * 64));
        z[4 * r] = i2f(_mm512_srai_epi32(_mm512_slli_epi32(v, 24), 24), s);
        z[4 * r + 1] = i2f(_mm512_srai_epi32(_mm512_slli_epi32(v, 16), 24), s);
        z[4 * r + 2] = i2f(_mm512_srai_epi32(_mm512_slli_epi32(v, 8), 24), s);
        z[4 * r + 3] = i2f(_mm512_srai_epi32(v, 24), s);
    }
}

KTK_AI void tile_int4(const ktk_mat *w, int b, int t, __m512 z[16]) {
    const uint8_t *p = w->data_i4 + ((int64_t)b * (w->Kp / 8) + (int64_t)t * 2) * 64;
    const int ng = w->Kp / w->group;
    const __m512 s = _mm512_loadu_ps(w->scale + ((int64_t)b * ng + t * 16 / w->group) * 16);
#pragma GCC unroll 2
    for (int r = 0; r < 2; r++) {
        const __m512i v = _mm512_loadu_si512((const void *)(p + r * 64));
        z[8 * r] = i2f(_mm512_srai_epi32(_mm512_slli_epi32(v, 28), 28), s);
        z[8 * r + 1] = i2f(_mm512_srai_epi32(_mm512_slli_epi32(v, 20), 28), s);
        z[8 * r + 2] = i2f(_mm512_srai_epi32(_mm512_slli_epi32(v, 12), 28), s);
        z[8 * r + 3] = i2f(_mm512_srai_epi32(_mm512_slli_epi32(v, 4), 28), s);
        z[8 * r + 4] = i2f(_mm512_srai_epi32(_mm512_slli_epi32(v, 24), 28), s);
        z[8 * r + 5] = i2f(_mm512_srai_epi32(_mm512_slli_epi32(v, 16), 28), s);
        z[8 * r + 6] = i2f(_mm512_srai_epi32(_mm512_slli_epi32(v, 8), 28), s);
        z[8 * r + 7] = i2f(_mm512_srai_epi32(v, 28), s);
    }
}

/* e4m3 byte, sign-extended to 16 bits, << 7, & 0xbf80: the float16 bits of e4m3 * 2^-8 (sign to bit 15, exponent
 * and mantissa to bits 13..7; e4m3 subnormals are float16 subnormals), exact; exponent and mantissa all ones: NaN */
KTK_AI void tile_fp8(const ktk_mat *w, int b, int t, __m512 z[16]) {
    const uint8_t *p = w->data_f8 + ((int64_t)b * w->Kp + (int64_t)t * 16) * 16;
    const __m512 s = _mm512_set1_ps(w->scale[(int64_t)b * ktk_fp8_groups(w) + t * 16 / w->group]);
    const __m512 up = _mm512_set1_ps(256.0f), nan = _mm512_set1_ps(__builtin_nanf(""));
    const __m256i keep = _mm256_set1_epi16((short)0xbf80), em = _mm256_set1_epi16(0x3f80);
#pragma GCC unroll 16
    for (int c = 0; c < 16; c++) {
        const __m256i v = _mm256_cvtepi8_epi16(_mm_loadu_si128((const __m128i *)(p + c * 16)));
        const __m256i h = _mm256_and_si256(_mm256_slli_epi16(v, 7), keep);
        const __mmask16 isnan = _mm256_cmpeq_epi16_mask(_mm256_and_si256(h, em), em);
        const __m512 f = _mm512_mul_ps(_mm512_mul_ps(_mm512_cvtph_ps(h), up), s);
        z[c] = _mm512_mask_mov_ps(f, isnan, nan);
    }
}

KTK_AI void store_tile(__m512 z[16], int t, float *wt, float *wr, int64_t ldr) {
    if (wt)
#pragma GCC unroll 16
        for (int c = 0; c < 16; c++) _mm512_storeu_ps(wt + ((int64_t)t * 16 + c) * 16, z[c]);
    if (!wr) return;   /* (columns only: a forward product) */
    transpose16(z);
#pragma GCC unroll 16
    for (int j = 0; j < 16; j++) _mm512_storeu_ps(wr + (int64_t)j * ldr + (int64_t)t * 16, z[j]);
}

KTK_AI void tile_any(const ktk_mat *w, int b, int t, __m512 z[16]) {
    switch (w->quant) {
    case KTK_QUANT_BF16: tile_bf16(w, b, t, z); break;
    case KTK_QUANT_INT8: tile_int8(w, b, t, z); break;
    case KTK_QUANT_INT4: tile_int4(w, b, t, z); break;
    default: tile_fp8(w, b, t, z); break;   /* KTK_QUANT_FP8 (the caller runs the generic step for any other) */
    }
}

static void unpack(const ktk_mat *w, int b, float *wt, float *wr, int64_t ldr) {
    const int tiles = (w->K + 15) / 16;
    __m512 z[16];
    switch (w->quant) {
    case KTK_QUANT_BF16:
        for (int t = 0; t < tiles; t++) { tile_bf16(w, b, t, z); store_tile(z, t, wt, wr, ldr); }
        break;
    case KTK_QUANT_INT8:
        for (int t = 0; t < tiles; t++) { tile_int8(w, b, t, z); store_tile(z, t, wt, wr, ldr); }
        break;
    case KTK_QUANT_INT4:
        for (int t = 0; t < tiles; t++) { tile_int4(w, b, t, z); store_tile(z, t, wt, wr, ldr); }
        break;
    default:   /* KTK_QUANT_FP8; the caller runs the generic step for any other format */
        for (int t = 0; t < tiles; t++) { tile_fp8(w, b, t, z); store_tile(z, t, wt, wr, ldr); }
        break;
    }
}

/* ---- g, u = W x ---- */
KTK_AI void gate_up_mr(const float *wtg, const float *wtu, int Kt, const float *x, int64_t ldx, float *g, float *u,
                      const int MR) {
    __m512 acc[4][4];   /* per row: g even c, g odd c, u even c, u odd c */
#pragma GCC unroll 4
    for (int m = 0; m < MR; m++)
#pragma GCC unroll 4
        for (int q = 0; q < 4; q++) acc[m][q] = _mm512_setzero_ps();
    for (int c = 0; c < Kt; c += 2) {
        const __m512 g0 = _mm512_loadu_ps(wtg + (int64_t)c * 16), g1 = _mm512_loadu_ps(wtg + (int64_t)c * 16 + 16);
        const __m512 u0 = _mm512_loadu_ps(wtu + (int64_t)c * 16), u1 = _mm512_loadu_ps(wtu + (int64_t)c * 16 + 16);
#pragma GCC unroll 4
        for (int m = 0; m < MR; m++) {
            const __m512 x0 = _mm512_set1_ps(x[m * ldx + c]), x1 = _mm512_set1_ps(x[m * ldx + c + 1]);
            acc[m][0] = _mm512_fmadd_ps(x0, g0, acc[m][0]);
            acc[m][1] = _mm512_fmadd_ps(x1, g1, acc[m][1]);
            acc[m][2] = _mm512_fmadd_ps(x0, u0, acc[m][2]);
            acc[m][3] = _mm512_fmadd_ps(x1, u1, acc[m][3]);
        }
    }
#pragma GCC unroll 4
    for (int m = 0; m < MR; m++) {
        _mm512_storeu_ps(g + m * 16, _mm512_add_ps(acc[m][0], acc[m][1]));
        _mm512_storeu_ps(u + m * 16, _mm512_add_ps(acc[m][2], acc[m][3]));
    }
}

static void gate_up(const float *wtg, const float *wtu, int Kt, const float *x, int64_t ldx, int n, float *g,
                    float *u) {
    for (int i = 0; i < n; i += 4) {
        const float *xi = x + i * ldx;
        switch (n - i < 4 ? n - i : 4) {
        case 1: gate_up_mr(wtg, wtu, Kt, xi, ldx, g + i * 16, u + i * 16, 1); break;
        case 2: gate_up_mr(wtg, wtu, Kt, xi, ldx, g + i * 16, u + i * 16, 2); break;
        case 3: gate_up_mr(wtg, wtu, Kt, xi, ldx, g + i * 16, u + i * 16, 3); break;
        default: gate_up_mr(wtg, wtu, Kt, xi, ldx, g + i * 16, u + i * 16, 4); break;
        }
    }
}

/* ---- out += W^T d ---- */
/* MR rows x NV vectors of 16 outputs from c0 (the last one masked by `last`); W1 (and W2 when TWO) rows ldw apart */
KTK_AI void tprod_mr(const float *w1, const float *d1, const float *w2, const float *d2, int64_t ldd, int64_t ldw,
                    int c0, __mmask16 last, float *out, int64_t ldo, const int MR, const int NV, const int TWO) {
    __m512 acc[4][8];
#pragma GCC unroll 4
    for (int m = 0; m < MR; m++)
#pragma GCC unroll 8
        for (int v = 0; v < NV; v++)
            acc[m][v] = _mm512_maskz_loadu_ps(v == NV - 1 ? last : 0xffff, out + m * ldo + c0 + v * 16);
#pragma GCC unroll 2
    for (int j = 0; j < 16; j++) {
        __m512 wv[8];
#pragma GCC unroll 8
        for (int v = 0; v < NV; v++) wv[v] = _mm512_loadu_ps(w1 + j * ldw + c0 + v * 16);
#pragma GCC unroll 4
        for (int m = 0; m < MR; m++) {
            const __m512 dv = _mm512_set1_ps(d1[m * ldd + j]);
#pragma GCC unroll 8
            for (int v = 0; v < NV; v++) acc[m][v] = _mm512_fmadd_ps(dv, wv[v], acc[m][v]);
        }
        if (!TWO) continue;
#pragma GCC unroll 8
        for (int v = 0; v < NV; v++) wv[v] = _mm512_loadu_ps(w2 + j * ldw + c0 + v * 16);
#pragma GCC unroll 4
        for (int m = 0; m < MR; m++) {
            const __m512 dv = _mm512_set1_ps(d2[m * ldd + j]);
#pragma GCC unroll 8
            for (int v = 0; v < NV; v++) acc[m][v] = _mm512_fmadd_ps(dv, wv[v], acc[m][v]);
        }
    }
#pragma GCC unroll 4
    for (int m = 0; m < MR; m++)
#pragma GCC unroll 8
        for (int v = 0; v < NV; v++)
            _mm512_mask_storeu_ps(out + m * ldo + c0 + v * 16, v == NV - 1 ? last : 0xffff, acc[m][v]);
}

/* All of K for MR rows: NV-vector chunks, then single (masked) vectors */
KTK_AI void tprod_rows(const float *w1, const float *d1, const float *w2, const float *d2, int64_t ldd, int64_t ldw,
                      int K, float *out, int64_t ldo, const int MR, const int NV, const int TWO) {
    int c = 0;
    for (; c + NV * 16 <= K; c += NV * 16) tprod_mr(w1, d1, w2, d2, ldd, ldw, c, 0xffff, out, ldo, MR, NV, TWO);
    for (; c < K; c += 16) {
        const __mmask16 last = K - c >= 16 ? (__mmask16)0xffff : (__mmask16)((1u << (K - c)) - 1);
        tprod_mr(w1, d1, w2, d2, ldd, ldw, c, last, out, ldo, MR, 1, TWO);
    }
}

#define TPROD_CASE(MR, NV)                                                                                        \
    if (two) tprod_rows(w1, d1i, w2, d2i, ldd, ldw, K, oi, ldo, MR, NV, 1);                                       \
    else tprod_rows(w1, d1i, w2, d2i, ldd, ldw, K, oi, ldo, MR, NV, 0);                                           \
    break

static void tprod(const float *w1, const float *d1, const float *w2, const float *d2, int64_t ldd, int64_t ldw,
                  int K, int n, float *out, int64_t ldo) {
    const int two = w2 != NULL;
    for (int i = 0; i < n; i += 4) {
        const float *d1i = d1 + i * ldd, *d2i = two ? d2 + i * ldd : NULL;
        float *oi = out + i * ldo;
        switch (n - i < 4 ? n - i : 4) {
        case 1: TPROD_CASE(1, 8);
        case 2: TPROD_CASE(2, 8);
        case 3: TPROD_CASE(3, 4);
        default: TPROD_CASE(4, 4);
        }
    }
}

/* ---- few rows: straight from the stored blocks, the transposed products summed per lane ---- */
static void gate_up_packed(const ktk_mat *g, const ktk_mat *u, int b, const float *x, int64_t ldx, int n, float *G,
                           float *U) {
    const int tiles = (g->K + 15) / 16;
    for (int i0 = 0; i0 < n; i0 += 2) {
        const int mr = n - i0 < 2 ? n - i0 : 2;
        __m512 acc[2][4], z[16];   /* per row: g even c, g odd c, u even c, u odd c */
        for (int m = 0; m < 2; m++)
            for (int q = 0; q < 4; q++) acc[m][q] = _mm512_setzero_ps();
        for (int t = 0; t < tiles; t++) {
            for (int w = 0; w < 2; w++) {
                tile_any(w ? u : g, b, t, z);
                for (int m = 0; m < mr; m++) {
                    const float *xr = x + (i0 + m) * ldx + t * 16;
#pragma GCC unroll 16
                    for (int c = 0; c < 16; c++)
                        acc[m][2 * w + c % 2] = _mm512_fmadd_ps(_mm512_set1_ps(xr[c]), z[c], acc[m][2 * w + c % 2]);
                }
            }
        }
        for (int m = 0; m < mr; m++) {
            _mm512_storeu_ps(G + (i0 + m) * 16, _mm512_add_ps(acc[m][0], acc[m][1]));
            _mm512_storeu_ps(U + (i0 + m) * 16, _mm512_add_ps(acc[m][2], acc[m][3]));
        }
    }
}

static void tacc(const ktk_mat *w, int b, const float *d, int64_t ldd, int n, float *A) {
    const int tiles = (w->K + 15) / 16;
    const int64_t Kt = (int64_t)tiles * 16;
    __m512 z[16];
    for (int t = 0; t < tiles; t++) {
        tile_any(w, b, t, z);
        for (int i = 0; i < n; i++) {
            const __m512 dv = _mm512_loadu_ps(d + i * ldd);
            float *a = A + (i * Kt + (int64_t)t * 16) * 16;
#pragma GCC unroll 16
            for (int c = 0; c < 16; c++)
                _mm512_storeu_ps(a + c * 16, _mm512_fmadd_ps(dv, z[c], _mm512_loadu_ps(a + c * 16)));
        }
    }
}

static void hsum(const float *A, int K, int n, float *out, int64_t ldo) {
    const int tiles = (K + 15) / 16;
    const int64_t Kt = (int64_t)tiles * 16;
    __m512 a[16];
    for (int i = 0; i < n; i++)
        for (int t = 0; t < tiles; t++) {
            const float *p = A + (i * Kt + (int64_t)t * 16) * 16;
#pragma GCC unroll 16
            for (int c = 0; c < 16; c++) a[c] = _mm512_loadu_ps(p + c * 16);
            transpose16(a);   /* a[j] lane c = A[c][j] */
            __m512 s = a[0];
#pragma GCC unroll 15
            for (int j = 1; j < 16; j++) s = _mm512_add_ps(s, a[j]);
            const __mmask16 m = K - t * 16 >= 16 ? (__mmask16)0xffff : (__mmask16)((1u << (K - t * 16)) - 1);
            _mm512_mask_storeu_ps(out + i * ldo + t * 16, m, s);
        }
}

/* The expert LoRA loops (kernels.h): 16 columns of x / v at a time against up to 8 rows of M at once. */
static void mdot(const float *M, int64_t ldm, int rk, const float *x, int n, float *t) {
    for (int j0 = 0; j0 < rk; j0 += 8) {
        const int nj = rk - j0 < 8 ? rk - j0 : 8;
        __m512 acc[8];
        for (int j = 0; j < 8; j++) acc[j] = _mm512_setzero_ps();
        for (int i = 0; i < n; i += 16) {
            const __mmask16 m = n - i >= 16 ? (__mmask16)0xffff : (__mmask16)((1u << (n - i)) - 1);
            const __m512 xv = _mm512_maskz_loadu_ps(m, x + i);
            for (int j = 0; j < nj; j++)
                acc[j] = _mm512_fmadd_ps(_mm512_maskz_loadu_ps(m, M + (int64_t)(j0 + j) * ldm + i), xv, acc[j]);
        }
        for (int j = 0; j < nj; j++) t[j0 + j] = _mm512_reduce_add_ps(acc[j]);
    }
}

static void maxpy(float *y, const float *M, int64_t ldm, int rk, const float *s, int n) {
    for (int i = 0; i < n; i += 16) {
        const __mmask16 m = n - i >= 16 ? (__mmask16)0xffff : (__mmask16)((1u << (n - i)) - 1);
        __m512 acc = _mm512_maskz_loadu_ps(m, y + i);
        for (int j = 0; j < rk; j++)
            acc = _mm512_fmadd_ps(_mm512_set1_ps(s[j]), _mm512_maskz_loadu_ps(m, M + (int64_t)j * ldm + i), acc);
        _mm512_mask_storeu_ps(y + i, m, acc);
    }
}

static void ger(float *M, int64_t ldm, int rk, const float *s, const float *v, int n) {
    for (int i = 0; i < n; i += 16) {
        const __mmask16 m = n - i >= 16 ? (__mmask16)0xffff : (__mmask16)((1u << (n - i)) - 1);
        const __m512 vv = _mm512_maskz_loadu_ps(m, v + i);
        for (int j = 0; j < rk; j++) {
            float *row = M + (int64_t)j * ldm + i;
            _mm512_mask_storeu_ps(row, m, _mm512_fmadd_ps(_mm512_set1_ps(s[j]), vv, _mm512_maskz_loadu_ps(m, row)));
        }
    }
}

#pragma GCC pop_options

const ktk_bwd_kernels *ktk_bwd_kernels_avx512(void) {
    static const ktk_bwd_kernels table = {.name = "avx512", .unpack = unpack, .gate_up = gate_up, .tprod = tprod,
                                          .few_rows = 2, .gate_up_packed = gate_up_packed, .tacc = tacc,
                                          .hsum = hsum, .mdot = mdot, .maxpy = maxpy, .ger = ger,
                                          .bf16_rows = ktk_avx2_bf16_rows, .bf16_pairs = ktk_avx2_bf16_pairs,
                                          .dequant_bf16 = {[KTK_QUANT_INT4] = ktk_avx512_dequant_int4,
                                                           [KTK_QUANT_FP8] = ktk_avx512_dequant_fp8,
                                                           [KTK_QUANT_MXFP4] = ktk_avx512_dequant_mxfp4}};
    return &table;
}
