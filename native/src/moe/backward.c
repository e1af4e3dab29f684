/* Backward of a routed-experts forward (moe/forward.c): generic C, threaded over the pool.
 *
 * For every routed row r (token t, slot j, expert e, routing weight w) the forward computes
 *   g_r = gate_e(x_t) + bg,  u_r = up_e(x_t) + bu,  h_r = act(g_r, u_r),  y_r = down_e(h_r) + bd,
 *   out[t] = sum_r w_r * y_r.
 * Given dy = d loss / d out [T, H]:
 *   v_r  = down_e^T dy_t                               [I]  (the transposed product with the stored down weights)
 *   dw_r = <v_r, h_r> + <dy_t, bd>                          (= <dy_t, y_r>: the routing weight's gradient, y_r unbuilt)
 *   dh_r = w_r v_r;  dg_r, du_r = act'(g_r, u_r) * dh_r     (elementwise)
 *   dx_t = sum_r gate_e^T dg_r + up_e^T du_r           [H]
 * Nothing of the forward is kept but its inputs (x, ids, weights): g_r and u_r are recomputed, at the cost of the
 * gate and up products the transposed ones need the same weights for anyway.
 * Arithmetic: float, on the stored weights dequantized block by block of 16 rows as ktk_experts_get gives them
 * (bf16 values, q * scale, e4m3 * scale: ktki_pack_unpack), x and dy read as float and never rounded to bf16 / int8
 * as the forward's activations are: the gradient of the forward's function at the stored weights, to float
 * rounding; dw accumulates in double. Derivatives of the activations are torch's: clamp passes the gradient where
 * the value lies inside its bounds, bounds included.
 * Steps (a job of the pool, as the forward's):
 *   route (serial): validate ids, rows sorted by (expert, token, slot), the row of each slot (-1: skipped);
 *   rows (items: an expert's rows, at most BR a chunk): each matrix's blocks dequantized once per chunk (down for v,
 *        then gate and up block by block for g, u, h, dw and the row's own dx), into the thread's scratch and the
 *        per-row table dxr [R][H];
 *   combine (items of TOK_ITEM tokens): dx[t] = the sum of its slots' rows of dxr in slot order; dw by slot (0 for
 *        a slot not computed here).
 * Every sum runs in a fixed order: results do not depend on the threads. The rows step here is generic C (the
 * compiler's baseline vectorization only): the reference of the ISA one (rows_item_isa, on the kernels of
 * ktki_dispatch_backward: avx2, avx512 / amx), which dequantizes each block once per chunk to float in both orders
 * (columns for g, u; rows for the transposed products) and sums with FMAs in its own fixed order
 * (kernels/avx2/backward.c, kernels/avx512/backward.c): equal to this step to float rounding, not bit for bit.
 * Legend: T tokens, k slots per token, E experts, H hidden, I expert intermediate, A active experts, R rows.
 */
#include <math.h>
#include <string.h>

#include "../internal.h"

#define BR 32          /* rows per item of the rows phase */
#define TOK_ITEM 16    /* tokens per item of the combine phase */

typedef struct {
    ktk_task t;        /* first: the pool runs it; the steps find the rest through it */
    const void *dy;
    int dy_dtype;
    void *dx;          /* [T, H] dx_dtype, or NULL */
    int dx_dtype;
    float *dw;         /* [T, k] float, or NULL */
} bwd_task;

typedef struct { int32_t a, r0, r1; } bwd_item;

typedef struct {
    const bwd_task *b;
    const ktk_experts *ex;
    ktk_pool *pool;
    int T, k, E, H, I, act;
    float alpha, limit;
    int A, R, step;
    int32_t *cnt, *act_e, *off, *slot, *rowof;   /* [E], [A], [A + 1], [R]: the row's slot t * k + j, [T * k] */
    float *dxr;                                   /* [R][H], or NULL without dx */
    double *dwr;                                  /* [R] */
    bwd_item *items;
    int64_t nitems;
    const ktk_bwd_kernels *bk;                    /* NULL: the generic rows step */
} bctx;


