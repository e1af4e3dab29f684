/* AVX2 conversions to bf16 for the bf16 products of training's projections (ktk_bwd_kernels.bf16_rows, bf16_pairs;
 * moe/project_bf16.c), in the avx2 and the avx512 backward tables (every AVX-512 CPU has AVX2).
 *
 *   rounding: by integer ops, 8 lanes at once: bits + 0x7fff + bit 16 of the bits (round to nearest even, as
 *             ktk_f32_to_bf16), a NaN quieted instead (bit 22 set): the generic conversion's bits for every input,
 *             denormals included, the bf16 value in the high half of each 32-bit lane;
 *   rows:     16 values -> two such vectors, halves shifted down, packed (vpackusdw) and their 128-bit lanes put in
 *             order (vpermq);
 *   pairs:    r0's bf16 in the low half and r1's in the high half of each lane are already the bf16 packed layout's
 *             (output j, input pair) order: one shift, one blend per 8 outputs, no shuffle.
 * Layouts: see ../kernels.h. Called concurrently: no mutable globals, no allocation.
 */
#include <stdint.h>
#include <immintrin.h>
#include "../kernels.h"

#pragma GCC push_options
#pragma GCC target("avx2")

#define KTK_AI static inline __attribute__((always_inline))

/* bf16(f) in the high half of each lane (the low half is garbage) */
KTK_AI __m256i bf16_hi(__m256i u) {
    const __m256i lsb = _mm256_and_si256(_mm256_srli_epi32(u, 16), _mm256_set1_epi32(1));
    const __m256i r = _mm256_add_epi32(u, _mm256_add_epi32(lsb, _mm256_set1_epi32(0x7fff)));
    const __m256i nan = _mm256_cmpgt_epi32(_mm256_and_si256(u, _mm256_set1_epi32(0x7fffffff)),
                                           _mm256_set1_epi32(0x7f800000));
    return _mm256_blendv_epi8(r, _mm256_or_si256(u, _mm256_set1_epi32(0x00400000)), nan);
}

KTK_AI __m256i load8(const float *p) { return _mm256_loadu_si256((const __m256i *)p); }

void ktk_avx2_bf16_rows(const float *src, int n, uint16_t *dst) {
    int i = 0;
    for (; i + 16 <= n; i += 16) {
        const __m256i lo = _mm256_srli_epi32(bf16_hi(load8(src + i)), 16);
        const __m256i hi = _mm256_srli_epi32(bf16_hi(load8(src + i + 8)), 16);
        _mm256_storeu_si256((__m256i *)(dst + i), _mm256_permute4x64_epi64(_mm256_packus_epi32(lo, hi), 0xd8));
    }
    for (; i < n; i++) dst[i] = ktk_f32_to_bf16(src[i]);
}

void ktk_avx2_bf16_pairs(const float *r0, const float *r1, int64_t ldr, int n, uint16_t *dst, int64_t ldd) {
    for (int i = 0; i < n; i++) {
        const float *a = r0 + i * ldr, *b = r1 + i * ldr;
        uint16_t *o = dst + i * ldd;
        for (int h = 0; h < 16; h += 8) {
            const __m256i e = _mm256_srli_epi32(bf16_hi(load8(a + h)), 16), d = bf16_hi(load8(b + h));
            _mm256_storeu_si256((__m256i *)(o + 2 * h), _mm256_blend_epi16(e, d, 0xaa));
        }
    }
}

#pragma GCC pop_options
