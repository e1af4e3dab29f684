// Kernel correctness harness (and a small kernel benchmark), self-contained: no library, no Python.
//
// Build and run (from the repository root):
//     cc -O2 -pthread native/tests/test_kernels.c native/src/kernels/*/gemm.c -o /tmp/tk && /tmp/tk
//     /tmp/tk              correctness: every ISA the CPU (and, for AMX, the OS) has, against the generic reference,
//                          which is itself checked against a float64 dot product of the unpacked matrices
//     /tmp/tk bench [T [N K [NMAX]]]  kernel speed on T threads (default 1) for an N x K matrix (default 2048 x 2048,
//                          rows n up to NMAX, default 256):
//                          GB/s and GFLOPS per ISA variant at n = 1..256 rows; "amx tiles" is AMX at every n
//                          (where it overtakes AVX-512 is KTK_AMX_MIN_ROWS_* in native/src/kernels/amx/gemm.c);
//                          TK_ONLY=amx (env) benches only the variants whose name contains "amx"
/*
 * Packs random matrices exactly as native/src/kernels.h describes, on awkward shapes (N, K not multiples of
 * 16 / 64), n = 1..100 rows, column-block ranges that start mid-matrix, ldy wider than the output (sentinels
 * around the output must survive). bf16: error per output relative to sum_c |x_c w_c|; int8 must be exact
 * (same float operations as the reference). Exit code 1 on any failure.
 */
#define _GNU_SOURCE
#include <math.h>
#include <pthread.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <cpuid.h>
#include <unistd.h>
#include <sys/syscall.h>
#include "../include/ktinject.h"
#include "../src/kernels.h"

/* raw paths exported by the ISA files */
void ktk_avx512_gemm_bf16_dp(const ktk_mat *w, int nb0, int nb1, const ktk_act *x, float *y, int64_t ldy);
void ktk_avx512_gemm_int8_vnni(const ktk_mat *w, int nb0, int nb1, const ktk_act *x, float *y, int64_t ldy);
void ktk_amx_gemm_bf16_tiles(const ktk_mat *w, int nb0, int nb1, const ktk_act *x, float *y, int64_t ldy);
void ktk_amx_gemm_int8_tiles(const ktk_mat *w, int nb0, int nb1, const ktk_act *x, float *y, int64_t ldy);

/* ---------------- CPU / OS features ---------------- */
static uint64_t xgetbv0(void) {
    uint32_t a, d;
    __asm__ volatile("xgetbv" : "=a"(a), "=d"(d) : "c"(0));
    return ((uint64_t)d << 32) | a;
}

typedef struct { int avx2, avx512, bf16, vnni, amx; } features;

static features detect(void) {
    features f = {0};
    unsigned a, b, c, d, a1 = 0, b1, c1, d1;
    if (!__get_cpuid(1, &a, &b, &c, &d)) return f;
    int osxsave = (c >> 27) & 1, fma = (c >> 12) & 1;
    if (!osxsave || !__get_cpuid_count(7, 0, &a, &b, &c, &d)) return f;
    if (a >= 1) __get_cpuid_count(7, 1, &a1, &b1, &c1, &d1);
    uint64_t xcr0 = xgetbv0();
    int ymm = (xcr0 & 6) == 6, zmm = ymm && (xcr0 & 0xe0) == 0xe0;
    f.avx2 = ymm && fma && ((b >> 5) & 1);
    f.avx512 = zmm && ((b >> 16) & 1) && ((b >> 30) & 1) && ((b >> 31) & 1);   /* F, BW, VL */
    f.vnni = f.avx512 && ((c >> 11) & 1);
    f.bf16 = f.avx512 && ((a1 >> 5) & 1);
    int amx_hw = ((d >> 24) & 1) && ((d >> 22) & 1) && ((d >> 25) & 1);        /* TILE, BF16, INT8 */
    if (amx_hw && f.bf16 && f.vnni) {
        /* ARCH_REQ_XCOMP_PERM = 0x1023, XFEATURE_XTILEDATA = 18 */
        if (syscall(SYS_arch_prctl, 0x1023, 18) == 0 && ((xgetbv0() >> 17) & 3) == 3) f.amx = 1;
    }
    return f;
}

