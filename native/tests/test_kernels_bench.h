// Benchmark part of native/tests/test_kernels.c (included there: one file to compile). See that file's header.
/* ---------------- benchmark ----------------
 * Calls shaped like the forward's (native/src/moe/forward.c): one call = up to 256 rows x CW column blocks (CW = 4
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
    void *work;               /* this thread's int4 workspace (the dequantizing path) */
    pthread_barrier_t *bar;
} job;

static void *bench_thread(void *arg) {
    job *j = arg;
    ktk_act a = j->x->a;
    a.work = j->work;
    pthread_barrier_wait(j->bar);
    int c = 0;
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
static double time_fn(ktk_gemm_fn fn, const packed *mats, int nmats, const acts *x, int cw, int nth) {
    pthread_t th[256];
    job jobs[256];
    pthread_barrier_t bar;
    double ts[6];
    for (int it = 0; it < 6; it++) {
        pthread_barrier_init(&bar, NULL, (unsigned)nth + 1);
        for (int i = 0; i < nth; i++) {
            jobs[i] = (job){fn, mats, nmats, i, nth, cw, x, NULL, NULL, &bar};
            jobs[i].y = xalloc(sizeof(float) * (size_t)x->a.n * cw * 16);
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
                    double dt = time_fn(fn, mats, m, &x, cw, nth) / m;
                    printf(" | %s%s %.1f GB/s %.0f GF", variants[v].name, path == KTK_INT4_PATH_DEQUANT ? " dq" : "",
                           bytes / dt * 1e-9, 2.0 * n * N * K / dt * 1e-9);
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
