/* One projection of routed rows with the stored (frozen) weights, forward or transposed (ktk_experts_project):
 *   transpose 0: y[r] = W_{e_r} x[r]      x [R, in], y [R, out]
 *   transpose 1: y[r] = W_{e_r}^T x[r]    x [R, out], y [R, in]
 * W = one matrix (gate, up or down) of row r's expert e_r; no bias, no activation. Training's base products (the
 * expert LoRA path: ktinject/operators/expert_lora_path.py) with the adapters' terms added outside.
 * Two arithmetics, by the call's precision:
 *   float (KTK_PRECISION_FLOAT, and every expert with fewer than KTK_PRECISION_BF16_MIN_ROWS rows): on the stored
 *        weights dequantized as ktk_experts_get gives them (bf16 values, q * scale, e4m3 * scale, e2m1 * 2^e), x read
 *        as float and never rounded to bf16 / int8 as the forward's activations are (as moe/backward.c): the exact
 *        products to float rounding, whatever the format. This file's steps.
 *   bf16 (KTK_PRECISION_BF16, experts with at least that many rows): x and those weight values rounded to bf16
 *        (nearest even), products summed in float by the forward's gemm_bf16 (AMX tiles on the amx ISA, where the
 *        float FMA steps below are the bottleneck of a LoRA step): error per output about 2^-8 of sum |x_c w_c|, as
 *        the forward's bf16 path. project_bf16.c.
 * Steps (a job of the pool, as the forward's):
 *   route (serial): validate the experts, rows grouped by expert (stable: rows may come in any order);
 *   rows (items): float: transpose 0: (expert, chunk of at most BR rows, group of at most cw 16-row blocks of W's
 *        outputs), each block dequantized once per chunk; transpose 1: (expert, chunk), every block of W feeding every
 *        output column (W's inputs), summed in ascending row order of W. bf16: project_bf16.c's items, in the same
 *        phase.
 * The float step on the kernels of ktki_dispatch_backward (avx2, avx512, amx) for bf16 / int8 / int4 / fp8: transpose
 * 0 through gate_up on two blocks at once (its two matrices: blocks b and b + 1 of the one matrix), or gate_up_packed
 * on the stored blocks for chunks of at most few_rows rows (avx512); transpose 1 through unpack + tprod, or tacc + hsum
 * for few rows. Elsewhere (generic; mxfp4 weights) the generic step below, their reference: blocks dequantized row by
 * row (ktki_pack_unpack), every sum in ascending order; the ISA step equals it to float rounding, not bit for bit.
 * A row's result depends on neither the other rows (but for the step its expert's row count picks) nor the threads.
 * Legend: R rows, E experts, A active experts (with rows), N, K: W's outputs and inputs (rows and columns).
 */
#include <string.h>

#include "project.h"

#define BR 32                /* rows per item */
#define CW 8                 /* 16-row blocks of W per transpose-0 item at most */
#define ITEMS_PER_THREAD 4

static int r16(int n) { return (n + 15) & ~15; }

/* ---- route ---- */
static int route(pctx *c) {
    const int64_t *ids = c->p->t.ids;
    memset(c->cnt, 0, (size_t)c->E * sizeof *c->cnt);
    for (int r = 0; r < c->R; r++) {
        if (ids[r] < 0 || ids[r] >= c->E)
            return ktki_error(KTK_ERR_RANGE, "ktk_experts_project: expert_of_row[%d] = %lld is out of range "
                              "(expected 0 <= id < E = %d)", r, (long long)ids[r], c->E);
        c->cnt[ids[r]]++;
    }
    const int nb = c->transpose ? 1 : (c->N + 15) / 16;
    c->A = 0;
    int64_t chunks = 0;
    for (int e = 0, pos = 0; e < c->E; e++) {
        if (!c->cnt[e]) continue;
        if (!c->ex->ready[(int64_t)e * 3 + c->p->which])
            return ktki_error(KTK_ERR_STATE, "ktk_experts_project: expert %d has rows but its %s weights were never "
                              "set (ktk_experts_set)", e, c->p->which == KTK_MAT_GATE ? "gate"
                              : c->p->which == KTK_MAT_UP ? "up" : "down");
        c->act_e[c->A] = e;
        c->off[c->A++] = pos;
        const int n = c->cnt[e];
        c->cnt[e] = pos;   /* from here on: the expert's next free grouped row */
        pos += n;
    }
    c->off[c->A] = c->R;
    for (int r = 0; r < c->R; r++) c->row[c->cnt[ids[r]]++] = r;
    for (int a = 0; a < c->A; a++)   /* the float step's row chunks */
        if (!ktki_project_bf16_takes(c, a)) chunks += (c->off[a + 1] - c->off[a] + BR - 1) / BR;
    /* blocks per item: halved (down to 2, a pair for gate_up) until every thread has a few items */
    const int64_t target = (int64_t)ITEMS_PER_THREAD * (ktki_pool_threads(c->pool) + 1);
    int cw = CW;
    while (cw > 2 && chunks * ((nb + cw - 1) / cw) < target) cw /= 2;
    c->cw = cw < nb ? cw : nb;
    c->nitems = chunks * ((nb + c->cw - 1) / c->cw);
    return KTK_OK;
}