/* ---------------- packing (kernels.h layout) ---------------- */
typedef struct {
    ktk_mat m;
    float *wf;       /* [N][K] dequantized (bf16 values or q * scale) */
    int8_t *q;       /* int8: [N][K] */
} packed;

static uint64_t rng = 88172645463325252ull;
static uint64_t xr(void) { rng ^= rng << 13; rng ^= rng >> 7; rng ^= rng << 17; return rng; }
static float frand(void) { return (float)((xr() >> 11) * (1.0 / 9007199254740992.0)) * 2.0f - 1.0f; }
static int8_t irand8(void) { return (int8_t)(xr() >> 56); }

static void *xalloc(size_t n) {
    void *p = aligned_alloc(64, (n + 63) / 64 * 64);
    if (!p) { fprintf(stderr, "out of memory\n"); exit(2); }
    memset(p, 0, (n + 63) / 64 * 64);
    return p;
}

static packed pack(int N, int K, int quant) {
    packed p;
    memset(&p, 0, sizeof p);
    int Np = (N + 15) / 16 * 16, Kp = (K + 63) / 64 * 64;
    p.m.N = N; p.m.K = K; p.m.Np = Np; p.m.Kp = Kp; p.m.quant = quant;
    p.wf = xalloc(sizeof(float) * (size_t)N * K);
    if (quant == KTK_QUANT_BF16) {
        uint16_t *d = xalloc(2 * (size_t)Np * Kp);
        for (int n = 0; n < N; n++)
            for (int c = 0; c < K; c++) {
                uint16_t h = ktk_f32_to_bf16(frand());
                p.wf[(size_t)n * K + c] = ktk_bf16_to_f32(h);
                d[((int64_t)(n / 16) * (Kp / 2) + c / 2) * 32 + (n % 16) * 2 + c % 2] = h;
            }
        p.m.data_bf16 = d;
    } else {
        int8_t *d = xalloc((size_t)Np * Kp);
        float *sc = xalloc(sizeof(float) * Np);
        int32_t *ws = xalloc(sizeof(int32_t) * Np);
        p.q = xalloc((size_t)N * K);
        for (int n = 0; n < N; n++) {
            sc[n] = 0.001f + 0.01f * fabsf(frand());
            for (int c = 0; c < K; c++) {
                int8_t v = irand8();
                p.q[(size_t)n * K + c] = v;
                p.wf[(size_t)n * K + c] = v * sc[n];
                ws[n] += v;
                d[((int64_t)(n / 16) * (Kp / 4) + c / 4) * 64 + (n % 16) * 4 + c % 4] = v;
            }
        }
        p.m.data_i8 = d; p.m.scale = sc; p.m.wsum = ws;
    }
    return p;
}

static void unpack_free(packed *p) {
    free((void *)p->m.data_bf16); free((void *)p->m.data_i8); free((void *)p->m.scale); free((void *)p->m.wsum);
    free(p->wf); free(p->q);
}

typedef struct {
    ktk_act a;
    float *xf;       /* [n][K] */
} acts;

