/* Dtype conversions, symmetric int8 / group-wise int4 / block-wise fp8 / mxfp4 quantization and the packed layouts
 * of kernels/kernels.h (generic C). */
#include <math.h>
#include <string.h>

#include "../internal.h"

static float f16_to_f32(uint16_t h) {
    uint32_t sign = (uint32_t)(h & 0x8000u) << 16, exp = (h >> 10) & 0x1fu, man = h & 0x3ffu, bits;
    if (exp == 0x1f) {
        bits = sign | 0x7f800000u | (man << 13);               /* inf / nan */
    } else if (exp != 0) {
        bits = sign | ((exp + 112) << 23) | (man << 13);       /* normal: rebias 15 -> 127 */
    } else if (man == 0) {
        bits = sign;                                            /* zero */
    } else {                                                    /* subnormal: normalize */
        int e = -1;
        do { man <<= 1; e++; } while (!(man & 0x400u));
        bits = sign | ((uint32_t)(112 - e) << 23) | ((man & 0x3ffu) << 13);
    }
    union { uint32_t u; float f; } v;
    v.u = bits;
    return v.f;
}

void ktki_pack_to_f32(const void *src, int dtype, int64_t n, int64_t stride, float *dst) {
    if (dtype == KTK_DTYPE_F32) {
        const float *s = src;
        if (stride == 1) memcpy(dst, s, (size_t)n * sizeof(float));
        else for (int64_t i = 0; i < n; i++) dst[i] = s[i * stride];
    } else if (dtype == KTK_DTYPE_BF16) {
        const uint16_t *s = src;
        for (int64_t i = 0; i < n; i++) dst[i] = ktk_bf16_to_f32(s[i * stride]);
    } else {
        const uint16_t *s = src;
        for (int64_t i = 0; i < n; i++) dst[i] = f16_to_f32(s[i * stride]);
    }
}

/* Symmetric per-row int8: scale = amax / 127, q = round half to even (x / scale) (as torch.round), clamped to
 * +-127. Written so that -O3 vectorizes it with baseline x86-64 (SSE2), no libm calls (prefill quantizes every
 * row of x and h): |x| as int32 bit patterns order like the floats (a NaN sorts above inf, so a row with a NaN or
 * an inf gets scale NaN and q = 0: its outputs come out NaN, not silently wrong), and v + 1.5 * 2^23 - 1.5 * 2^23
 * rounds half to even exactly for |v| <= 2^22 (here |v| <= 127 up to an ulp; the clamp is on the integers).
 * One body, built twice: for AVX-512 where the CPU has it (several times faster per value than the baseline build,
 * itself several times faster than a libm version) and for baseline x86-64; the same bits either way. (Not target_clones: its ifunc resolver runs before
 * ThreadSanitizer is initialized.) */
static inline __attribute__((always_inline)) int32_t quantize_row(const float *x, int64_t n, int8_t *q,
                                                                    float *scale) {
    int32_t amax_bits = 0;
    for (int64_t i = 0; i < n; i++) {
        int32_t b;
        memcpy(&b, &x[i], 4);
        b &= 0x7fffffff;
        amax_bits = b > amax_bits ? b : amax_bits;
    }
    float amax;
    memcpy(&amax, &amax_bits, 4);
    if (!(amax > 0.0f) || !isfinite(amax)) {   /* all zero, or an inf / NaN: nothing sensible to keep */
        if (n > 0) memset(q, 0, (size_t)n);
        *scale = amax == 0.0f ? 0.0f : NAN;
        return 0;
    }
    const float s = amax / 127.0f, magic = 12582912.0f;   /* 1.5 * 2^23 */
    if (!(s > 0.0f)) {   /* amax below ~1e-43: the scale underflows; the row is zero to this precision */
        memset(q, 0, (size_t)n);
        *scale = 0.0f;
        return 0;
    }
    int32_t sum = 0;
    for (int64_t i = 0; i < n; i++) {
        int32_t r = (int32_t)((x[i] / s + magic) - magic);   /* |x / s| <= 127 up to an ulp */
        r = r > 127 ? 127 : r < -127 ? -127 : r;
        q[i] = (int8_t)r;
        sum += r;
    }
    *scale = s;
    return sum;
}

__attribute__((target("avx512f"))) static int32_t quantize_row_avx512(const float *x, int64_t n, int8_t *q,
                                                                      float *scale) {
    return quantize_row(x, n, q, scale);
}

int32_t ktki_pack_quantize_row(const float *x, int64_t n, int8_t *q, float *scale) {
    return ktki_dispatch_isa_available(KTK_ISA_AVX512) ? quantize_row_avx512(x, n, q, scale)
                                              : quantize_row(x, n, q, scale);
}

