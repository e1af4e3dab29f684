/* Low-rank adapters of routed rows (ktk_experts_lora, ktk_experts_lora_backward): training's expert LoRA terms,
 * beside the stored weights' products of ktk_experts_project. For row r with expert e = e_r and one matrix W [N, K]
 * of the experts (which: gate, up or down), adapters A [E, rank, K] and B [E, N, rank] (float32, B scaled), B
 * given transposed (Bt [E, rank, N]: every loop below then runs along contiguous rows of length K or N):
 *   forward:   t[r] = A_e z[r]                 [R, rank]   written
 *              y[r] += B_e t[r]                [R, N]      accumulated (y holds the base product)
 *   backward:  dt[r] = B_e^T dy[r]             [R, rank]   written
 *              dz[r] = A_e^T dt[r]             [R, K]      written
 *              dA_e = sum over e's rows of dt[r] z[r]^T    [E, rank, K]  written, zeros for experts without rows
 *              dBt_e = sum over e's rows of t[r] dy[r]^T   [E, rank, N]  written, likewise
 * Float32 throughout. The per-row parts run over chunks of rows (any order); the sums over an expert's rows run per
 * (expert, block of columns) in ascending row order (rows grouped by expert, stable), so no result depends on the
 * threads. Three loops over the rank's rows of A, Bt or a gradient do all the arithmetic (mdot: rank dot products,
 * maxpy: y += a combination of the rows, ger: the rows += an outer product): the ISA's (ktki_dispatch_backward:
 * avx512, amx) where it has them, else the generic ones below, their reference (the same to float rounding). A row's
 * adapter work is rank x (K + N) products, small beside the base products: the point of running it here is one
 * pool job instead of a few small matrix products per expert.
 * Legend: R rows, E experts, K, N: W's inputs and outputs, rank the adapters' rank.
 */
#include <string.h>

#include "../internal.h"

#define ROWS_PER_ITEM 16
#define LANES 16             /* partial sums of a dot product: independent, so the compiler vectorizes them */
#define COLS_PER_ITEM 256    /* columns of dA / dB per sum item */

typedef struct {
    ktk_task t;              /* first: the pool runs it; T = R, ids = the rows' experts */
    int which, rank, backward;
    const float *z, *a, *b, *tin, *dy;     /* b: B transposed, [E, rank, N] */
    float *tout, *y, *dt, *dz, *da, *db;   /* db: B's gradient transposed */
} lora_task;

typedef struct {
    const lora_task *p;
    int R, E, K, N, rank, step;
    int32_t *cnt, *off, *row;          /* [E], [E + 1], [R]: the caller's row of each grouped row */
    int64_t kblocks, nblocks;
    void (*mdot)(const float *M, int64_t ldm, int rk, const float *x, int n, float *t);
    void (*maxpy)(float *y, const float *M, int64_t ldm, int rk, const float *s, int n);
    void (*ger)(float *M, int64_t ldm, int rk, const float *s, const float *v, int n);
} lctx;


/* The generic loops (the reference of the ISA tables' mdot, maxpy and ger: kernels/kernels.h). Dot products in LANES
 * partial sums (a fixed order: the same bits on every thread). */
static void mdot_generic(const float *M, int64_t ldm, int rk, const float *x, int n, float *t) {
    for (int j = 0; j < rk; j++) {
        const float *a = M + (int64_t)j * ldm;
        float acc[LANES] = {0};
        int i = 0;
        for (; i + LANES <= n; i += LANES)
            for (int l = 0; l < LANES; l++) acc[l] += a[i + l] * x[i + l];
        for (int l = 0; i < n; i++, l++) acc[l] += a[i] * x[i];
        float s = 0.0f;
        for (int l = 0; l < LANES; l++) s += acc[l];
        t[j] = s;
    }
}

static void maxpy_generic(float *y, const float *M, int64_t ldm, int rk, const float *s, int n) {
    for (int j = 0; j < rk; j++) {
        const float *a = M + (int64_t)j * ldm, sj = s[j];
        for (int i = 0; i < n; i++) y[i] += sj * a[i];
    }
}

static void ger_generic(float *M, int64_t ldm, int rk, const float *s, const float *v, int n) {
    for (int j = 0; j < rk; j++) {
        float *a = M + (int64_t)j * ldm;
        const float sj = s[j];
        for (int i = 0; i < n; i++) a[i] += sj * v[i];
    }
}