/* ---- rows ---- */
/* Thread scratch (floats): X [BR][max(Nt, Kt)], two blocks as columns [Kt][16], one as rows [16][Kt] (the generic
 * step: rows of K), G, U [BR][16], OUT [BR][Kt], the few-rows partial sums [4][Kt][16]. */
static size_t scratch_bytes(const pctx *c) {
    const size_t wide = (size_t)(c->Nt > c->Kt ? c->Nt : c->Kt), kt = (size_t)c->Kt;
    return a64(BR * wide * 4) + 3 * a64(16 * kt * 4) + 2 * a64(BR * 16 * 4) + a64(BR * kt * 4) +
           a64(4 * kt * 16 * 4) + 64;
}

typedef struct { float *X, *WT0, *WT1, *WR0, *G, *U, *OUT, *ACC; } scr;

static scr scratch(const pctx *c, int tid) {
    const size_t wide = (size_t)(c->Nt > c->Kt ? c->Nt : c->Kt), kt = (size_t)c->Kt;
    scr s;
    s.X = ktki_pool_thread_scratch(c->pool, tid);
    s.WT0 = s.X + a64(BR * wide * 4) / 4;
    s.WT1 = s.WT0 + a64(16 * kt * 4) / 4;
    s.WR0 = s.WT1 + a64(16 * kt * 4) / 4;
    s.G = s.WR0 + a64(16 * kt * 4) / 4;
    s.U = s.G + a64(BR * 16 * 4) / 4;
    s.OUT = s.U + a64(BR * 16 * 4) / 4;
    s.ACC = s.OUT + a64(BR * kt * 4) / 4;
    return s;
}

/* Grouped rows [r0, r0 + n) of x as float rows ld apart, zero from nin to ld. */
static void load_rows(const pctx *c, int r0, int n, float *X, int ld) {
    const ktk_task *t = &c->p->t;
    const int64_t es = ktki_dtype_size(t->hidden_dtype);
    for (int i = 0; i < n; i++) {
        float *xr = X + (int64_t)i * ld;
        ktki_pack_to_f32((const char *)t->hidden + (int64_t)c->row[r0 + i] * c->nin * es, t->hidden_dtype, c->nin,
                         1, xr);
        memset(xr + c->nin, 0, (size_t)(ld - c->nin) * sizeof *xr);
    }
}

void ktki_project_store_rows(const pctx *c, int r0, int n, int j0, int jn, const float *v, int64_t ldv) {
    const ktk_task *t = &c->p->t;
    for (int i = 0; i < n; i++) {
        const int64_t o = (int64_t)c->row[r0 + i] * c->nout + j0;
        const float *src = v + (int64_t)i * ldv;
        if (t->out_dtype == KTK_DTYPE_F32) {
            memcpy((float *)t->out + o, src, (size_t)jn * sizeof *src);
        } else {
            uint16_t *dst = (uint16_t *)t->out + o;
            for (int j = 0; j < jn; j++) dst[j] = ktk_f32_to_bf16(src[j]);
        }
    }
}

/* Rows of block b (16b + j, j < 16, fewer at the end) dequantized as float rows of K at dst; returns the count. */
static int unpack_block(const ktk_mat *m, int b, float *dst) {
    const int n = m->N - b * 16 < 16 ? m->N - b * 16 : 16;
    for (int j = 0; j < n; j++) ktki_pack_unpack(m, b * 16 + j, dst + (int64_t)j * m->K);
    return n;
}

static int block_rows(const pctx *c, int b) { return c->nout - b * 16 < 16 ? c->nout - b * 16 : 16; }

/* transpose 0, generic: G[i][j] = sum_q X[i][q] W[16b + j][q] in ascending q */
static void forward_generic(const pctx *c, const ktk_mat *m, const proj_item *it, scr s) {
    const int n = it->r1 - it->r0, K = c->K;
    load_rows(c, it->r0, n, s.X, K);
    for (int b = it->b0; b < it->b1; b++) {
        const int jn = unpack_block(m, b, s.WR0);
        for (int i = 0; i < n; i++)
            for (int j = 0; j < jn; j++) {
                const float *xr = s.X + (int64_t)i * K, *wr = s.WR0 + (int64_t)j * K;
                float acc = 0.0f;
                for (int q = 0; q < K; q++) acc += xr[q] * wr[q];
                s.G[i * 16 + j] = acc;
            }
        ktki_project_store_rows(c, it->r0, n, b * 16, jn, s.G, 16);
    }
}

