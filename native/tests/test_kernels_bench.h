// Benchmark part of native/tests/test_kernels.c (included there: one file to compile). See that file's header.
/* ---------------- benchmark ----------------
 * Calls shaped like the forward's (native/src/moe/forward.c): one call = up to 256 rows x CW column blocks (CW = 4
 * for n <= 4 as in decode, else 8) x all of K; a matrix's calls go round-robin to the threads; the matrices
 * rotate over >= 1 GB so the weights come from memory. GB/s = packed weight bytes / time; GF = 2 n N K / time.
 * fp8 codes: e4m3(N(0, 1) * 112) as a checkpoint's (and ktinject.bench's random checkpoints): about 1e-4 of them
 * subnormal; TK_FP8_CODES=all (env): every code but NaN alike, as the correctness tests (5% subnormal).
 * TK_GEMV=2,8 (env): also the decode gemv (ktk_gemv_fn) of the plain and the CPU's AVX-512 tables (fp8: and of
 * fp8_bf16.c) on M matrices with one row each, calls of 8 blocks (CWMAX of moe/forward.h), for int8 / fp8 as
 * TK_QUANT selects; GB/s as above. */
static double now(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return ts.tv_sec + ts.tv_nsec * 1e-9;
}

typedef struct {
    ktk_gemm_fn fn;
    ktk_gemv_fn gv;           /* instead of fn: M = gm matrices at once */
    int gm;
    const packed *mats;
    int nmats, tid, nthreads, cw;
    const acts *x;
    float *y;                 /* this thread's [n][cw * 16] */
    void *work;               /* this thread's int4 workspace (the dequantizing path) */
    pthread_barrier_t *bar;
} job;

static void *bench_thread(void *arg) {
    job *j = arg;
    ktk_act a = j->x->a;
    a.work = j->work;
    pthread_barrier_wait(j->bar);
    int c = 0;
    if (j->gv) {   /* matrices in groups of gm, one row each, the same row for all */
        const ktk_mat *w[KTK_GEMV_MAX];
        const ktk_act *xs[KTK_GEMV_MAX];
        float *ys[KTK_GEMV_MAX];
        for (int i = 0; i < j->gm; i++) xs[i] = &a, ys[i] = j->y + (int64_t)i * j->cw * 16;
        for (int m = 0; m + j->gm <= j->nmats; m += j->gm) {
            for (int i = 0; i < j->gm; i++) w[i] = &j->mats[m + i].m;
            int nblk = w[0]->Np / 16;
            for (int b = 0; b < nblk; b += j->cw, c++) {
                if (c % j->nthreads != j->tid) continue;
                j->gv(j->gm, w, b, b + j->cw < nblk ? b + j->cw : nblk, xs, ys);
            }
        }
        pthread_barrier_wait(j->bar);
        return NULL;
    }
    for (int m = 0; m < j->nmats; m++) {
        const packed *p = &j->mats[m];
        int nblk = p->m.Np / 16;
        for (int b = 0; b < nblk; b += j->cw, c++) {
            if (c % j->nthreads != j->tid) continue;
            int b1 = b + j->cw < nblk ? b + j->cw : nblk;
            j->fn(&p->m, b, b1, &a, j->y, (int64_t)j->cw * 16);
        }
    }
    pthread_barrier_wait(j->bar);
    return NULL;
}

/* seconds for one pass over nmats matrices on nth threads: median of 5 after a warm-up pass */
static double time_fn(ktk_gemm_fn fn, ktk_gemv_fn gv, int gm, const packed *mats, int nmats, const acts *x, int cw,
                      int nth) {
    pthread_t th[256];
    job jobs[256];
    pthread_barrier_t bar;
    double ts[6];
    for (int it = 0; it < 6; it++) {
        pthread_barrier_init(&bar, NULL, (unsigned)nth + 1);
        for (int i = 0; i < nth; i++) {
            jobs[i] = (job){fn, gv, gm, mats, nmats, i, nth, cw, x, NULL, NULL, &bar};
            jobs[i].y = xalloc(sizeof(float) * (size_t)(x->a.n > gm ? x->a.n : gm) * cw * 16);
            if (x->a.work_bytes) jobs[i].work = xalloc((size_t)x->a.work_bytes);
            pthread_create(&th[i], NULL, bench_thread, &jobs[i]);
        }
        double t0 = now();       /* before releasing the threads (main may be descheduled after) */
        pthread_barrier_wait(&bar);
        pthread_barrier_wait(&bar);
        ts[it] = now() - t0;
        for (int i = 0; i < nth; i++) { pthread_join(th[i], NULL); free(jobs[i].y); free(jobs[i].work); }
        pthread_barrier_destroy(&bar);
    }
    for (int i = 1; i < 6; i++)      /* sort ts[1..5] */
        for (int k = i + 1; k < 6; k++)
            if (ts[k] < ts[i]) { double t = ts[i]; ts[i] = ts[k]; ts[k] = t; }
    return ts[3];
}