/* Element (n, c) offsets of the packed layouts. */
static inline int64_t off_bf16(const ktk_mat *m, int n, int c) {
    return ((int64_t)(n / 16) * (m->Kp / 2) + c / 2) * 32 + (n % 16) * 2 + c % 2;
}
static inline int64_t off_i8(const ktk_mat *m, int n, int c) {
    return ((int64_t)(n / 16) * (m->Kp / 4) + c / 4) * 64 + (n % 16) * 4 + c % 4;
}

void ktki_pack_bf16(const ktk_mat *m, uint16_t *data, int n, const float *row) {
    for (int c = 0; c < m->K; c++) data[off_bf16(m, n, c)] = ktk_f32_to_bf16(row[c]);
}

void ktki_pack_int8(const ktk_mat *m, int8_t *data, float *scale, int32_t *wsum, int n, const float *row,
                    int8_t *qtmp) {
    wsum[n] = ktki_pack_quantize_row(row, m->K, qtmp, &scale[n]);
    for (int c = 0; c < m->K; c++) data[off_i8(m, n, c)] = qtmp[c];
}

/* int4: byte offset of element (n, c), its nibble shift, and the offset of scale (n, g) */
static inline int64_t off_i4(const ktk_mat *m, int n, int c) {
    return ((int64_t)(n / 16) * (m->Kp / 8) + c / 8) * 64 + (n % 16) * 4 + c % 4;
}
static inline int shift_i4(int c) { return 4 * ((c / 4) % 2); }
static inline int64_t off_s4(const ktk_mat *m, int n, int g) {
    return ((int64_t)(n / 16) * (m->Kp / m->group) + g) * 16 + n % 16;
}

/* Group-wise int4 of one row: per group of G inputs (c < K; the rest is zero), m = the first value of largest
 * magnitude, scale = -m / 8 (so m itself is q = -8 exactly and all 16 levels are used), q = rint(x / scale) clamped
 * to [-8, 7] (round half to even; values of m's opposite sign above 15/16 |m| clamp to 7, an error below one step).
 * All-zero group: scale 0, q 0; a non-finite value: scale NaN, q 0 (as the int8 rows). Padding up to Kp: q = 0. */
void ktki_pack_int4(const ktk_mat *m, uint8_t *data, float *scale, int n, const float *row) {
    const int G = m->group;
    for (int g = 0; g < m->Kp / G; g++) {
        const int c0 = g * G, c1 = c0 + G < m->K ? c0 + G : m->K;
        float big = 0.0f, amax = 0.0f;
        int finite = 1;
        for (int c = c0; c < c1; c++) {
            if (!isfinite(row[c])) finite = 0;
            else if (fabsf(row[c]) > amax) { amax = fabsf(row[c]); big = row[c]; }
        }
        const float s = !finite ? NAN : amax > 0.0f ? -big / 8.0f : 0.0f;
        scale[off_s4(m, n, g)] = s;
        for (int c = c0; c < c0 + G; c++) {
            float v = 0.0f;
            if (c < c1 && finite && amax > 0.0f) {
                v = nearbyintf(row[c] / s);
                v = v > 7.0f ? 7.0f : v < -8.0f ? -8.0f : v;
            }
            uint8_t *p = data + off_i4(m, n, c);
            *p = (uint8_t)((*p & ~(0xf << shift_i4(c))) | (((int)v & 0xf) << shift_i4(c)));
        }
    }
}

void ktki_pack_int8_q(const ktk_mat *m, int8_t *data, float *scale, int32_t *wsum, int n, const int8_t *q,
                      int64_t qsi, float s) {
    int32_t sum = 0;
    for (int c = 0; c < m->K; c++) {
        data[off_i8(m, n, c)] = q[c * qsi];
        sum += q[c * qsi];
    }
    scale[n] = s;
    wsum[n] = sum;
}

void ktki_pack_int4_q(const ktk_mat *m, uint8_t *data, float *scale, int n, const int8_t *q, int64_t qsi,
                      const float *s, int64_t ssg) {
    const int G = m->group, groups = (m->K + G - 1) / G;
    for (int g = 0; g < m->Kp / G; g++) scale[off_s4(m, n, g)] = g < groups ? s[g * ssg] : 0.0f;
    for (int c = 0; c < m->Kp; c++) {
        const int v = c < m->K ? q[c * qsi] : 0;
        uint8_t *p = data + off_i4(m, n, c);
        *p = (uint8_t)((*p & ~(0xf << shift_i4(c))) | ((v & 0xf) << shift_i4(c)));
    }
}

