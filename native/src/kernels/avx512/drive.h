/* Shared by the AVX-512 kernel files: the (MR, NB) instantiation switch (the driver, shared with AVX2, is
 * ../drive.h). Header-only (static inline), no target attributes of its own.
 */
#ifndef KTK_AVX512_DRIVE_H
#define KTK_AVX512_DRIVE_H
#include <stdint.h>
#include <stdlib.h>
#include "../../kernels.h"
#include "../drive.h"

#define KTK_AI static inline __attribute__((always_inline))
#ifndef PF_BYTES
#define PF_BYTES 1024   /* software prefetch distance, per weight stream (0: none) */
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

#endif