static acts make_acts(int n, int K, int Kp, int quant) {
    acts r;
    memset(&r, 0, sizeof r);
    r.a.n = n; r.a.Kp = Kp;
    r.xf = xalloc(sizeof(float) * (size_t)n * K);
    if (quant == KTK_QUANT_BF16) {
        uint16_t *x = xalloc(2 * (size_t)n * Kp);
        for (int t = 0; t < n; t++)
            for (int c = 0; c < K; c++) {
                uint16_t h = ktk_f32_to_bf16(frand() * 4.0f);
                x[(size_t)t * Kp + c] = h;
                r.xf[(size_t)t * K + c] = ktk_bf16_to_f32(h);
            }
        r.a.x_bf16 = x;
    } else {
        int8_t *x = xalloc((size_t)n * Kp);
        float *xs = xalloc(sizeof(float) * n);
        int32_t *sum = xalloc(sizeof(int32_t) * n);
        for (int t = 0; t < n; t++) {
            xs[t] = 0.01f + 0.05f * fabsf(frand());
            for (int c = 0; c < K; c++) {
                int8_t v = irand8();
                x[(size_t)t * Kp + c] = v;
                r.xf[(size_t)t * K + c] = v * xs[t];
                sum[t] += v;
            }
        }
        r.a.x_i8 = x; r.a.x_scale = xs; r.a.x_sum = sum;
    }
    return r;
}

static void acts_free(acts *r) {
    free((void *)r->a.x_bf16); free((void *)r->a.x_i8); free((void *)r->a.x_scale); free((void *)r->a.x_sum);
    free(r->xf);
}

/* ---------------- correctness ---------------- */
typedef struct { const char *name; ktk_gemm_fn fn[2]; } variant;

static int nvariants;
static variant variants[16];
static double worst[16][2];
static int failures;

static void add_variant(const char *name, ktk_gemm_fn bf16, ktk_gemm_fn int8) {
    variants[nvariants].name = name;
    variants[nvariants].fn[0] = bf16;
    variants[nvariants].fn[1] = int8;
    nvariants++;
}

#define SENT (-12345.678f)

/* run fn on rows n of x, blocks [nb0, nb1), into a sentinel-framed buffer; check the frame */
static float *run_framed(ktk_gemm_fn fn, const packed *p, const acts *x, int nb0, int nb1, int64_t ldy,
                         const char *who) {
    int cols = (nb1 - nb0) * 16, n = x->a.n;
    size_t sz = (size_t)(n + 2) * ldy;
    float *buf = xalloc(sizeof(float) * sz);
    for (size_t i = 0; i < sz; i++) buf[i] = SENT;
    float *y = buf + ldy;
    fn(&p->m, nb0, nb1, &x->a, y, ldy);
    for (size_t i = 0; i < sz; i++) {
        int64_t r = (int64_t)i / ldy - 1, c = (int64_t)i % ldy;
        int inside = r >= 0 && r < n && c < cols;
        if (!inside && buf[i] != SENT) {
            printf("FAIL %s: wrote outside its output (row %lld col %lld)\n", who, (long long)r, (long long)c);
            failures++;
            break;
        }
    }
    return buf;
}

