/* mxfp4 cases of the kernel harness (included by test_kernels.c; uses its xr, xalloc, detect and failures).
 *
 * Random e2m1 codes (every code, -0 included) with e8m0 exponents around 127 (some rows at the extremes 0 and 254,
 * their activations scaled so that the products stay finite), x bf16 with K a multiple of 32 and Kp = round_up(K,
 * 64) (zero padding). The generic direct kernel is checked against float64 of the same operands (|y - ref| / sum |x
 * w| <= 2^-20 + K 2^-140, float's subnormal floor; skipped where ref is beyond float); every table's direct path (workspaces of 0 rows, the generic
 * fallback, up to more than n: chunks of rows) must match it bit for bit, its dequantizing path (forced, 1-4 blocks)
 * within 1e-5 of sum |x w| where every weight is a normal float (the bf16 kernels may flush subnormals; 2^128
 * and above dequantize to inf), its dequantization
 * the generic one's bits; each gemv must equal its table's gemm with one row bit for bit.
 */
void ktk_avx512_dequant_mxfp4(const ktk_mat *w, int nb0, int nb1, uint16_t *dst);

typedef struct {
    ktk_mat m;
    uint8_t *data, *scale;
    float *xscale;   /* per output row: what the rows of x are scaled by to keep that row's products finite */
} mx_packed;

static uint16_t mx_bf16(float f) { return ktk_f32_to_bf16(f); }

/* extreme: 0 plain, 1 some rows with exponent 0 or 254 */
static mx_packed mx_pack(int N, int K, int extreme) {
    mx_packed p;
    const int Np = (N + 15) / 16 * 16, Kp = (K + 63) / 64 * 64;
    p.data = xalloc((size_t)Np * Kp / 2);
    p.scale = xalloc((size_t)Np * Kp / 32 + 64);
    memset(p.data, 0, (size_t)Np * Kp / 2);
    memset(p.scale, 0, (size_t)Np * Kp / 32 + 64);
    for (int n = 0; n < N; n++) {
        const int kind = extreme ? (int)(xr() % 4) : 3;   /* 0: e 0, 1: e 254, 2: e 127, 3: around 127 */
        for (int g = 0; g < K / 32; g++) {
            int e = kind == 0 ? 0 : kind == 1 ? 254 : kind == 2 ? 127 : 120 + (int)(xr() % 15);
            p.scale[((int64_t)(n / 16) * (Kp / 32) + g) * 16 + n % 16] = (uint8_t)e;
        }
        for (int c = 0; c < K; c += 2)
            p.data[((int64_t)(n / 16) * (Kp / 8) + c / 8) * 64 + (n % 16) * 4 + (c % 8) / 2] = (uint8_t)(xr() >> 56);
    }
    p.m = (ktk_mat){N, K, Np, Kp, KTK_QUANT_MXFP4, NULL, NULL, NULL, NULL, NULL, 32, NULL, p.data, p.scale};
    return p;
}

static double mx_w(const mx_packed *p, int n, int c) {
    const int Kp = p->m.Kp;
    const uint8_t b = p->data[((int64_t)(n / 16) * (Kp / 8) + c / 8) * 64 + (n % 16) * 4 + (c % 8) / 2];
    const int e = p->scale[((int64_t)(n / 16) * (Kp / 32) + c / 32) * 16 + n % 16];
    return (double)ktk_e2m1_to_f32(c % 2 ? b >> 4 : b & 15) * ldexp(1.0, e - 127);
}

/* any weight outside bf16's normal range: a subnormal (the bf16 kernels may flush it) or beyond float (inf once
 * dequantized, where the direct path scales a finite group sum) */
static int mx_outside_bf16(const mx_packed *p, int nb0, int nb1) {
    for (int n = nb0 * 16; n < nb1 * 16 && n < p->m.N; n++)
        for (int c = 0; c < p->m.K; c++) {
            const double v = fabs(mx_w(p, n, c));
            if ((v > 0 && v < 0x1p-126) || v >= 0x1p128) return 1;
        }
    return 0;
}

/* x rows of magnitude ~1, scaled down by 2^-140 where asked (rows meeting exponent 254 weights stay finite) */
static uint16_t *mx_acts(int n, int Kp, int K, int tiny) {
    uint16_t *x = xalloc((size_t)n * Kp * 2);
    memset(x, 0, (size_t)n * Kp * 2);
    for (int t = 0; t < n; t++)
        for (int c = 0; c < K; c++) x[(int64_t)t * Kp + c] = mx_bf16(ldexpf(frand(), tiny ? -140 : 0));
    return x;
}

static void mx_run(ktk_gemm_fn fn, const mx_packed *p, const uint16_t *xb, int n, void *work, int64_t wb, int path,
                   int nb0, int nb1, float *y) {
    const ktk_act x = {n, p->m.Kp, xb, NULL, NULL, NULL, work, wb, KTK_INT4_PATH_AUTO, NULL, path};
    fn(&p->m, nb0, nb1, &x, y, 16 * (nb1 - nb0));
}