static int start(lctx *c, ktk_pool *pool, const lora_task *p, const char *fn) {
    const ktk_experts *ex = p->t.ex;
    *c = (lctx){.p = p, .R = p->t.T, .E = ex->cfg.num_experts, .K = ex->in_k[p->which], .N = ex->out_n[p->which],
                .rank = p->rank};
    const size_t E = (size_t)c->E, R = (size_t)c->R;
    uint8_t *rs = ktki_pool_scratch(pool, KTKI_SCR_ROUTE, 2 * a64(E * 4 + 4) + a64(R * 4));
    if (!rs) return ktki_error(KTK_ERR_NOMEM, "%s: out of memory (routing tables)", fn);
    c->cnt = (int32_t *)rs;
    c->off = (int32_t *)(rs + a64(E * 4 + 4));
    c->row = (int32_t *)(rs + 2 * a64(E * 4 + 4));
    const int64_t *ids = p->t.ids;
    memset(c->cnt, 0, E * sizeof *c->cnt);
    for (int r = 0; r < c->R; r++) {
        if (ids[r] < 0 || ids[r] >= c->E)
            return ktki_error(KTK_ERR_RANGE, "%s: expert_of_row[%d] = %lld is out of range (expected 0 <= id < E = "
                              "%d)", fn, r, (long long)ids[r], c->E);
        c->cnt[ids[r]]++;
    }
    for (int e = 0, pos = 0; e < c->E; e++) {
        c->off[e] = pos;
        pos += c->cnt[e];
        c->cnt[e] = c->off[e];   /* from here on: the expert's next free grouped row */
    }
    c->off[c->E] = c->R;
    for (int r = 0; r < c->R; r++) c->row[c->cnt[ids[r]]++] = r;
    c->kblocks = (c->K + COLS_PER_ITEM - 1) / COLS_PER_ITEM;
    c->nblocks = (c->N + COLS_PER_ITEM - 1) / COLS_PER_ITEM;
    const ktk_bwd_kernels *bk = ktki_dispatch_backward();
    c->mdot = bk && bk->mdot ? bk->mdot : mdot_generic;
    c->maxpy = bk && bk->maxpy ? bk->maxpy : maxpy_generic;
    c->ger = bk && bk->ger ? bk->ger : ger_generic;
    return KTK_OK;
}

/* ---- per row ---- */
static void rows_item(void *ctx, int64_t item, int tid) {
    (void)tid;
    const lctx *c = ctx;
    const lora_task *p = c->p;
    const int K = c->K, N = c->N, rk = c->rank;
    const int r1 = (int)((item + 1) * ROWS_PER_ITEM < c->R ? (item + 1) * ROWS_PER_ITEM : c->R);
    for (int r = (int)(item * ROWS_PER_ITEM); r < r1; r++) {
        const int64_t e = p->t.ids[r];
        const float *A = p->a + e * rk * K, *Bt = p->b + e * rk * N;
        if (!p->backward) {   /* t = A z; y += B t */
            float *t = p->tout + (int64_t)r * rk;
            c->mdot(A, K, rk, p->z + (int64_t)r * K, K, t);
            c->maxpy(p->y + (int64_t)r * N, Bt, N, rk, t, N);
        } else {              /* dt = B^T dy; dz = A^T dt */
            float *dt = p->dt + (int64_t)r * rk, *dz = p->dz + (int64_t)r * K;
            c->mdot(Bt, N, rk, p->dy + (int64_t)r * N, N, dt);
            memset(dz, 0, (size_t)K * sizeof *dz);
            c->maxpy(dz, A, K, rk, dt, K);
        }
    }
}

