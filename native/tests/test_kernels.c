// Kernel correctness harness (its CPU features and packed test data: test_kernels_pack.h; a small kernel benchmark:
// test_kernels_bench.h), self-contained: no library, no Python.
//
// Build and run (from the repository root):
//     cc -O2 -pthread -DKTK_TEST_BUILD native/tests/test_kernels.c native/src/kernels/*/*.c -lm -o /tmp/tk && /tmp/tk
//     /tmp/tk              correctness: every ISA the CPU (and, for AMX, the OS) has, against the generic reference,
//                          which is itself checked against a float64 dot product of the unpacked matrices
//     /tmp/tk bench [T [N K [NMAX]]]  kernel speed on T threads (default 1) for an N x K matrix (default 2048 x 2048,
//                          rows n up to NMAX, default 256):
//                          GB/s and GFLOPS per ISA variant at n = 1..256 rows; "amx tiles" is AMX at every n
//                          (where it overtakes AVX-512 is KTK_AMX_MIN_ROWS_* in native/src/kernels/amx/amx.h);
//                          TK_ONLY=amx (env) benches only the variants whose name contains "amx", TK_QUANT=int4
//                          only int4 (a comma list of bf16, int8, int4);
//                          int4 (G = 64) and fp8 (G = 128, 128 rows per scale) run each variant twice: its direct
//                          kernel and "dq", the dequantizing path (forced; where it overtakes direct is
//                          KTK_*_INT4_DEQUANT_ROWS in kernels/*/int4.c, KTK_*_FP8_DEQUANT_ROWS in kernels/*/fp8.c and
//                          amx/amx.h)
/*
 * Packs random matrices exactly as native/src/kernels/kernels.h describes, on awkward shapes (N, K not multiples of
 * 16 / 64), n = 1..100 rows, column-block ranges that start mid-matrix, ldy wider than the output (sentinels
 * around the output must survive). bf16: error per output relative to sum_c |x_c w_c|; int8 must be exact
 * (same float operations as the reference). int4 (G = 32, 64, 128 in turn): the direct path must be exact; the
 * dequantizing path (forced, workspace of 1-4 blocks so calls take several chunks) rounds weights to bf16 (8
 * significant bits: relative error <= 2^-8), so against the direct result its error relative to sum_c |x_c w_c|
 * is at most 2^-8 + fp32 sums: tolerance 4.5e-3; against float64 on the bf16-rounded weights, 1e-4 (fp32 sums).
 * fp8 (G = 128 and 32, 128 and 16 rows per scale in turn; every e4m3 code but NaN, rows of x scaled far from 1): the
 * generic kernel against float64 of the dequantized weights; each ISA's direct path must be bit-exact against it
 * (workspaces of 0 rows up to more than n: chunks of rows, the generic fallback), its dequantizing path as int4's,
 * its dequantization the generic one's bits; gemv against gemm with one row as for the other quants. Half the fp8
 * cases are remapped as a checkpoint looks (few subnormal codes, so most 64-byte lines hold none) with rows of
 * zeros and of +-448. The vdpbf16ps kernels of fp8_bf16.c ("avx512 fp8 dp (raw)", run wherever the CPU has
 * AVX512_BF16 and VBMI, whether or not the table picks them) must be bit-exact where a probe finds vdpbf16ps
 * rounding as Intel documents it (dp_rounds_as_documented); elsewhere they are held to |y - generic| / sum_c |x_c
 * w_c| <= 1e-5 (the generic kernel's own bound against float64) and how many outputs matched bit for bit is
 * printed. Their gemv must match their direct kernel with one row bit for bit.
 * Prints the ISAs it ran and those it could not (not on this CPU). Exit code 1 on any failure.
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
#include <immintrin.h>
#include <unistd.h>
#include <sys/syscall.h>
#include "../include/ktinject.h"
#include "../src/kernels/kernels.h"

#ifndef KTK_TEST_BUILD   /* the library's test hooks (KTINJECT_TEST_DELAY, ...) compile only into test builds */
#error "build the native tests with -DKTK_TEST_BUILD (see the build line above)"
#endif