static int mx_check_case(const char *name, ktk_gemm_fn fn, int N, int K, int n, int extreme, int nb0, int nb1) {
    mx_packed p = mx_pack(N, K, extreme);
    const int tiny = extreme && (xr() & 1), ld = 16 * (nb1 - nb0), Kp = p.m.Kp;
    uint16_t *xb = mx_acts(n, Kp, K, tiny);
    float *ref = xalloc((size_t)n * ld * 4), *y = xalloc((size_t)n * ld * 4);
    const int64_t rowb = ktk_fp8_rows_bytes(Kp, 1), blkb = ktk_int4_work_bytes(Kp, 1);
    void *work = xalloc((size_t)(rowb * (n + 3) > blkb * 4 ? rowb * (n + 3) : blkb * 4));
    int bad = 0;
    mx_run(ktk_generic_gemm_mxfp4_direct, &p, xb, n, NULL, 0, KTK_FP8_PATH_DIRECT, nb0, nb1, ref);
    for (int t = 0; t < n && !bad; t++)   /* the reference against float64 */
        for (int j = nb0 * 16; j < nb1 * 16; j++) {
            double s = 0, sa = 0;
            for (int c = 0; c < K; c++) {
                const double xv = ktk_bf16_to_f32(xb[(int64_t)t * Kp + c]), wv = j < N ? mx_w(&p, j, c) : 0.0;
                s += xv * wv;
                sa += fabs(xv * wv);
            }
            const float r = ref[(int64_t)t * ld + j - nb0 * 16];
            const int ok = fabs(s) > 3.4e38 || sa > 3.4e38 ? 1 : fabs((double)r - s) <= sa * 0x1p-20 + K * 0x1p-140;
            if (!ok) {
                printf("FAIL mxfp4 generic vs float64: N=%d K=%d n=%d t=%d j=%d: %.9g vs %.9g\n", N, K, n, t, j,
                       (double)r, s);
                bad = 1;
                break;
            }
        }
    if (fn) {
        for (int rows = 0; rows <= n + 3 && !bad; rows += rows < 4 ? 1 : n / 3 + 1) {   /* direct: bit-exact */
            memset(y, 0xff, (size_t)n * ld * 4);
            mx_run(fn, &p, xb, n, rows ? work : NULL, rowb * rows, KTK_FP8_PATH_DIRECT, nb0, nb1, y);
            if (memcmp(y, ref, (size_t)n * ld * 4)) {
                printf("FAIL mxfp4 %s direct (work %d rows): N=%d K=%d n=%d blocks %d..%d not bit-identical\n", name,
                       rows, N, K, n, nb0, nb1);
                bad = 1;
            }
        }
        const int sub = mx_outside_bf16(&p, nb0, nb1);
        for (int blocks = 1; blocks <= 4 && !bad && !sub; blocks++) {   /* dequantizing: the bf16 kernel's sums */
            mx_run(fn, &p, xb, n, work, blkb * blocks, KTK_FP8_PATH_DEQUANT, nb0, nb1, y);
            for (int t = 0; t < n && !bad; t++)
                for (int j = nb0 * 16; j < nb1 * 16 && !bad; j++) {
                    double sa = 0;
                    for (int c = 0; c < K; c++)
                        sa += fabs(ktk_bf16_to_f32(xb[(int64_t)t * Kp + c]) * (j < N ? mx_w(&p, j, c) : 0.0));
                    const double a = y[(int64_t)t * ld + j - nb0 * 16], b = ref[(int64_t)t * ld + j - nb0 * 16];
                    if (!(fabs(a - b) <= sa * 1e-5 + 1e-300) && !(isinf(a) && a == b) && sa < 3.4e38) {
                        printf("FAIL mxfp4 %s dequant (%d blocks): N=%d K=%d n=%d t=%d j=%d: %.9g vs %.9g\n", name,
                               blocks, N, K, n, t, j, a, b);
                        bad = 1;
                    }
                }
        }
    }
    free(work), free(y), free(ref), free(xb), free(p.data), free(p.scale);
    return bad;
}

static int mx_check_dequant(ktk_dequant_fn fn, int N, int K) {
    mx_packed p = mx_pack(N, K, 1);
    const int nb = p.m.Np / 16;
    uint16_t *a = xalloc((size_t)nb * 16 * p.m.Kp * 2), *b = xalloc((size_t)nb * 16 * p.m.Kp * 2);
    ktk_generic_dequant_mxfp4(&p.m, 0, nb, a);
    fn(&p.m, 0, nb, b);
    const int bad = memcmp(a, b, (size_t)nb * 16 * p.m.Kp * 2) != 0;
    if (bad) printf("FAIL mxfp4 avx512 dequant: N=%d K=%d not the generic bits\n", N, K);
    free(a), free(b), free(p.data), free(p.scale);
    return bad;
}