/* ---- per (expert, block of columns): item < E x kblocks: dA, then dB ---- */
static void sums(void *ctx, int64_t item, int tid) {
    (void)tid;
    const lctx *c = ctx;
    const lora_task *p = c->p;
    const int K = c->K, N = c->N, rk = c->rank;
    const int is_a = item < (int64_t)c->E * c->kblocks;
    const int64_t it = is_a ? item : item - (int64_t)c->E * c->kblocks;
    const int64_t per = is_a ? c->kblocks : c->nblocks;
    const int e = (int)(it / per), width = is_a ? K : N;
    const int c0 = (int)(it % per) * COLS_PER_ITEM, c1 = c0 + COLS_PER_ITEM < width ? c0 + COLS_PER_ITEM : width;
    /* dA_e[j][c] = sum dt[r][j] z[r][c];  dBt_e[j][c] = sum t[r][j] dy[r][c] */
    float *out = is_a ? p->da + (int64_t)e * rk * K : p->db + (int64_t)e * rk * N;
    for (int j = 0; j < rk; j++) memset(out + (int64_t)j * width + c0, 0, (size_t)(c1 - c0) * sizeof *out);
    for (int g = c->off[e]; g < c->off[e + 1]; g++) {
        const int r = c->row[g];
        const float *v = is_a ? p->z + (int64_t)r * K : p->dy + (int64_t)r * N;
        const float *s = is_a ? p->dt + (int64_t)r * rk : p->tin + (int64_t)r * rk;
        c->ger(out + c0, width, rk, s, v + c0, c1 - c0);
    }
}

static int lora_step(ktk_pool *pool, ktk_task *task, int first, ktki_phase *ph) {
    const lora_task *p = (const lora_task *)task;
    const char *fn = p->backward ? "ktk_experts_lora_backward" : "ktk_experts_lora";
    lctx *c = ktki_pool_scratch(pool, KTKI_SCR_JOB, sizeof *c);   /* the same buffer at every step (grow-only) */
    if (!c) return ktki_error(KTK_ERR_NOMEM, "%s: out of memory", fn);
    if (first) {
        int rc = start(c, pool, p, fn);
        if (rc != KTK_OK) return rc;
    }
    const int64_t row_items = (c->R + ROWS_PER_ITEM - 1) / ROWS_PER_ITEM;
    if (c->step == 0) {
        c->step = 1;
        if (row_items > 0) {
            *ph = (ktki_phase){rows_item, NULL, c, row_items, 1, 0, 1, 0};
            return KTKI_PHASE;
        }
    }
    if (c->step == 1 && p->backward) {
        c->step = 2;
        *ph = (ktki_phase){sums, NULL, c, (int64_t)c->E * (c->kblocks + c->nblocks), 1, 0, 1, 0};
        return KTKI_PHASE;
    }
    return KTK_OK;
}

static int run(ktk_pool *pool, lora_task *p) {
    if (ktki_job_run_inline(pool, &p->t)) {
        if (p->t.result != KTK_OK) ktki_error_set_msg(p->t.result, p->t.msg);
        return p->t.result;
    }
    int rc = ktki_task_submit(&p->t);
    return rc == KTK_OK ? ktki_task_wait(&p->t) : rc;
}

int ktki_lora(ktk_pool *pool, ktk_experts *ex, int which, int R, int rank, const int64_t *expert_of_row,
              const float *z, const float *a, const float *bt, float *t, float *y) {
    lora_task p = {.which = which, .rank = rank, .z = z, .a = a, .b = bt, .tout = t, .y = y};
    ktki_task_init(&p.t, pool);
    int rc = ktki_task_bind(&p.t, lora_step, ex, R, 1, z, KTK_DTYPE_F32, expert_of_row, NULL, KTK_DTYPE_F32, NULL,
                            y, KTK_DTYPE_F32);
    return rc == KTK_OK ? run(pool, &p) : rc;
}

int ktki_lora_backward(ktk_pool *pool, ktk_experts *ex, int which, int R, int rank, const int64_t *expert_of_row,
                       const float *z, const float *t, const float *dy, const float *a, const float *bt, float *dt,
                       float *dz, float *da, float *dbt) {
    lora_task p = {.which = which, .rank = rank, .backward = 1, .z = z, .a = a, .b = bt, .tin = t, .dy = dy, .dt = dt,
                   .dz = dz, .da = da, .db = dbt};
    ktki_task_init(&p.t, pool);
    int rc = ktki_task_bind(&p.t, lora_step, ex, R, 1, z, KTK_DTYPE_F32, expert_of_row, NULL, KTK_DTYPE_F32, NULL,
                            dz, KTK_DTYPE_F32);
    return rc == KTK_OK ? run(pool, &p) : rc;
}
