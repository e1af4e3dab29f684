/* Shared by the SIMD kernel files (AVX2, AVX-512): the (row group, block group) driver around an ISA's micro-kernel.
 * Header-only, plain C (no intrinsics, no target attributes).
 */
#ifndef KTK_DRIVE_H
#define KTK_DRIVE_H
#include <stdint.h>
#include "kernels.h"

typedef void (*ktk_micro)(const ktk_mat *w, const ktk_act *x, int b0, int t0, float *y, int64_t ldy, int mr,
                          int nb);

/* Rows and column blocks of one (row group, block group) call: n rows are split into balanced groups of at most
 * mrmax, blocks into groups of min(nbmax, accmax / mr) so that the accumulators fit in registers. */
static inline void ktk_drive(ktk_micro micro, int mrmax, int nbmax, int accmax, const ktk_mat *w, int nb0, int nb1,
                             const ktk_act *x, float *y, int64_t ldy) {
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

#endif