/* transpose 0 on the ISA's kernels: blocks in pairs unpacked as columns only, through gate_up (few rows: one at a
 * time from the stored blocks through gate_up_packed, its second output unused) */
static void forward_isa(const pctx *c, const ktk_mat *m, const proj_item *it, scr s) {
    const ktk_bwd_kernels *bk = c->bk;
    const int n = it->r1 - it->r0, Kt = c->Kt;
    load_rows(c, it->r0, n, s.X, Kt);
    if (n <= bk->few_rows) {
        for (int b = it->b0; b < it->b1; b++) {
            bk->gate_up_packed(m, m, b, s.X, Kt, n, s.G, s.U);
            ktki_project_store_rows(c, it->r0, n, b * 16, block_rows(c, b), s.G, 16);
        }
        return;
    }
    for (int b = it->b0; b < it->b1; b += 2) {
        const int two = b + 1 < it->b1;
        bk->unpack(m, b, s.WT0, NULL, Kt);
        if (two) bk->unpack(m, b + 1, s.WT1, NULL, Kt);
        bk->gate_up(s.WT0, two ? s.WT1 : s.WT0, Kt, s.X, Kt, n, s.G, s.U);
        ktki_project_store_rows(c, it->r0, n, b * 16, block_rows(c, b), s.G, 16);
        if (two) ktki_project_store_rows(c, it->r0, n, (b + 1) * 16, block_rows(c, b + 1), s.U, 16);
    }
}

/* transpose 1, generic: OUT[i][q] = sum_j X[i][j] W[j][q] in ascending j */
static void transposed_generic(const pctx *c, const ktk_mat *m, const proj_item *it, scr s) {
    const int n = it->r1 - it->r0, N = c->N, K = c->K;
    load_rows(c, it->r0, n, s.X, N);
    memset(s.OUT, 0, (size_t)n * K * sizeof *s.OUT);
    for (int b = 0; b < (N + 15) / 16; b++) {
        const int jn = unpack_block(m, b, s.WR0);
        for (int i = 0; i < n; i++) {
            float *o = s.OUT + (int64_t)i * K;
            for (int j = 0; j < jn; j++) {
                const float d = s.X[(int64_t)i * N + b * 16 + j], *wr = s.WR0 + (int64_t)j * K;
                for (int q = 0; q < K; q++) o[q] += d * wr[q];
            }
        }
    }
    ktki_project_store_rows(c, it->r0, n, 0, K, s.OUT, K);
}

/* transpose 1 on the ISA's kernels: unpack + tprod per block, or (few rows) tacc on the stored blocks + hsum */
static void transposed_isa(const pctx *c, const ktk_mat *m, const proj_item *it, scr s) {
    const ktk_bwd_kernels *bk = c->bk;
    const int n = it->r1 - it->r0, Nt = c->Nt, Kt = c->Kt;
    load_rows(c, it->r0, n, s.X, Nt);   /* zero past N: the padded rows of W add nothing */
    if (n <= bk->few_rows) {
        memset(s.ACC, 0, (size_t)n * Kt * 16 * sizeof *s.ACC);
        for (int b = 0; b < Nt / 16; b++) bk->tacc(m, b, s.X + b * 16, Nt, n, s.ACC);
        bk->hsum(s.ACC, c->K, n, s.OUT, Kt);
    } else {
        memset(s.OUT, 0, (size_t)n * Kt * sizeof *s.OUT);
        for (int b = 0; b < Nt / 16; b++) {
            bk->unpack(m, b, NULL, s.WR0, Kt);
            bk->tprod(s.WR0, s.X + b * 16, NULL, NULL, Nt, Kt, c->K, n, s.OUT, Kt);
        }
    }
    ktki_project_store_rows(c, it->r0, n, 0, c->K, s.OUT, Kt);
}

static void rows_item(void *ctx, int64_t item, int tid) {
    const pctx *c = ctx;
    const proj_item it = c->items[item];
    const ktk_mat m = ktki_experts_mat(c->ex, c->act_e[it.a], c->p->which);
    if (it.bf16) {
        ktki_project_bf16_run(c, &m, &it, ktki_pool_thread_scratch(c->pool, tid));
        return;
    }
    const scr s = scratch(c, tid);
    if (c->transpose) (c->bk ? transposed_isa : transposed_generic)(c, &m, &it, s);
    else (c->bk ? forward_isa : forward_generic)(c, &m, &it, s);
}

