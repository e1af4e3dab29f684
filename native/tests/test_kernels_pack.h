// CPU features and test data of native/tests/test_kernels.c (included there: one file to compile). See that file's
// header. What the CPU and the OS offer (detect); random matrices packed as native/src/kernels/kernels.h lays them
// out, with the values they stand for beside them (pack); activations in each quant's form (make_acts); fp8 codes
// as a checkpoint has them and the probe of vdpbf16ps's rounding (the fp8_bf16.c kernels' tests).
/* ---------------- CPU / OS features ---------------- */
static uint64_t xgetbv0(void) {
    uint32_t a, d;
    __asm__ volatile("xgetbv" : "=a"(a), "=d"(d) : "c"(0));
    return ((uint64_t)d << 32) | a;
}

typedef struct { int avx2, avx512, bf16, vnni, amx, vbmi; } features;

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
    f.vbmi = f.avx512 && ((c >> 1) & 1);
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
    float *wf;       /* [N][K] dequantized (bf16 values or q * scale; fp8: (float)e4m3 * scale) */
    int8_t *q;       /* int8, int4: [N][K] */
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

/* G: int4 / fp8 inputs per scale; br: fp8 output rows per scale (a multiple of 16) */
static packed pack(int N, int K, int quant, int G, int br) {
    packed p;
    memset(&p, 0, sizeof p);
    int Np = (N + 15) / 16 * 16, kq = quant == KTK_QUANT_INT4 && G > 64 ? G : 64, Kp = (K + kq - 1) / kq * kq;
    p.m.N = N; p.m.K = K; p.m.Np = Np; p.m.Kp = Kp; p.m.quant = quant;
    p.wf = xalloc(sizeof(float) * (size_t)N * K);
    if (quant == KTK_QUANT_FP8) {   /* every e4m3 code but NaN (subnormals, zeros of both signs), scales of both
                                     * signs and some zero, one per (block_rows band, group), stored per 16-row block */
        const int ng = (Kp + G - 1) / G, bands = (Np + br - 1) / br;
        uint8_t *d = xalloc((size_t)Np * Kp);
        float *sc = xalloc(sizeof(float) * (size_t)(Np / 16) * ng), *band = xalloc(sizeof(float) * bands * ng);
        for (int i = 0; i < bands * ng; i++) band[i] = xr() % 17 ? 0.002f + 0.02f * frand() : 0.0f;
        for (int b = 0; b < Np / 16; b++)
            for (int g = 0; g < ng; g++) sc[b * ng + g] = band[(b * 16 / br) * ng + g];
        for (int n = 0; n < N; n++)
            for (int c = 0; c < K; c++) {
                uint8_t v;
                do v = (uint8_t)(xr() >> 56); while ((v & 0x7f) == 0x7f);
                d[((int64_t)(n / 16) * Kp + c) * 16 + n % 16] = v;
                p.wf[(size_t)n * K + c] = ktk_e4m3_to_f32(v) * sc[(n / 16) * ng + c / G];
            }
        free(band);
        p.m.data_f8 = d; p.m.scale = sc; p.m.group = G;
    } else if (quant == KTK_QUANT_BF16) {
        uint16_t *d = xalloc(2 * (size_t)Np * Kp);
        for (int n = 0; n < N; n++)
            for (int c = 0; c < K; c++) {
                uint16_t h = ktk_f32_to_bf16(frand());
                p.wf[(size_t)n * K + c] = ktk_bf16_to_f32(h);
                d[((int64_t)(n / 16) * (Kp / 2) + c / 2) * 32 + (n % 16) * 2 + c % 2] = h;
            }
        p.m.data_bf16 = d;
    } else if (quant == KTK_QUANT_INT4) {   /* q in [-8, 7], scales of both signs, some groups zero */
        int ng = Kp / G;
        uint8_t *d = xalloc((size_t)Np * Kp / 2);
        float *sc = xalloc(sizeof(float) * Np * ng);
        p.q = xalloc((size_t)N * K);
        for (int n = 0; n < N; n++)
            for (int g = 0; g < ng; g++)
                sc[((n / 16) * ng + g) * 16 + n % 16] = xr() % 17 ? 0.002f + 0.02f * frand() : 0.0f;
        for (int n = 0; n < N; n++)
            for (int c = 0; c < K; c++) {
                int v = (int)(xr() >> 60) - 8;
                p.q[(size_t)n * K + c] = (int8_t)v;
                p.wf[(size_t)n * K + c] = v * sc[((n / 16) * ng + c / G) * 16 + n % 16];
                d[((int64_t)(n / 16) * (Kp / 8) + c / 8) * 64 + (n % 16) * 4 + c % 4] |=
                    (uint8_t)((v & 0xf) << (4 * ((c / 4) % 2)));
            }
        p.m.data_i4 = d; p.m.scale = sc; p.m.group = G;
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
    free((void *)p->m.data_i4); free((void *)p->m.data_f8);
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
    if (quant == KTK_QUANT_BF16 || quant == KTK_QUANT_FP8) {
        uint16_t *x = xalloc(2 * (size_t)n * Kp);
        for (int t = 0; t < n; t++)
            for (int c = 0; c < K; c++) {   /* fp8: some rows far from 1 (the direct kernels' per-row shift) */
                const float f = quant == KTK_QUANT_FP8 && t % 7 == 3 ? ldexpf(1.0f, (int)(t * 37 % 49) - 24) : 1.0f;
                uint16_t h = ktk_f32_to_bf16(frand() * 4.0f * f);
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
        if (quant == KTK_QUANT_INT4) {   /* the int4 dequantizing path also reads x as bf16 (exact) */
            uint16_t *xb = xalloc(2 * (size_t)n * Kp);
            for (size_t i = 0; i < (size_t)n * Kp; i++) xb[i] = ktk_f32_to_bf16((float)x[i]);
            r.a.x_bf16 = xb;
        }
    }
    return r;
}

static void acts_free(acts *r) {
    free((void *)r->a.x_bf16); free((void *)r->a.x_i8); free((void *)r->a.x_scale); free((void *)r->a.x_sum);
    free(r->xf); free(r->a.work);
}

/* ---------------- fp8: checkpoint-like codes, the vdpbf16ps rounding probe ---------------- */
/* fp8 codes as a checkpoint has them (31 in 32 subnormal codes made normal, so that most 64-byte lines hold none)
 * and rows of zeros (n % 8 == 5) and of +-448 (n % 8 == 6); the values beside them updated. */
static void fp8_checkpoint_like(packed *p) {
    uint8_t *d = (uint8_t *)p->m.data_f8;
    const int G = p->m.group, ng = ktk_fp8_groups(&p->m);
    for (int n = 0; n < p->m.N; n++)
        for (int c = 0; c < p->m.K; c++) {
            uint8_t *v = &d[((int64_t)(n / 16) * p->m.Kp + c) * 16 + n % 16];
            if (n % 8 == 5) *v = 0;
            else if (n % 8 == 6) *v = c % 3 ? 0x7e : 0xfe;
            else if (!(*v & 0x78) && (*v & 7) && xr() % 32) *v |= 0x08;
            p->wf[(size_t)n * p->m.K + c] = ktk_e4m3_to_f32(*v) * p->m.scale[(n / 16) * ng + c / G];
        }
}

/* Whether this CPU's vdpbf16ps computes, per lane, (acc + odd product) rounded, + even product, rounded (Intel's
 * documented order, which makes fp8_bf16.c's kernels bit-identical to the generic one): 20000 random probes. */
__attribute__((target("avx512f,avx512bf16"))) static int dp_rounds_as_documented(void) {
    for (int i = 0; i < 20000; i++) {
        uint16_t h[5];
        for (int k = 0; k < 5; k++)   /* normal bf16 of exponents 2^-20..2^19, both signs */
            h[k] = (uint16_t)(((xr() >> 63) << 15) | ((107 + xr() % 40) << 7) | (xr() % 128));
        const float acc = ktk_bf16_to_f32(h[4]) * (float)(1 + xr() % 1000);
        const __m512 r = _mm512_dpbf16_ps(_mm512_set1_ps(acc), (__m512bh)_mm512_set1_epi32((int)(h[1] << 16 | h[0])),
                                          (__m512bh)_mm512_set1_epi32((int)(h[3] << 16 | h[2])));
        volatile float p1 = ktk_bf16_to_f32(h[1]) * ktk_bf16_to_f32(h[3]);
        volatile float p0 = ktk_bf16_to_f32(h[0]) * ktk_bf16_to_f32(h[2]);
        volatile float s1 = acc + p1, want = s1 + p0;
        if (_mm512_cvtss_f32(r) != want) return 0;
    }
    return 1;
}