/* ---- fp8 (float8 e4m3, OCP e4m3fn: 4 exponent bits of bias 7, 3 mantissa bits, no inf, 0x7f / 0xff NaN) ---- */
/* float -> e4m3, round to nearest even, saturating at +-448 (an inf too); NaN -> 0x7f with f's sign. Normals: the
 * mantissa rounded to 3 bits by integer addition (a carry moves into the exponent), rebiased 127 -> 7; below 2^-6
 * the e4m3 subnormals k * 2^-9, k = rint(|f| * 2^9) in 0..8 (8: the smallest normal, whose code is 8 as well) by the
 * 1.5 * 2^23 trick (exact: |f| * 2^9 < 8). The same bits as torch's float -> float8_e4m3fn cast below 464. */
uint8_t ktki_pack_f32_to_e4m3(float f) {
    uint32_t u;
    memcpy(&u, &f, 4);
    const uint8_t sign = (uint8_t)((u >> 24) & 0x80u);
    const uint32_t a = u & 0x7fffffffu;
    if (a > 0x7f800000u) return sign | 0x7f;
    if (a >= 0x43e00000u) return sign | 0x7e;                    /* |f| >= 448 */
    if (a < 0x3c800000u) {                                        /* |f| < 2^-6 */
        float v;
        memcpy(&v, &a, 4);
        const float k = (v * 512.0f + 12582912.0f) - 12582912.0f;
        return sign | (uint8_t)k;
    }
    const uint32_t r = a + 0x7ffffu + ((a >> 20) & 1u);
    return sign | (uint8_t)((r >> 20) - (120u << 3));
}

static inline int64_t off_f8(const ktk_mat *m, int n, int c) { return ((int64_t)(n / 16) * m->Kp + c) * 16 + n % 16; }
static inline int64_t off_s8(const ktk_mat *m, int n, int g) { return (int64_t)(n / 16) * ktk_fp8_groups(m) + g; }

/* Rows [n0, n1) of one block_rows band (n0 % 16 == 0), from rows[(n - n0) * K + c]: per group, scale = amax / 448
 * (1 where amax is 0 or its quotient underflows; NaN, with q 0, where the block holds an inf or NaN), stored for each
 * 16-row block of the band (padding groups 0), q = e4m3(w / scale). */
void ktki_pack_fp8(const ktk_mat *m, uint8_t *data, float *scale, int n0, int n1, const float *rows) {
    const int G = m->group, K = m->K, groups = (K + G - 1) / G;
    for (int g = 0; g < ktk_fp8_groups(m); g++) {
        const int c0 = g * G, c1 = c0 + G < K ? c0 + G : K;
        float amax = 0.0f, s = 0.0f;
        int finite = 1;
        for (int n = n0; n < n1; n++)
            for (int c = c0; c < c1; c++) {
                const float v = rows[(int64_t)(n - n0) * K + c];
                if (!isfinite(v)) finite = 0;
                else if (fabsf(v) > amax) amax = fabsf(v);
            }
        if (g < groups) s = !finite ? NAN : amax > 0.0f && amax / 448.0f > 0.0f ? amax / 448.0f : 1.0f;
        for (int n = n0; n < n1; n += 16) scale[off_s8(m, n, g)] = s;   /* each 16-row block of the band */
        for (int n = n0; n < n1; n++)
            for (int c = c0; c < c1; c++)
                data[off_f8(m, n, c)] = finite ? ktki_pack_f32_to_e4m3(rows[(int64_t)(n - n0) * K + c] / s) : 0;
    }
}

/* Row n from e4m3 bits q[c * qsi] (checked by the caller), and where n starts a 16-row block, the block's scales:
 * s[g * ssg] for g < ceil(K / G) (its block_rows band's), 0 for the padding groups. */
void ktki_pack_fp8_q(const ktk_mat *m, uint8_t *data, float *scale, int n, const uint8_t *q, int64_t qsi,
                     const float *s, int64_t ssg) {
    const int groups = (m->K + m->group - 1) / m->group;
    if (n % 16 == 0)
        for (int g = 0; g < ktk_fp8_groups(m); g++) scale[off_s8(m, n, g)] = g < groups ? s[g * ssg] : 0.0f;
    for (int c = 0; c < m->K; c++) data[off_f8(m, n, c)] = q[c * qsi];
}