/* ---- steps ---- */
static int start(pctx *c, ktk_pool *pool, const proj_task *p) {
    const ktk_experts *ex = p->t.ex;
    *c = (pctx){.p = p, .ex = ex, .pool = pool, .R = p->t.T, .E = ex->cfg.num_experts, .N = ex->out_n[p->which],
                .K = ex->in_k[p->which], .transpose = p->transpose};
    c->Nt = r16(c->N);
    c->Kt = r16(c->K);
    c->nin = p->transpose ? c->N : c->K;
    c->nout = p->transpose ? c->K : c->N;
    const size_t E = (size_t)c->E, R = (size_t)c->R;
    uint8_t *rs = ktki_pool_scratch(pool, KTKI_SCR_ROUTE, 3 * a64(E * 4 + 4) + a64(R * 4));
    if (!rs) return ktki_error(KTK_ERR_NOMEM, "ktk_experts_project: out of memory (routing tables)");
    c->cnt = (int32_t *)rs;
    c->act_e = (int32_t *)(rs + a64(E * 4 + 4));
    c->off = (int32_t *)(rs + 2 * a64(E * 4 + 4));
    c->row = (int32_t *)(rs + 3 * a64(E * 4 + 4));
    int rc = route(c);
    if (rc != KTK_OK) return rc;
    const int64_t nfloat = c->nitems, nbf16 = ktki_project_bf16_plan(c);
    c->nitems += nbf16;
    c->items = ktki_pool_scratch(pool, KTKI_SCR_ITEMS, (size_t)(c->nitems + 1) * sizeof *c->items);
    if (!c->items) return ktki_error(KTK_ERR_NOMEM, "ktk_experts_project: out of memory (%d rows)", c->R);
    const int nb = c->transpose ? 1 : (c->N + 15) / 16;
    int64_t i = 0;
    for (int a = 0; a < c->A; a++) {
        if (ktki_project_bf16_takes(c, a)) {
            i += ktki_project_bf16_items(c, a, c->items + i);
            continue;
        }
        for (int b0 = 0; b0 < nb; b0 += c->cw)
            for (int r0 = c->off[a]; r0 < c->off[a + 1]; r0 += BR)
                c->items[i++] = (proj_item){a, r0, r0 + BR < c->off[a + 1] ? r0 + BR : c->off[a + 1], b0,
                                            b0 + c->cw < nb ? b0 + c->cw : nb, 0};
    }
    c->bk = ktki_dispatch_backward();
    const int q = ex->cfg.quant;   /* the ISA kernels know these formats; any other runs the generic step */
    if (q != KTK_QUANT_BF16 && q != KTK_QUANT_INT8 && q != KTK_QUANT_INT4 && q != KTK_QUANT_FP8) c->bk = NULL;
    const size_t fl = nfloat ? scratch_bytes(c) : 0, bf = nbf16 ? ktki_project_bf16_scratch(c) : 0;
    const size_t per = fl > bf ? fl : bf;
    if (!ktki_pool_thread_scratch_reserve(pool, per))
        return ktki_error(KTK_ERR_NOMEM, "ktk_experts_project: out of memory (thread scratch of %zu bytes)", per);
    return KTK_OK;
}

static int project_step(ktk_pool *pool, ktk_task *task, int first, ktki_phase *ph) {
    pctx *c = ktki_pool_scratch(pool, KTKI_SCR_JOB, sizeof *c);   /* the same buffer at every step (grow-only) */
    if (!c) return ktki_error(KTK_ERR_NOMEM, "ktk_experts_project: out of memory");
    if (first) {
        int rc = start(c, pool, (const proj_task *)task);
        if (rc != KTK_OK) return rc;
    }
    if (c->step++ == 0 && c->nitems > 0) {
        *ph = (ktki_phase){rows_item, NULL, c, c->nitems, 1, 0, 1, 0};
        return KTKI_PHASE;
    }
    return KTK_OK;
}

int ktki_project(ktk_pool *pool, ktk_experts *ex, int which, int R, const int64_t *expert_of_row, const void *x,
                 int x_dtype, void *y, int y_dtype, int transpose, int precision) {
    proj_task p;   /* on the stack: the pool's last touch is the IDLE store, then wait returns */
    ktki_task_init(&p.t, pool);
    int rc = ktki_task_bind(&p.t, project_step, ex, R, 1, x, x_dtype, expert_of_row, NULL, KTK_DTYPE_F32, NULL, y,
                            y_dtype);
    if (rc != KTK_OK) return rc;
    p.which = which;
    p.transpose = transpose;
    p.precision = precision;
    if (ktki_job_run_inline(pool, &p.t)) {
        if (p.t.result != KTK_OK) ktki_error_set_msg(p.t.result, p.t.msg);
        return p.t.result;
    }
    rc = ktki_task_submit(&p.t);
    return rc == KTK_OK ? ktki_task_wait(&p.t) : rc;
}