static void check_case(int N, int K, int n, int quant, int nb0, int nb1) {
    packed p = pack(N, K, quant);
    acts x = make_acts(n, K, p.m.Kp, quant);
    int64_t ldy = (int64_t)(nb1 - nb0) * 16 + 5;
    int q = quant == KTK_QUANT_INT8;
    char who[160];
    snprintf(who, sizeof who, "generic %s N=%d K=%d n=%d nb=[%d,%d)", q ? "int8" : "bf16", N, K, n, nb0, nb1);
    const ktk_kernels *gen = ktk_kernels_generic();
    float *ref = run_framed(q ? gen->gemm_int8 : gen->gemm_bf16, &p, &x, nb0, nb1, ldy, who);
    float *r = ref + ldy;
    /* generic vs float64 on the unpacked values; padding outputs (j >= N) must be 0 */
    double gerr = 0;
    for (int t = 0; t < n; t++)
        for (int j = nb0 * 16; j < nb1 * 16; j++) {
            double got = r[(int64_t)t * ldy + j - nb0 * 16];
            if (j >= N) { if (got != 0) gerr = INFINITY; continue; }
            double s = 0, sa = 1e-30;
            for (int c = 0; c < K; c++) {
                double v = (double)x.xf[(size_t)t * K + c] * p.wf[(size_t)j * K + c];
                s += v; sa += fabs(v);
            }
            double e = fabs(got - s) / sa;
            if (e > gerr) gerr = e;
        }
    if (!(gerr < 1e-5)) { printf("FAIL %s: vs float64 err %.3g\n", who, gerr); failures++; }
    for (int v = 0; v < nvariants; v++) {
        ktk_gemm_fn fn = variants[v].fn[q];
        if (!fn) continue;
        snprintf(who, sizeof who, "%s %s N=%d K=%d n=%d nb=[%d,%d)", variants[v].name, q ? "int8" : "bf16", N, K,
                 n, nb0, nb1);
        float *out = run_framed(fn, &p, &x, nb0, nb1, ldy, who);
        float *o = out + ldy;
        double err = 0;
        for (int t = 0; t < n; t++)
            for (int j = nb0 * 16; j < nb1 * 16; j++) {
                double a = o[(int64_t)t * ldy + j - nb0 * 16], b = r[(int64_t)t * ldy + j - nb0 * 16], e;
                if (q) {
                    e = a == b ? 0 : fabs(a - b) / (fabs(b) + 1e-30);
                } else {
                    double sa = 1e-30;
                    if (j < N)
                        for (int c = 0; c < K; c++)
                            sa += fabs((double)x.xf[(size_t)t * K + c] * p.wf[(size_t)j * K + c]);
                    e = fabs(a - b) / sa;
                }
                if (!(e <= err)) err = e;    /* NaN-safe */
            }
        if (!(err <= worst[v][q])) worst[v][q] = err;
        double tol = q ? 1e-6 : 1e-4;
        if (!(err <= tol)) { printf("FAIL %s: err %.3g (tol %.0e)\n", who, err, tol); failures++; }
        free(out);
    }
    free(ref);
    acts_free(&x);
    unpack_free(&p);
}

static int run_tests(void) {
    static const int shapes[][2] = {{1, 1}, {16, 64}, {17, 65}, {5, 130}, {33, 200}, {64, 128}, {100, 257},
                                    {250, 1000}, {48, 2048}, {40, 7168}, {130, 96}};
    static const int rows[] = {1, 2, 3, 4, 5, 6, 7, 8, 9, 12, 13, 15, 16, 17, 24, 31, 32, 33, 47, 48, 64, 65, 100};
    int ncases = 0;
    for (int quant = 0; quant < 2; quant++)
        for (size_t s = 0; s < sizeof shapes / sizeof shapes[0]; s++)
            for (size_t ri = 0; ri < sizeof rows / sizeof rows[0]; ri++) {
                int N = shapes[s][0], K = shapes[s][1], n = rows[ri];
                if ((double)N * K * n > 3e7 && ri % 4) continue;   /* keep big shapes to a few row counts */
                int nblk = (N + 15) / 16;
                check_case(N, K, n, quant, 0, nblk);
                ncases++;
                if (nblk >= 2) {
                    int nb0 = 1 + (int)(xr() % (uint64_t)(nblk - 1));
                    int nb1 = nb0 + 1 + (int)(xr() % (uint64_t)(nblk - nb0));
                    check_case(N, K, n, quant, nb0, nb1);
                    ncases++;
                }
            }
    printf("%d cases x %d variants\n", ncases, nvariants);
    printf("%-26s %-16s %-16s\n", "variant", "bf16 max err", "int8 max err");
    for (int v = 0; v < nvariants; v++)
        printf("%-26s %-16.3g %-16.3g\n", variants[v].name, worst[v][0], worst[v][1]);
    printf("(bf16: |y - generic| / sum|x w| per output; int8: relative difference, 0 = bit-exact)\n");
    printf(failures ? "FAILED: %d\n" : "ALL OK\n", failures);
    return failures ? 1 : 0;
}