static float weight_of(const ktk_task *t, int64_t i) {
    if (t->weights_dtype == KTK_DTYPE_F32) return ((const float *)t->weights)[i];
    return ktk_bf16_to_f32(((const uint16_t *)t->weights)[i]);
}

/* ---- route ---- */
static int route(bctx *c) {
    const ktk_task *t = &c->b->t;
    const int64_t n = (int64_t)c->T * c->k;
    memset(c->cnt, 0, (size_t)c->E * sizeof *c->cnt);
    for (int64_t i = 0; i < n; i++) {
        const int64_t id = t->ids[i];
        if (id < 0 || id >= c->E)
            return ktki_error(KTK_ERR_RANGE, "backward: expert id out of range: ids[%lld][%lld] = %lld, expected "
                              "0 <= id < E = %d", (long long)(i / c->k), (long long)(i % c->k), (long long)id, c->E);
        if (!(t->skip && t->skip[id])) c->cnt[id]++;
    }
    c->A = c->R = 0;
    c->nitems = 0;
    for (int e = 0; e < c->E; e++) {
        if (!c->cnt[e]) continue;
        for (int w = 0; w < 3; w++)
            if (!c->ex->ready[(int64_t)e * 3 + w])
                return ktki_error(KTK_ERR_STATE, "backward: expert %d is routed to but its %s weights were never "
                                  "set (ktk_experts_set)", e, w == 0 ? "gate" : w == 1 ? "up" : "down");
        const int rows = c->cnt[e];
        c->act_e[c->A] = e;
        c->off[c->A++] = c->R;
        c->nitems += (rows + BR - 1) / BR;
        c->cnt[e] = c->R;   /* from here on: the expert's next free row */
        c->R += rows;
    }
    c->off[c->A] = c->R;
    for (int64_t i = 0; i < n; i++) {   /* slot order: an expert's rows come out sorted by token, then slot */
        const int64_t id = t->ids[i];
        if (t->skip && t->skip[id]) {
            c->rowof[i] = -1;
            continue;
        }
        const int32_t r = c->cnt[id]++;
        c->slot[r] = (int32_t)i;
        c->rowof[i] = r;
    }
    return KTK_OK;
}

/* ---- rows ---- */
/* h = act(g, u) and its partial derivatives dh/dg, dh/du (g, u with their biases) */
static float act_grad(const bctx *c, float g, float u, float *dg, float *du) {
    if (c->act == KTK_ACT_SILU) {
        const float s = 1.0f / (1.0f + expf(-g)), silu = g * s;
        *dg = u * s * (1.0f + g * (1.0f - s));
        *du = silu;
        return silu * u;
    }
    const float gc = fminf(g, c->limit), uc = fminf(fmaxf(u, -c->limit), c->limit);
    if (c->act == KTK_ACT_SWIGLU_LIMIT) {   /* silu(gc) * uc */
        const float s = 1.0f / (1.0f + expf(-gc)), silu = gc * s;
        *dg = g <= c->limit ? uc * s * (1.0f + gc * (1.0f - s)) : 0.0f;
        *du = u >= -c->limit && u <= c->limit ? silu : 0.0f;
        return silu * uc;
    }
    const float s = 1.0f / (1.0f + expf(-c->alpha * gc)), glu = gc * s;
    *dg = g <= c->limit ? (uc + 1.0f) * s * (1.0f + c->alpha * gc * (1.0f - s)) : 0.0f;
    *du = u >= -c->limit && u <= c->limit ? glu : 0.0f;
    return glu * (uc + 1.0f);
}

static float dot(const float *a, const float *b, int n) {
    float s = 0.0f;
    for (int i = 0; i < n; i++) s += a[i] * b[i];
    return s;
}

/* Rows [r0, r0 + n) of matrix m's 16-row block b, dequantized, as float rows of m.K at dst; returns the row count */
static int unpack_block(const ktk_mat *m, int b, float *dst) {
    const int n = m->N - b * 16 < 16 ? m->N - b * 16 : 16;
    for (int j = 0; j < n; j++) ktki_pack_unpack(m, b * 16 + j, dst + (int64_t)j * m->K);
    return n;
}

