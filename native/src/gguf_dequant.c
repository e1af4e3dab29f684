/* llama.cpp's K-quant super-blocks (256 values) decoded to float32: the reference behind ktk_gguf_dequantize.
 *
 * The same float32 operations, in the same order, as ktinject/injection/formats/gguf_kquants.py (and gguf.quants'
 * numpy dequantizers): per sub-block a float32 product of the fp16 super-block scale and the sub-block's integer
 * scale, then (Q4_K, Q5_K) d * q - dmin * m or (Q6_K) d * q, each operation rounded on its own. Contraction into a
 * fused multiply-add would round once instead of twice, so it is switched off for this file; the plain loops over
 * 32 (16) values are left for the compiler to vectorize.
 *
 * Layouts (bytes of one block): Q4_K 144 = d f16, dmin f16, 12 bytes of 6-bit scales and mins for 8 sub-blocks of
 * 32, 128 bytes of nibbles (each 32 bytes: 32 values in the low nibbles, the next 32 in the high ones); Q5_K 176 =
 * the same head, 32 bytes of fifth bits (bit j of byte l: value l of sub-block j), 128 bytes of nibbles; Q6_K 210 =
 * 128 bytes of low nibbles, 64 bytes of two high bits, 16 int8 scales (one per 16 values), d f16.
 */
#include <string.h>

#include "internal.h"

#if defined(__clang__)
#pragma STDC FP_CONTRACT OFF
#elif defined(__GNUC__)
#pragma GCC optimize("fp-contract=off")
#endif

/* fp16 bits -> float32, exactly (subnormals, infinities and NaN payloads kept). */
static float f16_to_f32(const uint8_t *p) {
    const uint32_t h = (uint32_t)p[0] | ((uint32_t)p[1] << 8);
    const uint32_t sign = (h & 0x8000u) << 16, exp = (h >> 10) & 0x1Fu, mant = h & 0x3FFu;
    uint32_t bits;
    if (exp == 0x1F) {
        bits = sign | 0x7F800000u | (mant << 13);
    } else if (exp != 0) {
        bits = sign | ((exp + 112) << 23) | (mant << 13);
    } else {
        const float sub = (float)mant * 0x1p-24f;   /* exact: mant < 2^10 */
        memcpy(&bits, &sub, 4);
        bits |= sign;
    }
    float f;
    memcpy(&f, &bits, 4);
    return f;
}

/* The 8 six-bit scales and mins of a Q4_K / Q5_K block (its 12 scale bytes). */
static void scale_min(const uint8_t *s, float sc[8], float mn[8]) {
    for (int j = 0; j < 4; j++) {
        sc[j] = (float)(s[j] & 0x3F);
        mn[j] = (float)(s[4 + j] & 0x3F);
        sc[4 + j] = (float)((s[8 + j] & 0x0F) | ((s[j] >> 2) & 0x30));
        mn[4 + j] = (float)((s[8 + j] >> 4) | ((s[4 + j] >> 2) & 0x30));
    }
}

static void q4_k(const uint8_t *b, float *out) {
    float sc[8], mn[8];
    scale_min(b + 4, sc, mn);
    const float d = f16_to_f32(b), dmin = f16_to_f32(b + 2);
    const uint8_t *qs = b + 16;
    for (int i = 0; i < 4; i++, qs += 32) {
        const float d0 = d * sc[2 * i], m0 = dmin * mn[2 * i];
        const float d1 = d * sc[2 * i + 1], m1 = dmin * mn[2 * i + 1];
        float *o = out + 64 * i;
        for (int l = 0; l < 32; l++) o[l] = d0 * (float)(qs[l] & 0x0F) - m0;
        for (int l = 0; l < 32; l++) o[32 + l] = d1 * (float)(qs[l] >> 4) - m1;
    }
}

static void q5_k(const uint8_t *b, float *out) {
    float sc[8], mn[8];
    scale_min(b + 4, sc, mn);
    const float d = f16_to_f32(b), dmin = f16_to_f32(b + 2);
    const uint8_t *qh = b + 16, *qs = b + 48;
    for (int i = 0; i < 4; i++, qs += 32) {
        const int j0 = 2 * i, j1 = 2 * i + 1;
        const float d0 = d * sc[j0], m0 = dmin * mn[j0], d1 = d * sc[j1], m1 = dmin * mn[j1];
        float *o = out + 64 * i;
        for (int l = 0; l < 32; l++) o[l] = d0 * (float)((qs[l] & 0x0F) | (((qh[l] >> j0) & 1) << 4)) - m0;
        for (int l = 0; l < 32; l++) o[32 + l] = d1 * (float)((qs[l] >> 4) | (((qh[l] >> j1) & 1) << 4)) - m1;
    }
}

/* Q6_K, 128 values a half, walked as llama.cpp does: byte l of the half's ql and qh gives values l, l + 32, l + 64
 * and l + 96 (low nibble of ql[l] / ql[l + 32], then their high nibbles; bits 0-1, 2-3, 4-5, 6-7 of qh[l]). */
static void q6_k(const uint8_t *b, float *out) {
    const float d = f16_to_f32(b + 208);
    for (int h = 0; h < 2; h++) {
        const uint8_t *ql = b + 64 * h, *qh = b + 128 + 32 * h;
        const int8_t *sc = (const int8_t *)(b + 192) + 8 * h;
        float *o = out + 128 * h;
        for (int half = 0; half < 2; half++) {   /* values l < 16 and l >= 16 of each 32 have their own scale */
            const float d0 = d * (float)sc[half], d1 = d * (float)sc[half + 2];
            const float d2 = d * (float)sc[half + 4], d3 = d * (float)sc[half + 6];
            for (int l = 16 * half; l < 16 * half + 16; l++) {
                const int a = ql[l], c = ql[l + 32], hb = qh[l];
                o[l] = d0 * (float)(((a & 0x0F) | ((hb & 3) << 4)) - 32);
                o[l + 32] = d1 * (float)(((c & 0x0F) | (((hb >> 2) & 3) << 4)) - 32);
                o[l + 64] = d2 * (float)(((a >> 4) | (((hb >> 4) & 3) << 4)) - 32);
                o[l + 96] = d3 * (float)(((c >> 4) | (((hb >> 6) & 3) << 4)) - 32);
            }
        }
    }
}

int64_t ktki_gguf_dequant_block_bytes(int qtype) {
    switch (qtype) {
    case KTK_GGUF_Q4_K: return 144;
    case KTK_GGUF_Q5_K: return 176;
    case KTK_GGUF_Q6_K: return 210;
    default: return 0;
    }
}

void ktki_gguf_dequant(int qtype, const uint8_t *blocks, int64_t nblocks, float *out) {
    const int64_t bytes = ktki_gguf_dequant_block_bytes(qtype);
    void (*block)(const uint8_t *, float *) = qtype == KTK_GGUF_Q4_K ? q4_k : qtype == KTK_GGUF_Q5_K ? q5_k : q6_k;
    for (int64_t i = 0; i < nblocks; i++) block(blocks + i * bytes, out + i * 256);
}