/* gemv of a table against its gemm with one row, M matrices of one shape */
static int mx_check_gemv(const char *name, const ktk_kernels *t, int N, int K, int M) {
    mx_packed p[KTK_GEMV_MAX];
    uint16_t *xb[KTK_GEMV_MAX];
    ktk_act x[KTK_GEMV_MAX];
    const ktk_mat *w[KTK_GEMV_MAX];
    const ktk_act *xp[KTK_GEMV_MAX];
    float *y[KTK_GEMV_MAX], *yg = xalloc((size_t)(N + 16) * 4);
    const int nb = (N + 15) / 16;
    int bad = 0;
    void *work = NULL;
    for (int m = 0; m < M; m++) {
        p[m] = mx_pack(N, K, m % 2);
        xb[m] = mx_acts(1, p[m].m.Kp, K, m % 4 == 1);
        if (!work) work = xalloc((size_t)ktk_fp8_rows_bytes(p[m].m.Kp, M));
        x[m] = (ktk_act){1, p[m].m.Kp, xb[m], NULL, NULL, NULL, work, ktk_fp8_rows_bytes(p[m].m.Kp, M),
                         KTK_INT4_PATH_AUTO, NULL, KTK_FP8_PATH_AUTO};
        w[m] = &p[m].m;
        xp[m] = &x[m];
        y[m] = xalloc((size_t)nb * 16 * 4);
    }
    t->gemv_mxfp4(M, w, 0, nb, xp, y);
    for (int m = 0; m < M && !bad; m++) {
        t->gemm_mxfp4(w[m], 0, nb, &x[m], yg, nb * 16);
        if (memcmp(yg, y[m], (size_t)nb * 16 * 4)) {
            printf("FAIL mxfp4 %s gemv: N=%d K=%d M=%d matrix %d differs from gemm with one row\n", name, N, K, M, m);
            bad = 1;
        }
    }
    for (int m = 0; m < M; m++) free(p[m].data), free(p[m].scale), free(xb[m]), free(y[m]);
    free(work), free(yg);
    return bad;
}

static int test_mxfp4(void) {
    static const int shapes[][2] = {{1, 32}, {16, 64}, {17, 96}, {5, 160}, {33, 224}, {64, 128}, {100, 288},
                                    {250, 1024}, {40, 2880}};
    static const int rows[] = {1, 2, 3, 4, 5, 7, 9, 16, 17, 33, 65};
    features f = detect();
    const char *names[4] = {"avx2 (table)", "avx512 (table)", "amx (table)", NULL};
    ktk_gemm_fn fns[4] = {f.avx2 ? ktk_kernels_avx2()->gemm_mxfp4 : NULL,
                          f.avx512 ? ktk_kernels_avx512()->gemm_mxfp4 : NULL,
                          f.amx ? ktk_kernels_amx()->gemm_mxfp4 : NULL, NULL};
    int bad = 0, cases = 0;
    for (size_t s = 0; s < sizeof shapes / sizeof shapes[0]; s++)
        for (size_t r = 0; r < sizeof rows / sizeof rows[0]; r++) {
            const int N = shapes[s][0], K = shapes[s][1], n = rows[r], nblk = (N + 15) / 16;
            if ((double)N * K * n > 3e6 && r % 3) continue;
            for (int v = 0; v < 3; v++) {
                if (!fns[v]) continue;
                const int extreme = (int)(xr() % 2);
                bad += mx_check_case(names[v], fns[v], N, K, n, extreme, 0, nblk);
                if (nblk >= 2) {
                    const int nb0 = 1 + (int)(xr() % (uint64_t)(nblk - 1));
                    bad += mx_check_case(names[v], fns[v], N, K, n, extreme, nb0, nb0 + 1 +
                                         (int)(xr() % (uint64_t)(nblk - nb0)));
                }
                cases++;
            }
        }
    if (f.avx512)
        for (size_t s = 0; s < sizeof shapes / sizeof shapes[0]; s++)
            bad += mx_check_dequant(ktk_avx512_dequant_mxfp4, shapes[s][0], shapes[s][1]);
    const ktk_kernels *tabs[3] = {f.avx512 ? ktk_kernels_avx512() : NULL, f.amx ? ktk_kernels_amx() : NULL, NULL};
    int gv = 0;
    for (int i = 0; i < 2; i++)
        if (tabs[i] && tabs[i]->gemv_mxfp4)
            for (size_t s = 0; s < sizeof shapes / sizeof shapes[0]; s++)
                for (int M = 1; M <= KTK_GEMV_MAX; M += 3) {
                    bad += mx_check_gemv(tabs[i]->name, tabs[i], shapes[s][0], shapes[s][1], M);
                    gv++;
                }
    printf("mxfp4: %d cases (generic vs float64; tables direct bit-exact, dequantizing within 1e-5), %d gemv cases: "
           "%s\n", cases, gv, bad ? "FAILED" : "ok");
    return bad;
}