/* Thread scratch of the rows phase: X, DY [BR][H], V [BR][I], two blocks of 16 rows of max(H, I) and the gate and
 * up blocks transposed [H][16] (their products with x then run 16 outputs at once, each summed in ascending c). */
static size_t rows_scratch(const bctx *c) {
    const size_t wide = (size_t)(c->H > c->I ? c->H : c->I);
    return (a64((size_t)BR * c->H * 4) * 2 + a64((size_t)BR * c->I * 4) + a64(16 * wide * 4) * 4) + 64;
}

/* wt[c][jj] = w[jj][c] for jj < 16 (rows past n zero), c < K */
static void transpose_block(const float *w, int n, int K, float *wt) {
    for (int c = 0; c < K; c++)
        for (int jj = 0; jj < 16; jj++) wt[(int64_t)c * 16 + jj] = jj < n ? w[(int64_t)jj * K + c] : 0.0f;
}

static void rows_item(void *ctx, int64_t item, int tid) {
    const bctx *c = ctx;
    const bwd_item it = c->items[item];
    const ktk_task *t = &c->b->t;
    const int e = c->act_e[it.a], n = it.r1 - it.r0, H = c->H, I = c->I;
    const size_t wide = (size_t)(H > I ? H : I);
    float *X = ktki_pool_thread_scratch(c->pool, tid);
    float *DY = X + a64((size_t)BR * H * 4) / 4, *V = DY + a64((size_t)BR * H * 4) / 4;
    float *W0 = V + a64((size_t)BR * I * 4) / 4, *W1 = W0 + a64(16 * wide * 4) / 4;
    float *T0 = W1 + a64(16 * wide * 4) / 4, *T1 = T0 + a64(16 * wide * 4) / 4;
    const int64_t hes = ktki_dtype_size(t->hidden_dtype), des = ktki_dtype_size(c->b->dy_dtype);
    for (int i = 0; i < n; i++) {
        const int64_t tok = c->slot[it.r0 + i] / c->k;
        ktki_pack_to_f32((const char *)t->hidden + tok * H * hes, t->hidden_dtype, H, 1, X + (int64_t)i * H);
        ktki_pack_to_f32((const char *)c->b->dy + tok * H * des, c->b->dy_dtype, H, 1, DY + (int64_t)i * H);
    }
    /* v = down^T dy, down [H, I] block by block of 16 of its H rows; dw's bias term */
    const ktk_mat d = ktki_experts_mat(c->ex, e, KTK_MAT_DOWN);
    const float *bd = ktki_experts_bias(c->ex, e, KTK_MAT_DOWN);
    memset(V, 0, (size_t)n * I * sizeof *V);
    for (int b = 0; b < (H + 15) / 16; b++) {
        const int jn = unpack_block(&d, b, W0);
        for (int i = 0; i < n; i++) {
            float *vr = V + (int64_t)i * I;
            const float *dyr = DY + (int64_t)i * H + b * 16;
            for (int jj = 0; jj < jn; jj++) {
                const float s = dyr[jj], *wr = W0 + (int64_t)jj * I;
                for (int q = 0; q < I; q++) vr[q] += s * wr[q];
            }
        }
    }
    for (int i = 0; i < n; i++) c->dwr[it.r0 + i] = bd ? (double)dot(DY + (int64_t)i * H, bd, H) : 0.0;
    /* gate and up block by block of 16 of their I rows: g, u, h, dw, then dx += gate^T dg + up^T du */
    const ktk_mat g = ktki_experts_mat(c->ex, e, KTK_MAT_GATE), u = ktki_experts_mat(c->ex, e, KTK_MAT_UP);
    const float *bg = ktki_experts_bias(c->ex, e, KTK_MAT_GATE), *bu = ktki_experts_bias(c->ex, e, KTK_MAT_UP);
    if (c->dxr) memset(c->dxr + (int64_t)it.r0 * H, 0, (size_t)n * H * sizeof *c->dxr);
    for (int b = 0; b < (I + 15) / 16; b++) {
        const int jn = unpack_block(&g, b, W0);
        unpack_block(&u, b, W1);
        transpose_block(W0, jn, H, T0);
        transpose_block(W1, jn, H, T1);
        for (int i = 0; i < n; i++) {
            const int r = it.r0 + i;
            const float *xr = X + (int64_t)i * H, *vr = V + (int64_t)i * I + b * 16;
            const float w = weight_of(t, c->slot[r]);
            float *dxr = c->dxr ? c->dxr + (int64_t)r * H : NULL;
            float ag[16] = {0}, au[16] = {0};   /* gate and up of the block's 16 outputs, each summed in ascending c */
            for (int q = 0; q < H; q++) {
                const float xq = xr[q], *tg = T0 + (int64_t)q * 16, *tu = T1 + (int64_t)q * 16;
                for (int jj = 0; jj < 16; jj++) {
                    ag[jj] += xq * tg[jj];
                    au[jj] += xq * tu[jj];
                }
            }
            double dw = 0.0;
            for (int jj = 0; jj < jn; jj++) {
                const int j = b * 16 + jj;
                const float *wg = W0 + (int64_t)jj * H, *wu = W1 + (int64_t)jj * H;
                const float gv = ag[jj] + (bg ? bg[j] : 0.0f), uv = au[jj] + (bu ? bu[j] : 0.0f);
                float hg, hu;
                const float h = act_grad(c, gv, uv, &hg, &hu);
                dw += (double)vr[jj] * h;
                if (!dxr) continue;
                const float dh = w * vr[jj], dg = dh * hg, du = dh * hu;
                for (int q = 0; q < H; q++) dxr[q] += dg * wg[q] + du * wu[q];
            }
            c->dwr[r] += dw;
        }
    }
}

