/* Speed of one thread in the AVX-512 decode kernels (gemv.c) on cache-hot weights, in GB/s of stored weights and
 * ns per 64-byte line: whether the decode kernels are bound by instructions rather than by memory (not a test;
 * random bytes, speed only). Shapes of a Qwen3-30B-A3B expert: gate + up (M = 2 matrices of N x 2048) and the
 * down matrices of up to 8 experts (M = 8 of 2048 x 768), N outputs (256: cache-hot). Build and run from the
 * repository root:
 *     cc -O2 -pthread -Inative/src native/tests/probes/gemv_probe.c native/src/kernels/{generic,avx2,avx512,amx}/\*.c \
 *        -lm -o /tmp/gemv_probe && /tmp/gemv_probe
 */
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "kernels/kernels.h"
#include "kernels/avx512/gemv.h"

static double now(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return t.tv_sec + t.tv_nsec * 1e-9;
}

static void run(int q8, int M, int N, int K, int iters) {
    const int G = 64, ng = K / G;
    ktk_mat w[8];
    const ktk_mat *wp[8];
    ktk_act x[8];
    const ktk_act *xp[8];
    float *y[8], xs = 0.01f;
    int8_t *xi = aligned_alloc(64, (size_t)K);
    for (int i = 0; i < K; i++) xi[i] = (int8_t)(rand() % 200 - 100);
    for (int m = 0; m < M; m++) {
        memset(&w[m], 0, sizeof w[m]);
        w[m].Np = N, w[m].Kp = K, w[m].group = G;
        if (q8) {
            int8_t *d = aligned_alloc(64, (size_t)N * K);
            for (size_t i = 0; i < (size_t)N * K; i++) d[i] = (int8_t)rand();
            float *s = aligned_alloc(64, (size_t)N * 4);
            int32_t *ws = aligned_alloc(64, (size_t)N * 4);
            for (int i = 0; i < N; i++) s[i] = 0.01f, ws[i] = 0;
            w[m].data_i8 = d, w[m].scale = s, w[m].wsum = ws;
        } else {
            uint8_t *d = aligned_alloc(64, (size_t)N * K / 2);
            for (size_t i = 0; i < (size_t)N * K / 2; i++) d[i] = (uint8_t)rand();
            float *s = aligned_alloc(64, (size_t)N * ng * 4);
            for (size_t i = 0; i < (size_t)N * ng; i++) s[i] = 0.01f;
            w[m].data_i4 = d, w[m].scale = s;
        }
        memset(&x[m], 0, sizeof x[m]);
        x[m].n = 1, x[m].Kp = K, x[m].x_i8 = xi, x[m].x_scale = &xs;
        wp[m] = &w[m], xp[m] = &x[m];
        y[m] = aligned_alloc(64, (size_t)N * 4);
    }
    double best = 1e9;
    for (int rep = 0; rep < 7; rep++) {
        const double t0 = now();
        for (int i = 0; i < iters; i++) {
            if (q8) ktk_avx512_gemv_int8_vnni(M, wp, 0, N / 16, xp, y);
            else ktk_avx512_gemv_int4_vnni(M, wp, 0, N / 16, xp, y);
        }
        const double t = (now() - t0) / iters;
        if (t < best) best = t;
    }
    const double bytes = (double)M * N * K * (q8 ? 1.0 : 0.5) + (q8 ? 0.0 : (double)M * N * ng * 4);
    printf("%s M=%d N=%d K=%d: %.2f us a call, %.1f GB/s, %.2f ns a 64-byte line of weights\n", q8 ? "int8" : "int4",
           M, N, K, best * 1e6, bytes / best / 1e9, best * 1e9 / (bytes / 64));
    for (int m = 0; m < M; m++) {
        free((void *)(q8 ? (const void *)w[m].data_i8 : (const void *)w[m].data_i4));
        free((void *)w[m].scale);
        free((void *)w[m].wsum);
        free(y[m]);
    }
    free(xi);
}

int main(void) {
    run(0, 2, 256, 2048, 2000);   /* int4 gate + up */
    run(0, 8, 256, 768, 2000);    /* int4 down of 8 experts */
    run(0, 1, 256, 2048, 4000);   /* int4, one matrix */
    run(1, 2, 256, 2048, 2000);   /* int8 gate + up */
    run(1, 8, 256, 768, 2000);    /* int8 down of 8 experts */
    return 0;
}