/* ---- mxfp4 (e2m1 nibbles, an e8m0 exponent per row and 32 inputs) ---- */
static inline int64_t off_f4(const ktk_mat *m, int n, int c) {
    return ((int64_t)(n / 16) * (m->Kp / 8) + c / 8) * 64 + (n % 16) * 4 + (c % 8) / 2;
}
static inline int64_t off_e8(const ktk_mat *m, int n, int g) {
    return ((int64_t)(n / 16) * (m->Kp / KTK_MXFP4_GROUP) + g) * 16 + n % 16;
}

/* |v| <= 6 -> e2m1 code, round to nearest even (ties to the even code: 0.25 -> 0, 0.75 -> 1, 1.25 -> 1, 1.75 -> 2,
 * 2.5 -> 2, 3.5 -> 4, 5 -> 4); the sign bit only on a nonzero code. */
static uint8_t f32_to_e2m1(float v) {
    const float a = fabsf(v);
    uint8_t q = (uint8_t)((a > 0.25f) + (a >= 0.75f) + (a > 1.25f) + (a >= 1.75f) + (a > 2.5f) + (a >= 3.5f) +
                          (a > 5.0f));
    return q && v < 0.0f ? q | 8 : q;
}

void ktki_pack_mxfp4(const ktk_mat *m, uint8_t *data, uint8_t *scale, int n, const float *row) {
    for (int g = 0; g < m->Kp / KTK_MXFP4_GROUP; g++) {
        const int c0 = g * KTK_MXFP4_GROUP;
        float amax = 0.0f;
        for (int c = c0; c < c0 + KTK_MXFP4_GROUP && c < m->K; c++) amax = fabsf(row[c]) > amax ? fabsf(row[c]) : amax;
        int e = 127;
        if (c0 >= m->K) e = 0;   /* padding group */
        else if (amax > 0.0f) {   /* the smallest e >= 0 with amax <= 6 * 2^(e - 127) (<= 254: amax is finite) */
            int x;
            (void)frexpf(amax / 6.0f, &x);
            e = x + 126 < 0 ? 0 : x + 126;
            while (e > 0 && amax <= ldexpf(6.0f, e - 128)) e--;
            while (amax > ldexpf(6.0f, e - 127)) e++;
        }
        scale[off_e8(m, n, g)] = (uint8_t)e;
        for (int c = c0; c < c0 + KTK_MXFP4_GROUP; c++) {
            const uint8_t q = c < m->K ? f32_to_e2m1(ldexpf(row[c], 127 - e)) : 0;
            uint8_t *p = data + off_f4(m, n, c);
            *p = c % 2 ? (uint8_t)((*p & 0x0f) | (q << 4)) : (uint8_t)((*p & 0xf0) | q);
        }
    }
}

void ktki_pack_mxfp4_q(const ktk_mat *m, uint8_t *data, uint8_t *scale, int n, const uint8_t *blocks,
                       const uint8_t *scales) {
    const int groups = m->K / KTK_MXFP4_GROUP;
    for (int g = 0; g < m->Kp / KTK_MXFP4_GROUP; g++) scale[off_e8(m, n, g)] = g < groups ? scales[g] : 0;
    for (int c = 0; c < m->Kp; c += 2) data[off_f4(m, n, c)] = c < m->K ? blocks[c / 2] : 0;
}

void ktki_pack_unpack(const ktk_mat *m, int n, float *row) {
    if (m->quant == KTK_QUANT_MXFP4) {
        for (int c = 0; c < m->K; c++) {
            const uint8_t b = m->data_f4[off_f4(m, n, c)];
            row[c] = ktk_e2m1_to_f32(c % 2 ? b >> 4 : b & 15) *
                     ktk_e8m0_to_f32(m->scale_e8[off_e8(m, n, c / KTK_MXFP4_GROUP)]);
        }
        return;
    }
    if (m->quant == KTK_QUANT_FP8) {
        for (int c = 0; c < m->K; c++)
            row[c] = ktk_e4m3_to_f32(m->data_f8[off_f8(m, n, c)]) * m->scale[off_s8(m, n, c / m->group)];
        return;
    }
    if (m->quant == KTK_QUANT_BF16) {
        for (int c = 0; c < m->K; c++) row[c] = ktk_bf16_to_f32(m->data_bf16[off_bf16(m, n, c)]);
    } else if (m->quant == KTK_QUANT_INT8) {
        float s = m->scale[n];
        for (int c = 0; c < m->K; c++) row[c] = (float)m->data_i8[off_i8(m, n, c)] * s;
    } else {
        for (int c = 0; c < m->K; c++) {
            const int nib = (m->data_i4[off_i4(m, n, c)] >> shift_i4(c)) & 0xf;
            row[c] = (float)(nib >= 8 ? nib - 16 : nib) * m->scale[off_s4(m, n, c / m->group)];
        }
    }
}