/* ---- rows, on an ISA's kernels ---- */
static size_t r16(size_t n) { return (n + 15) & ~(size_t)15; }

/* Thread scratch of rows_item_isa (floats): X, DY [BR][Hp], V [BR][Ip], the gate and up blocks in both orders
 * [wide][16] and [16][wide] (down's block rows reuse the gate's), G, U, dG, dU [BR][16]; Hp, Ip: H, I to 16. */
static size_t rows_scratch_isa(const bctx *c) {
    const size_t Hp = r16(c->H), Ip = r16(c->I), wide = Hp > Ip ? Hp : Ip;
    return (a64((size_t)BR * Hp * 4) * 2 + a64((size_t)BR * Ip * 4) + a64(16 * wide * 4) * 4 +
            a64((size_t)BR * 16 * 4) * 4) + 64;
}

/* Block b of gate / up for the chunk's n rows from g, u (G, U [n][16]) and v (V rows Ip apart): dw += <v, h>, dG, dU
 * [n][16] = w v act' (zero past I) */
static void act_block(const bctx *c, const bwd_item *it, int b, int n, const float *G, const float *U,
                      const float *V, int Ip, float *DG, float *DU) {
    const ktk_task *t = &c->b->t;
    const int e = c->act_e[it->a], jn = c->I - b * 16 < 16 ? c->I - b * 16 : 16;
    const float *bg = ktki_experts_bias(c->ex, e, KTK_MAT_GATE), *bu = ktki_experts_bias(c->ex, e, KTK_MAT_UP);
    for (int i = 0; i < n; i++) {
        const int r = it->r0 + i;
        const float *vr = V + (int64_t)i * Ip + b * 16;
        const float w = weight_of(t, c->slot[r]);
        double dw = 0.0;
        for (int jj = 0; jj < 16; jj++) {
            float hg = 0.0f, hu = 0.0f;
            if (jj < jn) {
                const int j = b * 16 + jj;
                const float h = act_grad(c, G[i * 16 + jj] + (bg ? bg[j] : 0.0f),
                                         U[i * 16 + jj] + (bu ? bu[j] : 0.0f), &hg, &hu);
                dw += (double)vr[jj] * h;
            }
            DG[i * 16 + jj] = w * vr[jj] * hg;   /* zero past I: padded rows of the block add nothing */
            DU[i * 16 + jj] = w * vr[jj] * hu;
        }
        c->dwr[r] += dw;
    }
}

