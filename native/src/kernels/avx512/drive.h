/* Shared by the AVX-512 kernel files: the (MR, NB) instantiation switch (the driver, shared with AVX2, is
 * ../drive.h), and the group sum of the int4 kernels. Header-only (static inline); only ktk512_xsum has a target
 * attribute of its own.
 */
#ifndef KTK_AVX512_DRIVE_H
#define KTK_AVX512_DRIVE_H
#include <stdint.h>
#include <stdlib.h>
#include <immintrin.h>
#include "../kernels.h"
#include "../drive.h"

#define KTK_AI static inline __attribute__((always_inline))
#ifndef PF_BYTES
#define PF_BYTES 1024   /* software prefetch distance, per weight stream (0: none) */
#endif
#ifndef PF_HINT
#define PF_HINT _MM_HINT_T0   /* the weight streams' prefetch target (KTINJECT_CFLAGS=-DPF_HINT=_MM_HINT_T1: L2) */
#endif

/* switch (mr, nb) -> an instantiation of an always-inline body with constant MR, NB (registers, full unroll) */
#define KTK512_CASES(BODY)                                                                                          \
    switch (mr * 8 + nb) {                                                                                         \
    case 8 + 1: BODY(1, 1); break; case 8 + 2: BODY(1, 2); break; case 8 + 3: BODY(1, 3); break;                   \
    case 8 + 4: BODY(1, 4); break; case 16 + 1: BODY(2, 1); break; case 16 + 2: BODY(2, 2); break;                 \
    case 16 + 3: BODY(2, 3); break; case 16 + 4: BODY(2, 4); break; case 24 + 1: BODY(3, 1); break;                \
    case 24 + 2: BODY(3, 2); break; case 24 + 3: BODY(3, 3); break; case 24 + 4: BODY(3, 4); break;                \
    case 32 + 1: BODY(4, 1); break; case 32 + 2: BODY(4, 2); break; case 32 + 3: BODY(4, 3); break;                \
    case 32 + 4: BODY(4, 4); break; case 40 + 1: BODY(5, 1); break; case 40 + 2: BODY(5, 2); break;                \
    case 40 + 3: BODY(5, 3); break; case 40 + 4: BODY(5, 4); break; case 48 + 1: BODY(6, 1); break;                \
    case 48 + 2: BODY(6, 2); break; case 48 + 3: BODY(6, 3); break; case 48 + 4: BODY(6, 4); break;                \
    default: abort();                                                                                              \
    }

/* (the int4 kernels of int4.c and gemv.c) */
/* sum of the G (32, 64 or 128) int8 values at p: sad of (x + 128) against 0 over 64-byte chunks (bytes past G
 * loaded as 0, i.e. 128 after the flip), minus 128 per byte */
__attribute__((target("avx512f,avx512bw"))) KTK_AI int32_t ktk512_xsum(const int8_t *p, int G) {
    const __m512i flip = _mm512_set1_epi8((char)0x80), zero = _mm512_setzero_si512();
    __m512i s = zero;
    int i = 0;
    for (; i < G; i += 64) {
        const __mmask64 m = G - i >= 64 ? ~(__mmask64)0 : (((__mmask64)1 << (G - i)) - 1);
        s = _mm512_add_epi64(s, _mm512_sad_epu8(_mm512_xor_si512(_mm512_maskz_loadu_epi8(m, p + i), flip), zero));
    }
    return (int32_t)_mm512_reduce_add_epi64(s) - 128 * i;
}

#endif