/* e4m3 code nearest to v (ties: even code), saturating at +-448 */
static uint8_t e4m3_nearest(float v) {
    uint8_t best = 0;
    float bd = INFINITY;
    for (int c = 0; c < 0x7f; c++) {
        const float d = fabsf(fabsf(v) - ktk_e4m3_to_f32((uint8_t)c));
        if (d < bd || (d == bd && !(c & 1))) bd = d, best = (uint8_t)c;
    }
    return (uint8_t)(best | (v < 0 ? 0x80 : 0));
}

/* fp8 codes of the bench: a pool of e4m3(N(0, 1) * 112) (Box-Muller), drawn at random for every weight */
static void bench_fp8_codes(packed *p) {
    static uint8_t pool[1 << 16];
    static int ready;
    if (!ready) {
        for (int i = 0; i < 1 << 16; i++) {
            const double u1 = (xr() >> 11) * (1.0 / 9007199254740992.0) + 1e-300, u2 = frand();
            pool[i] = e4m3_nearest((float)(sqrt(-2.0 * log(u1)) * cos(3.141592653589793 * u2) * 112.0));
        }
        ready = 1;
    }
    uint8_t *d = (uint8_t *)p->m.data_f8;
    for (int n = 0; n < p->m.N; n++)
        for (int c = 0; c < p->m.K; c++) d[((int64_t)(n / 16) * p->m.Kp + c) * 16 + n % 16] = pool[xr() >> 48];
}

/* The tables' gemv for int8 / fp8 (TK_GEMV=M,...): plain F/BW, then the CPU's variant. */
static void bench_gemv(int quant, const packed *mats, int nm, int K, size_t bytes, int nth, const char *list) {
    const char *only = getenv("TK_ONLY");
    for (const char *s = list; *s;) {
        const int M = atoi(s);
        if (M >= 1 && M <= KTK_GEMV_MAX) {
            acts x = make_acts(1, K, mats[0].m.Kp, quant);
            x.a.work_bytes = quant == 3 ? ktk_fp8_rows_bytes(mats[0].m.Kp, KTK_GEMV_MAX) : 0;
            printf("  gemv M=%d", M);
            for (int v = 0; v < 3; v++) {   /* plain, the CPU's table, fp8_bf16.c's gemv (where the CPU runs it) */
                if (v == 0) setenv("KTINJECT_AVX512_PLAIN", "1", 1);
                const ktk_kernels *t = ktk_kernels_avx512();
                unsetenv("KTINJECT_AVX512_PLAIN");
                const features f = detect();
                const char *name = v < 2 ? t->name : "avx512 fp8 dp (raw)";
                const ktk_gemv_fn dp = quant == 3 && f.bf16 && f.vbmi ? ktk_avx512_fp8_dp_kernels(1).gemv : NULL;
                const ktk_gemv_fn gv = v == 2 ? dp : quant == 3 ? t->gemv_fp8 : t->gemv_int8;
                if (!gv || (only && !strstr(name, only))) continue;
                const int m = nm / M * M;
                double dt = time_fn(NULL, gv, M, mats, m, &x, 8, nth) / m;
                printf(" | %s %.1f GB/s", name, bytes / dt * 1e-9);
            }
            printf("\n");
            acts_free(&x);
        }
        s = strchr(s, ',');
        if (!s) break;
        s++;
    }
}

