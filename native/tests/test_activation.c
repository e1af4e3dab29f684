// Gate/up activations (native/src/kernels/activations.c, the path this CPU takes) and int8 row quantization
// (moe/pack.c) against
// float64 references, on segment lengths that are not multiples of 16, with and without biases. Prints "ok".
// Built against all native sources by tests/native/test_native.py::test_activation_and_quantize_rows.
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include "ktinject.h"
#include "internal.h"

#ifndef KTK_TEST_BUILD   /* the library's test hooks (KTINJECT_TEST_DELAY, ...) compile only into test builds */
#error "build the native tests with -DKTK_TEST_BUILD (tests/native/test_native.py does)"
#endif

static int fails;

static void check_act(int act, int n, int bias) {
    float *g = malloc(sizeof(float) * n * 5), *u = g + n, *bg = u + n, *bu = bg + n, *out = bu + n;
    for (int i = 0; i < n; i++) {
        g[i] = -30.0f + 60.0f * (float)((i * 7919) % n) / n;   /* every sign and size, shuffled */
        u[i] = -9.0f + 18.0f * (float)((i * 104729) % n) / n;
        bg[i] = 0.25f * (i % 5) - 0.5f, bu[i] = 0.125f * (i % 3);
    }
    if (n >= 3) g[0] = -100.0f, g[1] = 100.0f, g[2] = -89.0f;   /* exp's argument past its clamp at 88 */
    const float alpha = 1.702f, limit = 7.0f;
    ktki_activations(act, alpha, limit, g, u, bias ? bg : NULL, bias ? bu : NULL, n, out);
    double worst = 0;
    for (int i = 0; i < n; i++) {
        double gg = (double)g[i] + (bias ? bg[i] : 0), uu = (double)u[i] + (bias ? bu[i] : 0), ref;
        if (act == KTK_ACT_SILU) {
            ref = gg / (1.0 + exp(-gg)) * uu;
        } else if (act == KTK_ACT_SWIGLU_LIMIT) {
            gg = fmin(gg, limit), uu = fmin(fmax(uu, -limit), limit);
            ref = gg / (1.0 + exp(-gg)) * uu;
        } else {
            gg = fmin(gg, limit), uu = fmin(fmax(uu, -limit), limit);
            ref = gg / (1.0 + exp(-alpha * gg)) * (uu + 1.0);
        }
        const double e = fabs(out[i] - ref) / (fabs(ref) + 1e-6 * (fabs(gg) + 1.0) * (fabs(uu) + 1.0));
        if (!(e <= worst)) worst = e;
    }
    if (!(worst < 1e-5)) { printf("FAIL activation %d n=%d bias=%d: err %.3g\n", act, n, bias, worst); fails++; }
    free(g);
}

static void check_quantize(int n) {
    float *x = malloc(sizeof(float) * n);
    int8_t *q = malloc(n > 0 ? n : 1);
    for (int i = 0; i < n; i++) x[i] = (float)(((i * 7919) % 1001) - 500) * 0.0173f;
    float s;
    int32_t sum = ktki_pack_quantize_row(x, n, q, &s), ref_sum = 0;
    double amax = 0;
    for (int i = 0; i < n; i++) amax = fmax(amax, fabs(x[i]));
    const float want_s = (float)amax / 127.0f;
    if (n > 0 && s != want_s) { printf("FAIL quantize n=%d: scale %g, expected %g\n", n, s, want_s); fails++; }
    for (int i = 0; i < n; i++) {
        const float v = x[i] / want_s;   /* round half to even, clamped: torch.round(x / scale).clamp(-127, 127) */
        const int r = (int)fmax(-127.0, fmin(127.0, nearbyint(v)));
        ref_sum += r;
        if (q[i] != r) { printf("FAIL quantize n=%d: q[%d] = %d, expected %d\n", n, i, q[i], r); fails++; break; }
    }
    if (sum != ref_sum) { printf("FAIL quantize n=%d: sum %d, expected %d\n", n, sum, ref_sum); fails++; }
    for (int i = 0; i < n; i++) x[i] = i % 2 ? 1e-44f : -1e-45f;   /* denormal amax: the scale underflows to 0 */
    if (ktki_pack_quantize_row(x, n, q, &s) != 0 || s != 0.0f || q[0] != 0) {
        printf("FAIL quantize n=%d: a row of tiny denormals must give scale 0 and q = 0\n", n);
        fails++;
    }
    x[n / 2] = NAN;   /* a NaN anywhere: scale NaN, q = 0 */
    if (n > 0 && (ktki_pack_quantize_row(x, n, q, &s) != 0 || !isnan(s) || q[0] != 0)) {
        printf("FAIL quantize n=%d: a NaN must give scale NaN and q = 0\n", n);
        fails++;
    }
    free(x), free(q);
}

int main(void) {
    const int ns[] = {1, 7, 15, 16, 17, 33, 768, 1000, 2049};
    for (size_t k = 0; k < sizeof ns / sizeof ns[0]; k++) {
        for (int act = KTK_ACT_SILU; act <= KTK_ACT_SWIGLU_LIMIT; act++)
            for (int bias = 0; bias < 2; bias++) check_act(act, ns[k], bias);
        check_quantize(ns[k]);
    }
    if (fails == 0) printf("ok\n");
    return fails != 0;
}