/* ---------------- benchmark ----------------
 * Calls shaped like the forward's (native/src/forward.c): one call = up to 256 rows x CW column blocks (CW = 4
 * for n <= 4 as in decode, else 8) x all of K; a matrix's calls go round-robin to the threads; the matrices
 * rotate over >= 1 GB so the weights come from memory. GB/s = packed weight bytes / time; GF = 2 n N K / time. */
static double now(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return ts.tv_sec + ts.tv_nsec * 1e-9;
}

typedef struct {
    ktk_gemm_fn fn;
    const packed *mats;
    int nmats, tid, nthreads, cw;
    const acts *x;
    float *y;                 /* this thread's [n][cw * 16] */
    pthread_barrier_t *bar;
} job;

static void *bench_thread(void *arg) {
    job *j = arg;
    pthread_barrier_wait(j->bar);
    int c = 0;
    for (int m = 0; m < j->nmats; m++) {
        const packed *p = &j->mats[m];
        int nblk = p->m.Np / 16;
        for (int b = 0; b < nblk; b += j->cw, c++) {
            if (c % j->nthreads != j->tid) continue;
            int b1 = b + j->cw < nblk ? b + j->cw : nblk;
            j->fn(&p->m, b, b1, &j->x->a, j->y, (int64_t)j->cw * 16);
        }
    }
    pthread_barrier_wait(j->bar);
    return NULL;
}

/* seconds for one pass over nmats matrices on nth threads: median of 5 after a warm-up pass */
static double time_fn(ktk_gemm_fn fn, const packed *mats, int nmats, const acts *x, int cw, int nth) {
    pthread_t th[256];
    job jobs[256];
    pthread_barrier_t bar;
    double ts[6];
    for (int it = 0; it < 6; it++) {
        pthread_barrier_init(&bar, NULL, (unsigned)nth + 1);
        for (int i = 0; i < nth; i++) {
            jobs[i] = (job){fn, mats, nmats, i, nth, cw, x, NULL, &bar};
            jobs[i].y = xalloc(sizeof(float) * (size_t)x->a.n * cw * 16);
            pthread_create(&th[i], NULL, bench_thread, &jobs[i]);
        }
        double t0 = now();       /* before releasing the threads (main may be descheduled after) */
        pthread_barrier_wait(&bar);
        pthread_barrier_wait(&bar);
        ts[it] = now() - t0;
        for (int i = 0; i < nth; i++) { pthread_join(th[i], NULL); free(jobs[i].y); }
        pthread_barrier_destroy(&bar);
    }
    for (int i = 1; i < 6; i++)      /* sort ts[1..5] */
        for (int k = i + 1; k < 6; k++)
            if (ts[k] < ts[i]) { double t = ts[i]; ts[i] = ts[k]; ts[k] = t; }
    return ts[3];
}