static void rows_item_isa(void *ctx, int64_t item, int tid) {
    const bctx *c = ctx;
    const ktk_bwd_kernels *bk = c->bk;
    const bwd_item it = c->items[item];
    const ktk_task *t = &c->b->t;
    const int e = c->act_e[it.a], n = it.r1 - it.r0, H = c->H, I = c->I;
    const int Hp = (int)r16(H), Ip = (int)r16(I), wide = Hp > Ip ? Hp : Ip, few = n <= bk->few_rows;
    float *X = ktki_pool_thread_scratch(c->pool, tid);
    float *DY = X + a64((size_t)BR * Hp * 4) / 4, *V = DY + a64((size_t)BR * Hp * 4) / 4;
    float *WTg = V + a64((size_t)BR * Ip * 4) / 4, *WTu = WTg + a64(16 * (size_t)wide * 4) / 4;
    float *WRg = WTu + a64(16 * (size_t)wide * 4) / 4, *WRu = WRg + a64(16 * (size_t)wide * 4) / 4;
    float *G = WRu + a64(16 * (size_t)wide * 4) / 4, *U = G + a64((size_t)BR * 16 * 4) / 4;
    float *DG = U + a64((size_t)BR * 16 * 4) / 4, *DU = DG + a64((size_t)BR * 16 * 4) / 4;
    float *Av = WTg, *Ax = WTg;   /* few rows: per-lane sums [n][Ip][16], then [n][Hp][16] (n <= few_rows <= 4) */
    const int64_t hes = ktki_dtype_size(t->hidden_dtype), des = ktki_dtype_size(c->b->dy_dtype);
    for (int i = 0; i < n; i++) {   /* rows padded with zeros to Hp: the kernels read whole vectors */
        const int64_t tok = c->slot[it.r0 + i] / c->k;
        float *xr = X + (int64_t)i * Hp, *dyr = DY + (int64_t)i * Hp;
        ktki_pack_to_f32((const char *)t->hidden + tok * H * hes, t->hidden_dtype, H, 1, xr);
        ktki_pack_to_f32((const char *)c->b->dy + tok * H * des, c->b->dy_dtype, H, 1, dyr);
        memset(xr + H, 0, (size_t)(Hp - H) * sizeof *xr);
        memset(dyr + H, 0, (size_t)(Hp - H) * sizeof *dyr);
    }
    /* v = down^T dy block by block of 16 of down's H rows */
    const ktk_mat d = ktki_experts_mat(c->ex, e, KTK_MAT_DOWN);
    const float *bd = ktki_experts_bias(c->ex, e, KTK_MAT_DOWN);
    memset(few ? Av : V, 0, (size_t)n * Ip * (few ? 16 : 1) * sizeof *V);
    for (int b = 0; b < Hp / 16; b++) {
        if (few) {
            bk->tacc(&d, b, DY + b * 16, Hp, n, Av);
            continue;
        }
        bk->unpack(&d, b, NULL, WRg, Ip);
        bk->tprod(WRg, DY + b * 16, NULL, NULL, Hp, Ip, I, n, V, Ip);
    }
    if (few) {
        memset(V, 0, (size_t)n * Ip * sizeof *V);
        bk->hsum(Av, I, n, V, Ip);
    }
    for (int i = 0; i < n; i++) c->dwr[it.r0 + i] = bd ? (double)dot(DY + (int64_t)i * Hp, bd, H) : 0.0;
    /* gate and up block by block of 16 of their I rows: g, u, h, dw, then dx += gate^T dg + up^T du */
    const ktk_mat g = ktki_experts_mat(c->ex, e, KTK_MAT_GATE), u = ktki_experts_mat(c->ex, e, KTK_MAT_UP);
    float *dxr = c->dxr ? c->dxr + (int64_t)it.r0 * H : NULL;
    if (dxr && few) memset(Ax, 0, (size_t)n * Hp * 16 * sizeof *Ax);
    else if (dxr) memset(dxr, 0, (size_t)n * H * sizeof *dxr);
    for (int b = 0; b < Ip / 16; b++) {
        if (few) {
            bk->gate_up_packed(&g, &u, b, X, Hp, n, G, U);
        } else {
            bk->unpack(&g, b, WTg, WRg, Hp);
            bk->unpack(&u, b, WTu, WRu, Hp);
            bk->gate_up(WTg, WTu, Hp, X, Hp, n, G, U);
        }
        act_block(c, &it, b, n, G, U, V, Ip, DG, DU);
        if (!dxr) continue;
        if (few) {
            bk->tacc(&g, b, DG, 16, n, Ax);
            bk->tacc(&u, b, DU, 16, n, Ax);
        } else {
            bk->tprod(WRg, DG, WRu, DU, 16, Hp, H, n, dxr, H);
        }
    }
    if (dxr && few) bk->hsum(Ax, H, n, dxr, H);
}

