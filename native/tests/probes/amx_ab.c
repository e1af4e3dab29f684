/* A/B of AMX kernel variants on forward-shaped work (not a test). Each variant is native/src/kernels/amx/gemm.c
 * built with other macros and its symbols renamed (see amx_ab.sh, which writes the variant list to
 * /tmp/amx_ab_variants.h); the variants run interleaved, round after round, so host noise hits them alike.
 * Work: a DeepSeek-V3 MoE layer's prefill on E experts of n rows each (H 7168, I 2048): the gate/up phase (items of
 * (expert, 8 column blocks), gate then up) and the down phase (items of 4 column blocks of H, every expert), items
 * claimed from an atomic counter by threads pinned to CPUs 0..T-1. Prints TFLOPS (bf16) / TOPS (int8) per variant:
 * the median over rounds, and the min-max. */
#define _GNU_SOURCE
#include <pthread.h>
#include <sched.h>
#include <stdatomic.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>
#include <sys/syscall.h>
#include "../../include/ktinject.h"
#include "../../src/kernels/kernels.h"

#define V(name) void v_##name##_bf16(const ktk_mat *, int, int, const ktk_act *, float *, int64_t); \
                void v_##name##_int8(const ktk_mat *, int, int, const ktk_act *, float *, int64_t);
#include "/tmp/amx_ab_variants.h"
#undef V
typedef struct { const char *name; ktk_gemm_fn fn[2]; } variant;
#define V(name) {#name, {v_##name##_bf16, v_##name##_int8}},
static const variant variants[] = {
#include "/tmp/amx_ab_variants.h"
};
#undef V
#define NV ((int)(sizeof variants / sizeof variants[0]))

enum { H = 7168, I = 2048 };
static int E = 32, NROWS = 128, NT = 16;

typedef struct { ktk_mat gate, up, down; } expert;
static expert *ex[2];
static ktk_act xin[2][2], hin[2][2];   /* [quant][tiles] */

static double now(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return t.tv_sec + t.tv_nsec * 1e-9;
}

static void *xalloc(size_t n) {
    void *p = aligned_alloc(64, (n + 63) & ~(size_t)63);
    if (!p) { fprintf(stderr, "out of memory\n"); exit(1); }
    return p;
}

static void fill(void *p, size_t bytes, int quant, uint64_t seed) {   /* small bf16 values / int8 in [-64, 63] */
    uint64_t s = seed * 0x9E3779B97F4A7C15ull + 1, *w = p;
    for (size_t i = 0; i < bytes / 8; i++) {
        s = s * 6364136223846793005ull + 1442695040888963407ull;
        uint64_t r = s >> 1;
        w[i] = quant ? (r & 0x3f3f3f3f3f3f3f3full)
                     : (r & 0x007f007f007f007full) | 0x3c003c003c003c00ull;
    }
}

static ktk_mat make_mat(int N, int K, int quant, uint64_t seed) {
    ktk_mat m;
    memset(&m, 0, sizeof m);
    m.N = N, m.K = K, m.Np = N, m.Kp = K, m.quant = quant ? KTK_QUANT_INT8 : KTK_QUANT_BF16;
    size_t bytes = (size_t)N * K * (quant ? 1 : 2);
    void *d = xalloc(bytes);
    fill(d, bytes, quant, seed);
    if (quant) {
        float *sc = xalloc(sizeof(float) * N);
        int32_t *ws = xalloc(sizeof(int32_t) * N);
        for (int i = 0; i < N; i++) sc[i] = 1e-3f, ws[i] = 0;
        m.data_i8 = d, m.scale = sc, m.wsum = ws;
    } else {
        m.data_bf16 = d;
    }
    return m;
}

static ktk_act make_act(int n, int K, int quant, uint64_t seed) {
    ktk_act a;
    memset(&a, 0, sizeof a);
    a.n = n, a.Kp = K;
    size_t bytes = (size_t)n * K * (quant ? 1 : 2);
    void *d = xalloc(bytes);
    fill(d, bytes, quant, seed);
    if (quant) {
        float *sc = xalloc(sizeof(float) * n);
        int32_t *sm = xalloc(sizeof(int32_t) * n);
        for (int i = 0; i < n; i++) sc[i] = 1e-2f, sm[i] = 0;
        a.x_i8 = d, a.x_scale = sc, a.x_sum = sm;
    } else {
        a.x_bf16 = d;
    }
    return a;
}

static ktk_act with_tiles(ktk_act a, int quant) {   /* the tile-order copy of kernels.h */
    const int64_t rb = (int64_t)a.Kp * (quant ? 1 : 2), steps = rb / 64;
    char *t = xalloc((size_t)((a.n + 15) / 16) * 16 * rb);
    const char *src = quant ? (const char *)a.x_i8 : (const char *)a.x_bf16;
    for (int r = 0; r < a.n; r++)
        for (int64_t s = 0; s < steps; s++)
            memcpy(t + ((r / 16) * steps + s) * 1024 + (r % 16) * 64, src + r * rb + s * 64, 64);
    a.tiles = t;
    return a;
}

typedef struct { int phase, quant, tiles, tid; ktk_gemm_fn fn; } job;
static _Atomic int64_t next_item;
static pthread_barrier_t bar;