static int run_bench(int nth, int N, int K, int nmax) {
    if (nth < 1 || nth > 256) nth = 1;
    const char *only = getenv("TK_ONLY");   /* bench only the variants whose name contains this */
    static const int ns[] = {1, 2, 4, 6, 8, 12, 16, 32, 64, 128, 256};
    printf("kernel bench: %d threads, W %dx%d, calls of <= 256 rows x CW blocks (CW 4 for n <= 4, else 8), "
           "median of 5\n", nth, N, K);
    for (int quant = 0; quant < 2; quant++) {
        size_t bytes = (size_t)((N + 15) / 16 * 16) * ((K + 63) / 64 * 64) * (quant ? 1 : 2);
        int nm = (int)((1ull << 30) / bytes) + 1;
        packed *mats = malloc(sizeof(packed) * nm);
        for (int i = 0; i < nm; i++) {
            mats[i] = pack(N, K, quant);
            free(mats[i].wf); free(mats[i].q);
            mats[i].wf = NULL; mats[i].q = NULL;
        }
        printf("%s: %d matrices (%.2f GB) rotating\n", quant ? "int8" : "bf16", nm, nm * (double)bytes / 1e9);
        for (size_t ni = 0; ni < sizeof ns / sizeof ns[0]; ni++) {
            int n = ns[ni], cw = n <= 4 ? 4 : 8;
            if (n > nmax) break;
            /* memory-bound n: all matrices; compute-bound n: enough for ~2 GFLOP per thread per pass */
            int mlim = n <= 8 ? nm : (int)(2e9 * nth / (2.0 * n * N * K));
            mlim = mlim < 8 ? 8 : mlim > nm ? nm : mlim;
            acts x = make_acts(n, K, mats[0].m.Kp, quant);
            printf("  n=%-4d", n);
            for (int v = 0; v < nvariants; v++) {
                ktk_gemm_fn fn = variants[v].fn[quant];
                int gen = !strcmp(variants[v].name, "generic");
                if (!fn || (gen && n > 1) || !strcmp(variants[v].name, "amx (table)")) continue;
                if (only && !strstr(variants[v].name, only)) continue;
                int m = gen ? 2 : mlim;
                double dt = time_fn(fn, mats, m, &x, cw, nth) / m;
                printf(" | %s %.1f GB/s %.0f GF", variants[v].name, bytes / dt * 1e-9, 2.0 * n * N * K / dt * 1e-9);
            }
            printf("\n");
            fflush(stdout);
            acts_free(&x);
        }
        for (int i = 0; i < nm; i++) unpack_free(&mats[i]);
        free(mats);
    }
    return 0;
}

int main(int argc, char **argv) {
    features f = detect();
    printf("cpu: avx2 %d avx512 %d avx512_bf16 %d avx512_vnni %d amx(+os) %d\n", f.avx2, f.avx512, f.bf16, f.vnni,
           f.amx);
    add_variant("generic", ktk_kernels_generic()->gemm_bf16, ktk_kernels_generic()->gemm_int8);
    if (f.avx2) add_variant("avx2", ktk_kernels_avx2()->gemm_bf16, ktk_kernels_avx2()->gemm_int8);
    if (f.avx512) {
        setenv("KTINJECT_AVX512_PLAIN", "1", 1);
        const ktk_kernels *plain = ktk_kernels_avx512();
        unsetenv("KTINJECT_AVX512_PLAIN");
        add_variant("avx512 (plain F/BW)", plain->gemm_bf16, plain->gemm_int8);
        const ktk_kernels *best = ktk_kernels_avx512();
        if (best != plain) add_variant(best->name, best->gemm_bf16, best->gemm_int8);
        /* the vdpbf16ps / vpdpbusd kernels even where the table does not pick them (vdpbf16ps on AMX CPUs) */
        ktk_gemm_fn dp = f.bf16 && best->gemm_bf16 != ktk_avx512_gemm_bf16_dp ? ktk_avx512_gemm_bf16_dp : NULL;
        ktk_gemm_fn vn = f.vnni && best->gemm_int8 != ktk_avx512_gemm_int8_vnni ? ktk_avx512_gemm_int8_vnni : NULL;
        if (dp || vn) add_variant("avx512 dp/vnni (raw)", dp, vn);
    }
    if (f.amx) {
        add_variant("amx (table)", ktk_kernels_amx()->gemm_bf16, ktk_kernels_amx()->gemm_int8);
        add_variant("amx tiles (any n)", ktk_amx_gemm_bf16_tiles, ktk_amx_gemm_int8_tiles);
    }
    if (argc > 1 && !strcmp(argv[1], "bench"))
        return run_bench(argc > 2 ? atoi(argv[2]) : 1, argc > 3 ? atoi(argv[3]) : 2048, argc > 4 ? atoi(argv[4]) : 2048,
                         argc > 5 ? atoi(argv[5]) : 256);
    return run_tests();
}