/* ---- combine ---- */
static void combine_item(void *ctx, int64_t item, int tid) {
    const bctx *c = ctx;
    const int t0 = (int)(item * TOK_ITEM), t1 = t0 + TOK_ITEM < c->T ? t0 + TOK_ITEM : c->T, H = c->H;
    float *acc = ktki_pool_thread_scratch(c->pool, tid);
    for (int tk = t0; tk < t1; tk++) {
        const int32_t *rows = c->rowof + (int64_t)tk * c->k;
        if (c->b->dw)
            for (int j = 0; j < c->k; j++)
                c->b->dw[(int64_t)tk * c->k + j] = rows[j] < 0 ? 0.0f : (float)c->dwr[rows[j]];
        if (!c->b->dx) continue;
        memset(acc, 0, (size_t)H * sizeof *acc);
        for (int j = 0; j < c->k; j++) {
            if (rows[j] < 0) continue;
            const float *src = c->dxr + (int64_t)rows[j] * H;
            for (int q = 0; q < H; q++) acc[q] += src[q];
        }
        if (c->b->dx_dtype == KTK_DTYPE_F32) {
            memcpy((float *)c->b->dx + (int64_t)tk * H, acc, (size_t)H * sizeof *acc);
        } else {
            uint16_t *o = (uint16_t *)c->b->dx + (int64_t)tk * H;
            for (int q = 0; q < H; q++) o[q] = ktk_f32_to_bf16(acc[q]);
        }
    }
}