/* raw paths exported by the ISA files */
void ktk_avx512_gemm_bf16_dp(const ktk_mat *w, int nb0, int nb1, const ktk_act *x, float *y, int64_t ldy);
void ktk_avx512_gemm_int8_vnni(const ktk_mat *w, int nb0, int nb1, const ktk_act *x, float *y, int64_t ldy);
void ktk_amx_gemm_bf16_tiles(const ktk_mat *w, int nb0, int nb1, const ktk_act *x, float *y, int64_t ldy);
void ktk_amx_gemm_int8_tiles(const ktk_mat *w, int nb0, int nb1, const ktk_act *x, float *y, int64_t ldy);
void ktk_avx512_gemm_int4_plain(const ktk_mat *w, int nb0, int nb1, const ktk_act *x, float *y, int64_t ldy);
void ktk_avx512_gemm_int4_vnni(const ktk_mat *w, int nb0, int nb1, const ktk_act *x, float *y, int64_t ldy);
void ktk_avx512_dequant_int4(const ktk_mat *w, int nb0, int nb1, uint16_t *dst);
void ktk_avx512_dequant_int4_plain(const ktk_mat *w, int nb0, int nb1, uint16_t *dst);
void ktk_avx2_dequant_fp8(const ktk_mat *w, int nb0, int nb1, uint16_t *dst);
#include "../src/kernels/avx512/fp8.h"

#include "test_kernels_pack.h"
#include "test_kernels_mxfp4.h"

/* ---------------- correctness ---------------- */
typedef struct { const char *name; ktk_gemm_fn fn[4]; int fp8_tol; } variant;   /* by quant: bf16, int8, int4, fp8;
                                                                        fp8_tol: direct fp8 to 1e-5, not bits */

#define NCOL 6
static int nvariants;
static variant variants[16];
static double worst[16][NCOL];   /* bf16, int8, int4 direct, int4 dequantizing, fp8 direct, fp8 dequantizing */
static int failures;
static const char *const COL[NCOL] = {"bf16", "int8", "int4", "int4 dq", "fp8", "fp8 dq"};
static const char *const QNAME[4] = {"bf16", "int8", "int4", "fp8"};   /* by KTK_QUANT_* */
static int avx512_dequant;    /* check ktk_avx512_dequant_int4 / _fp8 against the generic ones */
static int avx2_dequant;      /* check ktk_avx2_dequant_fp8 against the generic one */
static int64_t dp_outputs, dp_same;   /* fp8 outputs of the tolerance variants, of which bit-identical to generic */
static int dp_exact;          /* vdpbf16ps rounds as documented: fp8_bf16.c's kernels must be bit-exact */