static void *worker(void *arg) {
    job *j = arg;
    cpu_set_t set;
    CPU_ZERO(&set);
    CPU_SET(j->tid % (int)sysconf(_SC_NPROCESSORS_ONLN), &set);
    pthread_setaffinity_np(pthread_self(), sizeof set, &set);
    syscall(SYS_arch_prctl, 0x1023, 18);
    float *y = xalloc(sizeof(float) * 256 * 8 * 16);
    const int q = j->quant, tl = j->tiles;
    pthread_barrier_wait(&bar);
    if (j->phase == 0) {   /* gate/up: (expert, 8 blocks of I) */
        const int64_t total = (int64_t)E * (I / 128);
        for (int64_t it; (it = atomic_fetch_add(&next_item, 1)) < total;) {
            const int e = (int)(it / (I / 128)), b0 = (int)(it % (I / 128)) * 8;
            j->fn(&ex[q][e].gate, b0, b0 + 8, &xin[q][tl], y, 128);
            j->fn(&ex[q][e].up, b0, b0 + 8, &xin[q][tl], y, 128);
        }
    } else {               /* down: 4 blocks of H, every expert */
        const int64_t total = H / 64;
        for (int64_t it; (it = atomic_fetch_add(&next_item, 1)) < total;)
            for (int e = 0; e < E; e++) j->fn(&ex[q][e].down, (int)it * 4, (int)it * 4 + 4, &hin[q][tl], y, 64);
    }
    pthread_barrier_wait(&bar);
    free(y);
    return NULL;
}

static double run_phase(ktk_gemm_fn fn, int quant, int tiles, int phase) {
    pthread_t th[256];
    job jobs[256];
    pthread_barrier_init(&bar, NULL, (unsigned)NT + 1);
    atomic_store(&next_item, 0);
    for (int i = 0; i < NT; i++) {
        jobs[i] = (job){phase, quant, tiles, i, fn};
        pthread_create(&th[i], NULL, worker, &jobs[i]);
    }
    pthread_barrier_wait(&bar);
    double t0 = now();
    pthread_barrier_wait(&bar);
    double dt = now() - t0;
    for (int i = 0; i < NT; i++) pthread_join(th[i], NULL);
    pthread_barrier_destroy(&bar);
    return dt;
}

static int cmp(const void *a, const void *b) {
    double x = *(const double *)a, y = *(const double *)b;
    return (x > y) - (x < y);
}

int main(int argc, char **argv) {
    if (syscall(SYS_arch_prctl, 0x1023, 18)) { fprintf(stderr, "no AMX permission\n"); return 1; }
    int rounds = argc > 1 ? atoi(argv[1]) : 7;
    if (getenv("AB_E")) E = atoi(getenv("AB_E"));
    if (getenv("AB_ROWS")) NROWS = atoi(getenv("AB_ROWS"));
    if (getenv("AB_THREADS")) NT = atoi(getenv("AB_THREADS"));
    const char *quants = getenv("AB_QUANT") ? getenv("AB_QUANT") : "bf16,int8";
    printf("AMX A/B: DeepSeek-V3 layer shapes, %d experts x %d rows, %d threads, %d rounds\n", E, NROWS, NT, rounds);
    for (int q = 0; q < 2; q++) {
        if (!strstr(quants, q ? "int8" : "bf16")) continue;
        ex[q] = xalloc(sizeof(expert) * E);
        for (int e = 0; e < E; e++)
            ex[q][e] = (expert){make_mat(I, H, q, 3 * e + 1), make_mat(I, H, q, 3 * e + 2), make_mat(H, I, q, 3 * e + 3)};
        xin[q][0] = make_act(NROWS, H, q, 7);
        hin[q][0] = make_act(NROWS, I, q, 8);
        xin[q][1] = with_tiles(xin[q][0], q);
        hin[q][1] = with_tiles(hin[q][0], q);
        const double flop = 2.0 * NROWS * E * 3.0 * H * I;
        const int nv = 2 * NV;   /* each variant on rows, then on tiles */
        double (*t)[2] = calloc((size_t)nv * rounds, sizeof *t);
        for (int v = 0; v < nv; v++) run_phase(variants[v / 2].fn[q], q, v % 2, 0);   /* warm-up */
        for (int r = 0; r < rounds; r++)
            for (int k = 0; k < nv; k++) {
                const int v = (k + r) % nv;
                t[v * rounds + r][0] = run_phase(variants[v / 2].fn[q], q, v % 2, 0);
                t[v * rounds + r][1] = run_phase(variants[v / 2].fn[q], q, v % 2, 1);
            }
        printf("%s: %s per variant, median [min-max] over rounds: gate/up | down | layer\n", q ? "int8" : "bf16",
               q ? "TOPS" : "TFLOPS");
        for (int v = 0; v < nv; v++) {
            double gu[64], dn[64], all[64];
            for (int r = 0; r < rounds && r < 64; r++) {
                gu[r] = flop * 2 / 3 / t[v * rounds + r][0] / 1e12;
                dn[r] = flop / 3 / t[v * rounds + r][1] / 1e12;
                all[r] = flop / (t[v * rounds + r][0] + t[v * rounds + r][1]) / 1e12;
            }
            qsort(gu, rounds, sizeof(double), cmp);
            qsort(dn, rounds, sizeof(double), cmp);
            qsort(all, rounds, sizeof(double), cmp);
            printf("  %-10s %-5s %6.2f [%5.2f-%5.2f] | %6.2f [%5.2f-%5.2f] | %6.2f [%5.2f-%5.2f]\n", variants[v / 2].name,
                   v % 2 ? "tiles" : "rows", gu[rounds / 2], gu[0], gu[rounds - 1], dn[rounds / 2], dn[0], dn[rounds - 1], all[rounds / 2],
                   all[0], all[rounds - 1]);
        }
        fflush(stdout);
        free(t);
    }
    return 0;
}