static int run_bench(int nth, int N, int K, int nmax) {
    if (nth < 1 || nth > 256) nth = 1;
    const char *only = getenv("TK_ONLY");   /* bench only the variants whose name contains this */
    const char *quants = getenv("TK_QUANT");   /* bench only these (e.g. "int4" or "int8,int4") */
    static const int ns[] = {1, 2, 4, 6, 8, 12, 16, 32, 64, 128, 256};
    printf("kernel bench: %d threads, W %dx%d, calls of <= 256 rows x CW blocks (CW 4 for n <= 4, else 8), "
           "median of 5\n", nth, N, K);
    for (int quant = 0; quant < 4; quant++) {
        if (quants && !strstr(quants, QNAME[quant])) continue;
        const size_t Np = (size_t)(N + 15) / 16 * 16, Kp = (size_t)(K + 63) / 64 * 64;   /* int4: G = 64 */
        size_t bytes = quant == 2   ? Np * Kp / 2 + Np * Kp / 64 * 4
                       : quant == 3 ? Np * Kp + Np / 16 * ((Kp + 127) / 128) * 4   /* fp8: G = 128 */
                                    : Np * Kp * (quant ? 1 : 2);
        int nm = (int)((1ull << 30) / bytes) + 1;
        packed *mats = malloc(sizeof(packed) * nm);
        for (int i = 0; i < nm; i++) {
            mats[i] = pack(N, K, quant, quant == 3 ? 128 : 64, 128);   /* fp8: 128 x 128 blocks */
            if (quant == 3 && !(getenv("TK_FP8_CODES") && !strcmp(getenv("TK_FP8_CODES"), "all")))
                bench_fp8_codes(&mats[i]);
            free(mats[i].wf); free(mats[i].q);
            mats[i].wf = NULL; mats[i].q = NULL;
        }
        printf("%s: %d matrices (%.2f GB incl. scales) rotating\n", QNAME[quant], nm, nm * (double)bytes / 1e9);
        for (size_t ni = 0; ni < sizeof ns / sizeof ns[0]; ni++) {
            int n = ns[ni], cw = n <= 4 ? 4 : 8;
            if (n > nmax) break;
            /* memory-bound n: all matrices; compute-bound n: enough for ~2 GFLOP per thread per pass */
            int mlim = n <= 8 ? nm : (int)(2e9 * nth / (2.0 * n * N * K));
            mlim = mlim < 8 ? 8 : mlim > nm ? nm : mlim;
            acts x = make_acts(n, K, mats[0].m.Kp, quant);
            printf("  n=%-4d", n);
            for (int v = 0; v < nvariants; v++)
                for (int path = KTK_INT4_PATH_DIRECT; path <= (quant >= 2 ? KTK_INT4_PATH_DEQUANT : 1); path++) {
                    ktk_gemm_fn fn = variants[v].fn[quant];
                    int gen = !strcmp(variants[v].name, "generic");
                    if (!fn || (gen && n > 1) || !strcmp(variants[v].name, "amx (table)")) continue;
                    if (only && !strstr(variants[v].name, only)) continue;
                    x.a.int4_path = x.a.fp8_path = path;   /* int4, fp8: direct, then dequantizing (workspace: cw) */
                    x.a.work_bytes = path == KTK_INT4_PATH_DEQUANT ? ktk_int4_work_bytes(mats[0].m.Kp, cw) : 0;
                    if (quant == 3 && path == KTK_INT4_PATH_DIRECT)   /* fp8 direct: the float rows, as the forward */
                        x.a.work_bytes = ktk_fp8_rows_bytes(mats[0].m.Kp, n < 32 ? n : 32);
                    int m = gen ? 2 : mlim;
                    double dt = time_fn(fn, NULL, 1, mats, m, &x, cw, nth) / m;
                    printf(" | %s%s %.1f GB/s %.0f GF", variants[v].name, path == KTK_INT4_PATH_DEQUANT ? " dq" : "",
                           bytes / dt * 1e-9, 2.0 * n * N * K / dt * 1e-9);
                }
            printf("\n");
            fflush(stdout);
            acts_free(&x);
        }
        if (getenv("TK_GEMV") && (quant == 1 || quant == 3) && detect().avx512)
            bench_gemv(quant, mats, nm, K, bytes, nth, getenv("TK_GEMV"));
        for (int i = 0; i < nm; i++) unpack_free(&mats[i]);
        free(mats);
    }
    return 0;
}