static void add_variant(const char *name, ktk_gemm_fn bf16, ktk_gemm_fn int8, ktk_gemm_fn int4, ktk_gemm_fn fp8) {
    variants[nvariants] = (variant){name, {bf16, int8, int4, fp8}};
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

/* sum_c |x_c w_c| (bf16w: w rounded to bf16) and sum_c x_c w_c of row t, output j, in float64 */
static double dot64(const packed *p, const acts *x, int t, int j, int bf16w, double *sa) {
    const int K = p->m.K;
    double s = 0;
    *sa = 1e-30;
    for (int c = 0; c < K; c++) {
        float w = p->wf[(size_t)j * K + c];
        double v = (double)x->xf[(size_t)t * K + c] * (bf16w ? ktk_bf16_to_f32(ktk_f32_to_bf16(w)) : w);
        s += v; *sa += fabs(v);
    }
    return s;
}

/* The tile-order copy of x (kernels.h, "tiles") of its bf16 (es 2) or int8 (es 1) rows; free() it. */
static void *make_tiles(const ktk_act *a, int es) {
    const int64_t rb = (int64_t)a->Kp * es, steps = rb / 64;
    const char *src = es == 2 ? (const char *)a->x_bf16 : (const char *)a->x_i8;
    char *t = xalloc((size_t)((a->n + 15) / 16) * 16 * rb);
    memset(t, 0x7f, (size_t)((a->n + 15) / 16) * 16 * rb);   /* rows past n: content unused */
    for (int r = 0; r < a->n; r++)
        for (int64_t s = 0; s < steps; s++)
            memcpy(t + ((r / 16) * steps + s) * 1024 + (r % 16) * 64, src + r * rb + s * 64, 64);
    return t;
}

/* Dequantization of an ISA (int4 or fp8) against the generic one: the same bits */
static void check_dequant(ktk_dequant_fn gen, ktk_dequant_fn fn, const char *name, const packed *p, int nb0, int nb1,
                          const char *who) {
    size_t sz = (size_t)(nb1 - nb0) * 16 * p->m.Kp;
    uint16_t *a = xalloc(2 * sz), *b = xalloc(2 * sz);
    gen(&p->m, nb0, nb1, a);
    fn(&p->m, nb0, nb1, b);
    if (memcmp(a, b, 2 * sz)) {
        printf("FAIL %s %s: differs from generic\n", name, who);
        failures++;
    }
    free(a); free(b);
}

/* col: 0 bf16, 1 int8, 2 int4 direct, 3 int4 dequantizing (forced, workspace of 1-4 blocks), 4 fp8 direct
 * (workspace of 0..n + 3 rows), 5 fp8 dequantizing (forced, 1-4 blocks); G: int4 / fp8 group, br: fp8 block rows */
static void check_case(int N, int K, int n, int col, int G, int br, int nb0, int nb1) {
    const int quant = col < 2 ? col : col < 4 ? KTK_QUANT_INT4 : KTK_QUANT_FP8, dq = col == 3 || col == 5;
    const int exact = col == 1 || col == 2 || col == 4;
    packed p = pack(N, K, quant, G, br);
    if (quant == KTK_QUANT_FP8 && xr() % 2) fp8_checkpoint_like(&p);
    acts x = make_acts(n, K, p.m.Kp, quant);
    int64_t ldy = (int64_t)(nb1 - nb0) * 16 + 5;
    char who[160], what[32];
    if (quant == KTK_QUANT_FP8) snprintf(what, sizeof what, "%s G=%d br=%d", COL[col], G, br);
    else snprintf(what, sizeof what, quant == KTK_QUANT_INT4 ? "%s G=%d" : "%s", COL[col], G);
    snprintf(who, sizeof who, "generic %s N=%d K=%d n=%d nb=[%d,%d)", what, N, K, n, nb0, nb1);
    x.a.int4_path = KTK_INT4_PATH_DIRECT;
    x.a.fp8_path = KTK_FP8_PATH_DIRECT;
    float *ref = run_framed(variants[0].fn[quant], &p, &x, nb0, nb1, ldy, who);   /* variants[0]: generic */
    float *r = ref + ldy;
    /* generic vs float64 on the unpacked values; padding outputs (j >= N) must be 0 */
    double gerr = 0, sa;
    for (int t = 0; t < n; t++)
        for (int j = nb0 * 16; j < nb1 * 16; j++) {
            double got = r[(int64_t)t * ldy + j - nb0 * 16];
            if (j >= N) { if (got != 0) gerr = INFINITY; continue; }
            double e = fabs(got - dot64(&p, &x, t, j, 0, &sa)) / sa;
            if (e > gerr) gerr = e;
        }
    if (!(gerr < 1e-5)) { printf("FAIL %s: vs float64 err %.3g\n", who, gerr); failures++; }
    if (col == 3 && avx512_dequant) {   /* same bits as the generic dequantization (the table's and the plain one) */
        check_dequant(ktk_generic_dequant_int4, ktk_avx512_dequant_int4, "avx512 dequant", &p, nb0, nb1, who);
        check_dequant(ktk_generic_dequant_int4, ktk_avx512_dequant_int4_plain, "avx512 dequant (plain)", &p, nb0, nb1,
                      who);
    }
    if (col == 5 && avx512_dequant)
        check_dequant(ktk_generic_dequant_fp8, ktk_avx512_dequant_fp8, "avx512 fp8 dequant", &p, nb0, nb1, who);
    if (col == 5 && avx2_dequant)
        check_dequant(ktk_generic_dequant_fp8, ktk_avx2_dequant_fp8, "avx2 fp8 dequant", &p, nb0, nb1, who);
    if (dq) {
        int blocks = 1 + (int)(xr() % 4);
        x.a.work_bytes = ktk_int4_work_bytes(p.m.Kp, blocks);
        x.a.work = xalloc((size_t)x.a.work_bytes);
        x.a.int4_path = KTK_INT4_PATH_DEQUANT;
        x.a.fp8_path = KTK_FP8_PATH_DEQUANT;
    } else if (col == 4 && xr() % 8) {   /* float rows for 1..n + 3 rows (1 in 8: none, the generic fallback) */
        x.a.work_bytes = ktk_fp8_rows_bytes(p.m.Kp, 1 + (int)(xr() % (uint64_t)(n + 3)));
        x.a.work = xalloc((size_t)x.a.work_bytes);
    }
    for (int v = 0; v < nvariants; v++) {
        ktk_gemm_fn fn = variants[v].fn[quant];
        if (!fn) continue;
        snprintf(who, sizeof who, "%s %s N=%d K=%d n=%d nb=[%d,%d)", variants[v].name, what, N, K, n, nb0, nb1);
        float *out = run_framed(fn, &p, &x, nb0, nb1, ldy, who);
        float *o = out + ldy;
        double err = 0, err_bf16w = 0;
        const int tol_dp = col == 4 && variants[v].fp8_tol;
        for (int t = 0; t < n; t++)
            for (int j = nb0 * 16; j < nb1 * 16; j++) {
                double a = o[(int64_t)t * ldy + j - nb0 * 16], b = r[(int64_t)t * ldy + j - nb0 * 16], e;
                if (tol_dp) {
                    dp_outputs++;
                    dp_same += memcmp(&o[(int64_t)t * ldy + j - nb0 * 16], &r[(int64_t)t * ldy + j - nb0 * 16], 4) == 0;
                    if (j < N) dot64(&p, &x, t, j, 0, &sa); else sa = 1e-30;
                    e = fabs(a - b) / sa;
                } else if (exact) {
                    e = a == b ? 0 : fabs(a - b) / (fabs(b) + 1e-30);
                } else {
                    double s = j < N ? dot64(&p, &x, t, j, dq, &sa) : 0;
                    if (j >= N) sa = 1e-30;
                    e = fabs(a - b) / sa;
                    if (dq && !(fabs(a - s) / sa <= err_bf16w)) err_bf16w = fabs(a - s) / sa;   /* vs bf16(w) */
                }
                if (!(e <= err)) err = e;    /* NaN-safe */
            }
        if ((strstr(variants[v].name, "amx") || v == 0) && col != 2) {   /* x in tile order: the same bits */
            x.a.tiles = make_tiles(&x.a, col == 1 ? 1 : 2);
            float *out_t = run_framed(fn, &p, &x, nb0, nb1, ldy, who);
            if (memcmp(out_t, out, sizeof(float) * (size_t)(n + 2) * ldy)) {
                printf("FAIL %s: with x in tile order differs from x in rows\n", who);
                failures++;
            }
            free(out_t);
            free((void *)x.a.tiles);
            x.a.tiles = NULL;
        }
        if (!(err <= worst[v][col])) worst[v][col] = err;
        double tol = col == 0 ? 1e-4 : dq ? 4.5e-3 : tol_dp ? 1e-5 : col == 4 ? 0 : 1e-6;
        if (!(err <= tol) || !(err_bf16w <= 1e-4)) {
            printf("FAIL %s: err %.3g (tol %.0e), vs bf16-rounded weights %.3g\n", who, err, tol, err_bf16w);
            failures++;
        }
        free(out);
    }
    free(ref);
    acts_free(&x);
    unpack_free(&p);
}

/* gemv (several matrices, one row each): bit-identical to the same table's gemm with one row, for M = 1..8
 * matrices of one shape, block ranges that start mid-matrix, outputs framed by sentinels (fp8: the M float rows in
 * x[0]'s workspace, or, for odd M, a workspace of one row: the per-matrix fallback). */
static int gemv_cases;
static void check_gemv(const char *name, const ktk_kernels *t) {
    static const int shapes[][2] = {{1, 1}, {17, 65}, {33, 200}, {100, 257}, {48, 2048}, {40, 7168}, {130, 96}};
    for (int quant = 0; quant < 4; quant++) {
        const ktk_gemv_fn gvs[4] = {t->gemv_bf16, t->gemv_int8, t->gemv_int4, t->gemv_fp8};
        const ktk_gemm_fn gms[4] = {t->gemm_bf16, t->gemm_int8, t->gemm_int4, t->gemm_fp8};
        ktk_gemv_fn gv = gvs[quant];
        ktk_gemm_fn gm = gms[quant];
        if (!gv) continue;
        for (size_t s = 0; s < sizeof shapes / sizeof shapes[0]; s++)
            for (int M = 1; M <= KTK_GEMV_MAX; M++) {
                const int N = shapes[s][0], K = shapes[s][1], nblk = (N + 15) / 16;
                const int G = quant == KTK_QUANT_FP8 ? (gemv_cases % 2 ? 32 : 128) : 32 << (gemv_cases % 3);
                const int br = gemv_cases % 4 < 2 ? 128 : 16;
                const int nb0 = nblk > 1 ? (int)(xr() % (uint64_t)nblk) : 0;
                const int nb1 = nb0 + 1 + (int)(xr() % (uint64_t)(nblk - nb0)), cols = (nb1 - nb0) * 16;
                packed p[KTK_GEMV_MAX];
                acts x[KTK_GEMV_MAX];
                const ktk_mat *w[KTK_GEMV_MAX];
                const ktk_act *xa[KTK_GEMV_MAX];
                float *buf[KTK_GEMV_MAX], *y[KTK_GEMV_MAX];
                for (int m = 0; m < M; m++) {
                    p[m] = pack(N, K, quant, G, br);
                    x[m] = make_acts(1, K, p[m].m.Kp, quant);
                    x[m].a.int4_path = KTK_INT4_PATH_DIRECT;
                    x[m].a.fp8_path = KTK_FP8_PATH_DIRECT;
                    if (quant == KTK_QUANT_FP8) {
                        x[m].a.work_bytes = ktk_fp8_rows_bytes(p[m].m.Kp, M % 2 && m == 0 ? 1 : M);
                        x[m].a.work = xalloc((size_t)x[m].a.work_bytes);
                    }
                    w[m] = &p[m].m, xa[m] = &x[m].a;
                    buf[m] = xalloc(sizeof(float) * (cols + 32));
                    for (int i = 0; i < cols + 32; i++) buf[m][i] = SENT;
                    y[m] = buf[m] + 16;
                }
                gv(M, w, nb0, nb1, xa, y);
                for (int m = 0; m < M; m++) {
                    float *ref = run_framed(gm, &p[m], &x[m], nb0, nb1, cols, "gemm (gemv reference)");
                    int bad = memcmp(ref + cols, y[m], sizeof(float) * cols) != 0;
                    for (int i = 0; i < 16; i++) bad |= buf[m][i] != SENT || buf[m][16 + cols + i] != SENT;
                    if (bad) {
                        printf("FAIL %s gemv %s N=%d K=%d M=%d m=%d nb=[%d,%d): differs from gemm with one row "
                               "(or wrote outside)\n", name, QNAME[quant], N, K, M, m, nb0, nb1);
                        failures++;
                    }
                    free(ref);
                    free(buf[m]);
                    acts_free(&x[m]);
                    unpack_free(&p[m]);
                }
                gemv_cases++;
            }
    }
}

/* fp8_bf16.c's direct kernel, or the dp table entry where the dequantizing path is forced (its dq path is fp8.c's) */
static void gemm_fp8_dp_raw(const ktk_mat *w, int nb0, int nb1, const ktk_act *x, float *y, int64_t ldy) {
    if (x->fp8_path == KTK_FP8_PATH_DEQUANT) ktk_avx512_gemm_fp8_dp(w, nb0, nb1, x, y, ldy);
    else ktk_avx512_fp8_dp_kernels(1).direct(w, nb0, nb1, x, y, ldy);
}

/* The dp entries' choice: fp8.c's FMA kernels for use_dp 0, fp8_bf16.c's others for 1. */
static void check_fp8_dp_choice(void) {
    const ktk_fp8_kernels off = ktk_avx512_fp8_dp_kernels(0), on = ktk_avx512_fp8_dp_kernels(1);
    if (off.direct != ktk_avx512_gemm_fp8_direct || off.gemv != ktk_avx512_gemv_fp8 ||
        on.direct == ktk_avx512_gemm_fp8_direct || on.gemv == ktk_avx512_gemv_fp8) {
        printf("FAIL fp8 dp: ktk_avx512_fp8_dp_kernels does not fall back to the FMA kernels\n");
        failures++;
    }
}

static int run_tests(void) {
    static const int shapes[][2] = {{1, 1}, {16, 64}, {17, 65}, {5, 130}, {33, 200}, {64, 128}, {100, 257},
                                    {250, 1000}, {48, 2048}, {40, 7168}, {130, 96}};
    static const int rows[] = {1, 2, 3, 4, 5, 6, 7, 8, 9, 12, 13, 15, 16, 17, 24, 31, 32, 33, 47, 48, 64, 65, 100};
    int ncases = 0;
    for (int col = 0; col < NCOL; col++)
        for (size_t s = 0; s < sizeof shapes / sizeof shapes[0]; s++)
            for (size_t ri = 0; ri < sizeof rows / sizeof rows[0]; ri++) {
                int N = shapes[s][0], K = shapes[s][1], n = rows[ri], G = 32 << (ncases % 3), br = 128;
                if (col >= 4) {   /* fp8: groups of 128 and 32, blocks of 128 and 16 rows */
                    G = ncases % 2 ? 32 : 128;
                    br = ncases % 4 < 2 ? 128 : 16;
                }
                if ((double)N * K * n > 3e7 && ri % 4) continue;   /* keep big shapes to a few row counts */
                int nblk = (N + 15) / 16;
                check_case(N, K, n, col, G, br, 0, nblk);
                ncases++;
                if (nblk >= 2) {
                    int nb0 = 1 + (int)(xr() % (uint64_t)(nblk - 1));
                    int nb1 = nb0 + 1 + (int)(xr() % (uint64_t)(nblk - nb0));
                    check_case(N, K, n, col, G, br, nb0, nb1);
                    ncases++;
                }
            }
    features f = detect();
    if (f.avx2) check_gemv("avx2", ktk_kernels_avx2());   /* fp8 only */
    if (f.avx512) {
        setenv("KTINJECT_AVX512_PLAIN", "1", 1);
        check_gemv("avx512 (plain F/BW)", ktk_kernels_avx512());
        unsetenv("KTINJECT_AVX512_PLAIN");
        check_gemv(ktk_kernels_avx512()->name, ktk_kernels_avx512());
        check_fp8_dp_choice();
        if (f.bf16 && f.vbmi) {
            const ktk_kernels dpt = {.name = "avx512 fp8 dp (raw)", .gemm_fp8 = gemm_fp8_dp_raw,
                                     .gemv_fp8 = ktk_avx512_fp8_dp_kernels(1).gemv};
            check_gemv(dpt.name, &dpt);
        }
    }
    if (f.amx) check_gemv("amx (table)", ktk_kernels_amx());
    printf("%d cases x %d variants; gemv: %d cases bit-identical to gemm with one row\n", ncases, nvariants,
           gemv_cases);
    printf("%-26s", "variant");
    for (int c = 0; c < NCOL; c++) printf(" %-10s", COL[c]);
    printf(" (max err)\n");
    for (int v = 0; v < nvariants; v++) {
        printf("%-26s", variants[v].name);
        for (int c = 0; c < NCOL; c++) printf(" %-10.3g", worst[v][c]);
        printf("\n");
    }
    printf("(bf16, int4 dq, fp8 dq, fp8 of avx512 fp8 dp: |y - generic| / sum|x w| per output; int8, int4, fp8: "
           "relative difference, 0 = bit-exact)\n");
    if (dp_outputs)
        printf("avx512 fp8 dp (raw): %lld of %lld fp8 outputs bit-identical to generic\n", (long long)dp_same,
               (long long)dp_outputs);
    printf("ISAs run: generic%s%s%s; not run (not on this CPU / OS): %s%s%s\n", f.avx2 ? ", avx2" : "",
           f.avx512 ? ", avx512" : "", f.amx ? ", amx" : "", f.avx2 ? "" : "avx2 ", f.avx512 ? "" : "avx512 ",
           f.amx ? "" : "amx");
    failures += test_mxfp4();
    printf(failures ? "FAILED: %d\n" : "ALL OK\n", failures);
    return failures ? 1 : 0;
}

#include "test_kernels_bench.h"

int main(int argc, char **argv) {
    features f = detect();
    printf("cpu: avx2 %d avx512 %d avx512_bf16 %d avx512_vnni %d amx(+os) %d\n", f.avx2, f.avx512, f.bf16, f.vnni,
           f.amx);
    const ktk_kernels *gen = ktk_kernels_generic();
    add_variant("generic", gen->gemm_bf16, gen->gemm_int8, gen->gemm_int4, gen->gemm_fp8);   /* first: the reference */
    if (f.avx2) {
        const ktk_kernels *a2 = ktk_kernels_avx2();
        add_variant("avx2", a2->gemm_bf16, a2->gemm_int8, a2->gemm_int4, a2->gemm_fp8);
        avx2_dequant = 1;
    }
    if (f.avx512) {
        setenv("KTINJECT_AVX512_PLAIN", "1", 1);
        const ktk_kernels *plain = ktk_kernels_avx512();
        unsetenv("KTINJECT_AVX512_PLAIN");
        add_variant("avx512 (plain F/BW)", plain->gemm_bf16, plain->gemm_int8, plain->gemm_int4, plain->gemm_fp8);
        avx512_dequant = 1;
        const ktk_kernels *best = ktk_kernels_avx512();
        if (best != plain) add_variant(best->name, best->gemm_bf16, best->gemm_int8, best->gemm_int4, best->gemm_fp8);
        /* the vdpbf16ps / vpdpbusd kernels even where the table does not pick them (vdpbf16ps on AMX CPUs) */
        ktk_gemm_fn dp = f.bf16 && best->gemm_bf16 != ktk_avx512_gemm_bf16_dp ? ktk_avx512_gemm_bf16_dp : NULL;
        ktk_gemm_fn vn = f.vnni && best->gemm_int8 != ktk_avx512_gemm_int8_vnni ? ktk_avx512_gemm_int8_vnni : NULL;
        ktk_gemm_fn v4 = f.vnni && best->gemm_int4 != ktk_avx512_gemm_int4_vnni ? ktk_avx512_gemm_int4_vnni : NULL;
        if (dp || vn || v4) add_variant("avx512 dp/vnni (raw)", dp, vn, v4, NULL);
        if (f.bf16 && f.vbmi) {   /* fp8_bf16.c's kernels even where the table does not pick them (Intel) */
            add_variant("avx512 fp8 dp (raw)", NULL, NULL, NULL, gemm_fp8_dp_raw);
            dp_exact = dp_rounds_as_documented();
            variants[nvariants - 1].fp8_tol = !dp_exact;
            printf("vdpbf16ps rounds as documented: %s (fp8 dp: %s)\n", dp_exact ? "yes" : "no",
                   dp_exact ? "bit-exact required" : "tolerance 1e-5");
        }
    }
    if (f.amx) {
        const ktk_kernels *amx = ktk_kernels_amx();
        add_variant("amx (table)", amx->gemm_bf16, amx->gemm_int8, amx->gemm_int4, amx->gemm_fp8);
        /* int4, fp8: the table's function (forced paths: direct = AVX-512 VNNI / FMA, dq = AMX-BF16 on dequantized
         * blocks from the table's bf16 crossover) */
        add_variant("amx tiles (any n)", ktk_amx_gemm_bf16_tiles, ktk_amx_gemm_int8_tiles, amx->gemm_int4,
                    amx->gemm_fp8);
    }
    if (argc > 1 && !strcmp(argv[1], "bench"))
        return run_bench(argc > 2 ? atoi(argv[2]) : 1, argc > 3 ? atoi(argv[3]) : 2048, argc > 4 ? atoi(argv[4]) : 2048,
                         argc > 5 ? atoi(argv[5]) : 256);
    return run_tests();
}