/* ---- steps ---- */
/* Tables (KTKI_SCR_ROUTE), items (KTKI_SCR_ITEMS), dxr and dwr (KTKI_SCR_X), thread scratch; then the route. */
static int start(bctx *c, ktk_pool *pool, const bwd_task *b) {
    const ktk_experts *ex = b->t.ex;
    *c = (bctx){.b = b, .ex = ex, .pool = pool, .T = b->t.T, .k = b->t.k, .E = ex->cfg.num_experts,
                .H = ex->cfg.hidden, .I = ex->cfg.intermediate, .act = ex->cfg.activation, .alpha = ex->cfg.alpha,
                .limit = ex->cfg.limit};
    const size_t n = (size_t)c->T * c->k, E = (size_t)c->E;
    uint8_t *rs = ktki_pool_scratch(pool, KTKI_SCR_ROUTE, 3 * a64(E * 4 + 4) + 2 * a64(n * 4));
    if (!rs) return ktki_error(KTK_ERR_NOMEM, "backward: out of memory (routing tables)");
    c->cnt = (int32_t *)rs;
    c->act_e = (int32_t *)(rs + a64(E * 4 + 4));
    c->off = (int32_t *)(rs + 2 * a64(E * 4 + 4));
    c->slot = (int32_t *)(rs + 3 * a64(E * 4 + 4));
    c->rowof = (int32_t *)(rs + 3 * a64(E * 4 + 4) + a64(n * 4));
    int rc = route(c);
    if (rc != KTK_OK) return rc;
    c->items = ktki_pool_scratch(pool, KTKI_SCR_ITEMS, (size_t)(c->nitems + 1) * sizeof *c->items);
    const size_t R = (size_t)c->R, dxr = b->dx ? a64(R * c->H * 4) : 0;
    uint8_t *rows = ktki_pool_scratch(pool, KTKI_SCR_X, dxr + a64(R * 8) + 64);
    if (!c->items || !rows) return ktki_error(KTK_ERR_NOMEM, "backward: out of memory (%d rows, H=%d)", c->R, c->H);
    c->dxr = b->dx ? (float *)rows : NULL;
    c->dwr = (double *)(rows + dxr);
    int64_t m = 0;
    for (int a = 0; a < c->A; a++)
        for (int r0 = c->off[a]; r0 < c->off[a + 1]; r0 += BR)
            c->items[m++] = (bwd_item){a, r0, r0 + BR < c->off[a + 1] ? r0 + BR : c->off[a + 1]};
    c->bk = ktki_dispatch_backward();
    const int q = ex->cfg.quant;   /* the ISA kernels know these formats; any other runs the generic step */
    if (q != KTK_QUANT_BF16 && q != KTK_QUANT_INT8 && q != KTK_QUANT_INT4 && q != KTK_QUANT_FP8) c->bk = NULL;
    const size_t rs_bytes = c->bk ? rows_scratch_isa(c) : rows_scratch(c);
    const size_t per = rs_bytes > (size_t)c->H * 4 + 64 ? rs_bytes : (size_t)c->H * 4 + 64;
    if (!ktki_pool_thread_scratch_reserve(pool, per))
        return ktki_error(KTK_ERR_NOMEM, "backward: out of memory (thread scratch of %zu bytes)", per);
    return KTK_OK;
}

static int backward_step(ktk_pool *pool, ktk_task *task, int first, ktki_phase *ph) {
    bctx *c = ktki_pool_scratch(pool, KTKI_SCR_JOB, sizeof *c);   /* the same buffer at every step (grow-only) */
    if (!c) return ktki_error(KTK_ERR_NOMEM, "backward: out of memory");
    if (first) {
        int rc = start(c, pool, (const bwd_task *)task);
        if (rc != KTK_OK) return rc;
    }
    for (;;) {
        switch (c->step++) {
        case 0:
            if (c->nitems == 0) break;
            *ph = (ktki_phase){c->bk ? rows_item_isa : rows_item, NULL, c, c->nitems, 1, 0, 1, 0};
            return KTKI_PHASE;
        case 1:
            *ph = (ktki_phase){combine_item, NULL, c, (c->T + TOK_ITEM - 1) / TOK_ITEM, 1, 0, 1, 0};
            return KTKI_PHASE;
        default:
            return KTK_OK;
        }
    }
}

int ktki_backward(ktk_pool *pool, ktk_experts *ex, int T, int k, const void *hidden, int hidden_dtype,
                  const int64_t *ids, const void *weights, int weights_dtype, const uint8_t *skip, const void *dy,
                  int dy_dtype, void *dx, int dx_dtype, float *dweights) {
    bwd_task b;   /* on the stack: the pool's last touch is the IDLE store, then wait returns */
    ktki_task_init(&b.t, pool);
    int rc = ktki_task_bind(&b.t, backward_step, ex, T, k, hidden, hidden_dtype, ids, weights, weights_dtype, skip,
                            dx, dx_dtype);
    if (rc != KTK_OK) return rc;
    b.dy = dy;
    b.dy_dtype = dy_dtype;
    b.dx = dx;
    b.dx_dtype = dx_dtype;
    b.dw = dweights;
    if (ktki_job_run_inline(pool, &b.t)) {
        if (b.t.result != KTK_OK) ktki_error_set_msg(b.t.result, b.t.msg);
        return b.t.result;
    }
    rc = ktki_task_submit(&b.t);
    return rc == KTK_OK ? ktki_task_wait(&b.t) : rc;
}
