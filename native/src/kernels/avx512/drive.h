/* Shared by the AVX-512 kernel files: the (row group, block group) driver and the (MR, NB) instantiation switch.
 * Header-only (static inline), no target attributes of its own.
 */
#ifndef KTK_AVX512_DRIVE_H
#define KTK_AVX512_DRIVE_H
#include <stdint.h>
#include <stdlib.h>
#include "../../kernels.h"

#define KTK_AI static inline __attribute__((always_inline))
#ifndef PF_BYTES
#define PF_BYTES 1024   /* software prefetch distance, per weight stream (0: none) */
#endif

typedef void (*ktk512_micro)(const ktk_mat *w, const ktk_act *x, int b0, int t0, float *y, int64_t ldy,
                             int mr, int nb);

/* Rows and column blocks of one (row group, block group) call: n rows are split into balanced groups of at most
 * mrmax, blocks into groups of min(nbmax, accmax / mr) so that the accumulators fit in registers. */
static inline void ktk512_drive(ktk512_micro micro, int mrmax, int nbmax, int accmax, const ktk_mat *w, int nb0,
                                int nb1, const ktk_act *x, float *y, int64_t ldy) {
    const int n = x->n;
    if (n <= 0 || nb1 <= nb0) return;
    const int groups = (n + mrmax - 1) / mrmax;
    const int mrtop = (n + groups - 1) / groups;
    int nbg = accmax / mrtop;
    if (nbg > nbmax) nbg = nbmax;
    if (nbg < 1) nbg = 1;
    for (int b = nb0; b < nb1; b += nbg) {
        const int nb = nb1 - b < nbg ? nb1 - b : nbg;
        int t = 0;
        for (int g = 0; g < groups; g++) {
            const int mr = (n - t + (groups - g) - 1) / (groups - g);
            micro(w, x, b, t, y + (int64_t)t * ldy + (int64_t)(b - nb0) * 16, ldy, mr, nb);
            t += mr;
        }
    }
}

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
