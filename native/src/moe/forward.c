/* Forward orchestration of one MoE layer (ISA-independent; the kernels do the matrix products; gather.c makes the
 * activations they read).
 *
 * A forward is a job of the pool (runtime/pool.c, which calls its steps through the task: ktk_task.step): serial
 * steps and parallel phases, each phase's items claimed in chunks by
 * whichever threads come; the thread that finishes a phase's last chunk starts the next (ktki_forward_step):
 *   route (serial, route.c): validate ids, count rows per expert (skipping masked experts and, for expert
 *                   deferral, the slots of the other part), rows sorted by (expert, token)
 *   gather:   x [R, Kp(H)] activations of every row (bf16 zero-padded, or int8 per row + scale + sum; gather.c)
 *   gate/up:  items (expert, <= RT rows, <= CWMAX blocks of 16 outputs of I): h = act(g + bg, u + bu)
 *             -> h [R, Kp(I)] bf16, or float [R, I] quantized per row in a following phase for int8 / int4
 *   down:     items (<= CWMAX blocks of 16 columns of H, <= TC tokens): for each active expert in ascending
 *             order, acc[t] += w * (down_e(h) + bd) on these columns; then out = acc (F32 or BF16). One item owns
 *             its (tokens, columns) of out, so the sum order per token is fixed: results do not depend on threads.
 * One-token forwards keep gather and h's quantization as phases (one item each): run inline on the task's thread
 * instead, they measured slightly slower (cause not established).
 * Decode forwards (the gemv path below) run gate/up, h's quantization and down as one phase instead (pipeline.c).
 * A split task (expert deferral) runs those phases for its immediate part's experts, raises its done word, then
 * runs them for the deferred part's (running gate/up of both parts first raised the word much later in the job).
 * int4 weights take int8 activations; when an expert has >= KTK_INT4_DEQUANT_MIN_ROWS_ANY rows (or
 * KTINJECT_INT4_PATH=dequant), x and h also get exact bf16 copies of their int8 values and each thread a workspace,
 * so the kernel may dequantize the weights to bf16 for many rows (kernels/kernels.h; the ISA picks by row count).
 * Block sizes give >= ITEMS_PER_THREAD items per thread where possible: 1 token x 8 experts has 8 experts x
 * (I/16/cw) gate/up items and (H/16/cw) down items; thousands of tokens split into RT-row and TC-token chunks.
 *
 * Decode (every expert <= DECODE_ROWS rows, T <= TC, and the kernels have a gemv for the quant): the two phases'
 * units (gate/up: (expert, block of 16 outputs of I); down: blocks of 16 columns of H) are claimed in guided chunks:
 * rem / (2 threads) units, at most CWMAX, at least 1, so every thread finishes within about one small chunk of the
 * others (fixed items of a fraction of a thread's share left a sizable part of a phase to the slowest thread), and a thread
 * that loses its core holds up one chunk. An expert with one row runs gate and up as one gemv (2 matrices), and the
 * down matrices of up to KTK_GEMV_MAX consecutive one-row experts as one gemv: 4 (gate/up) and up to 16 (down)
 * weight streams per thread instead of <= 4 of one matrix. Same arithmetic (gemv is bit-identical to gemm with one
 * row), same summation order.
 * Where the kernel table says so (gemv_default: measured faster there); KTINJECT_GEMV=0/1 overrides (tests, A/B);
 * never with KTINJECT_INT4_PATH=dequant or KTINJECT_FP8_PATH=dequant (those paths are for many rows).
 * fp8 weights take bf16 activations (as bf16 weights) and every thread a workspace: the direct kernel converts its
 * rows of x or h to float there, the dequantizing path (from KTK_FP8_DEQUANT_MIN_ROWS_ANY rows, or
 * KTINJECT_FP8_PATH=dequant) its bf16 blocks; KTINJECT_FP8_PATH=direct never plans the latter. mxfp4 weights
 * likewise (the same workspace, path and KTINJECT_FP8_PATH).
 */
#include <stdlib.h>
#include <string.h>

#include "forward.h"

/* ---- block sizes and scratch ---- */
static int choose_cw(int64_t row_chunks, int units, int threads) {
    int64_t target = (int64_t)ITEMS_PER_THREAD * threads;
    int cw = CWMAX;
    while (cw > 1 && row_chunks * ((units + cw - 1) / cw) < target) cw /= 2;
    return cw < units ? cw : units;
}

/* Rows of x an fp8 direct call converts to float at once, at most (more rows: several chunks, the weights read again
 * for each); a gemv's M rows at least. */
#define FP8_DIRECT_ROWS 32

/* The workspace per thread (0: none): int4 with bf16 copies, the widest call's blocks dequantized at once; fp8, the
 * larger of that (where the dequantizing path may run) and the float rows of the direct path. */
static int64_t work_bytes(const fctx *c) {
    const int cw = c->cw_gu > c->cw_dn ? c->cw_gu : c->cw_dn, kp = c->KpH > c->KpI ? c->KpH : c->KpI;
    if (c->copies) return ktk_int4_work_bytes(kp, cw);
    if (c->quant != KTK_QUANT_FP8 && c->quant != KTK_QUANT_MXFP4) return 0;   /* mxfp4: as fp8 */
    int rows = c->maxrows < FP8_DIRECT_ROWS ? c->maxrows : FP8_DIRECT_ROWS;
    rows = c->gemv && rows < KTK_GEMV_MAX ? KTK_GEMV_MAX : rows < 1 ? 1 : rows;
    int64_t n = ktk_fp8_rows_bytes(kp, rows);
    const int dq = c->fp8_path == KTK_FP8_PATH_DEQUANT ||
                   (c->fp8_path == KTK_FP8_PATH_AUTO && c->maxrows >= KTK_FP8_DEQUANT_MIN_ROWS_ANY);
    if (dq && ktk_int4_work_bytes(kp, cw) > n) n = ktk_int4_work_bytes(kp, cw);
    return n;
}

static int plan(fctx *c) {
    const int nt = c->nt;
    int64_t chunks = 0;
    for (int a = 0; a < c->A; a++) chunks += (c->off[a + 1] - c->off[a] + RT - 1) / RT;
    c->cw_gu = choose_cw(chunks, c->UI, nt);
    c->ntc = (c->T + TC - 1) / TC;
    c->cw_dn = choose_cw(c->ntc, c->UH, nt);
    if (c->gemv) {   /* decode: chunks of at most CWMAX blocks (scratch sizes below) */
        c->cw_gu = CWMAX < c->UI ? CWMAX : c->UI;
        c->cw_dn = CWMAX < c->UH ? CWMAX : c->UH;
    }
    const int ngroups = (c->UI + c->cw_gu - 1) / c->cw_gu;
    c->gu = ktki_pool_scratch(c->pool, KTKI_SCR_ITEMS, (size_t)(c->gemv ? 1 : chunks * ngroups + 1) * sizeof(gu_item));
    if (!c->gu) return 0;
    c->ngu = 0;
    c->gu_part1 = -1;
    for (int a = 0; a < (c->gemv ? 0 : c->A); a++) {
        if (a == c->pa[1] && c->gu_part1 < 0) c->gu_part1 = c->ngu;   /* items in expert order: part 0's first */
        for (int g = 0; g < ngroups; g++)
            for (int r0 = c->off[a]; r0 < c->off[a + 1]; r0 += RT) {
                int r1 = r0 + RT < c->off[a + 1] ? r0 + RT : c->off[a + 1];
                int cb1 = (g + 1) * c->cw_gu < c->UI ? (g + 1) * c->cw_gu : c->UI;
                c->gu[c->ngu++] = (gu_item){a, r0, r1, g * c->cw_gu, cb1};
            }
    }
    if (c->gu_part1 < 0) c->gu_part1 = c->ngu;
    if (!ktki_gather_plan(c)) return 0;
    if (c->pipe && !ktki_pipeline_plan(c)) return 0;
    size_t per_thread = (size_t)c->H * 4;
    size_t gu = 2 * (size_t)RT * c->cw_gu * 16 * 4, dn = (size_t)(RT + TC) * c->cw_dn * 16 * 4;
    per_thread = per_thread > gu ? per_thread : gu;
    per_thread = per_thread > dn ? per_thread : dn;
    c->work_bytes = work_bytes(c);
    if (c->work_bytes > 0) {
        c->work_off = (int64_t)a64(per_thread);
        per_thread = (size_t)(c->work_off + c->work_bytes);
    }
    return ktki_pool_thread_scratch_reserve(c->pool, per_thread + 64);
}

/* ---- gate/up + activation ---- */
/* Gate/up of expert a (active index), rows [r0, r1), blocks [cb0, cb1) -> h; gs, us: the thread's scratch. */
void ktki_forward_gate_up(const fctx *c, int a, int r0, int r1, int cb0, int cb1, float *gs, float *us, int tid) {
    const int e = c->act_e[a], bw = (cb1 - cb0) * 16;
    const ktk_mat g = ktki_experts_mat(c->ex, e, KTK_MAT_GATE), u = ktki_experts_mat(c->ex, e, KTK_MAT_UP);
    const float *bg = ktki_experts_bias(c->ex, e, KTK_MAT_GATE), *bu = ktki_experts_bias(c->ex, e, KTK_MAT_UP);
    ktk_act x = ktki_gather_rows(c, 0, a, r0, r1, tid);
    if (c->gemv && r1 - r0 == 1) {   /* gate and up streamed together */
        const ktk_mat *w[2] = {&g, &u};
        const ktk_act *xs[2] = {&x, &x};
        float *ys[2] = {gs, us};
        c->gemv(2, w, cb0, cb1, xs, ys);
    } else {
        c->gemm(&g, cb0, cb1, &x, gs, bw);
        c->gemm(&u, cb0, cb1, &x, us, bw);
    }
    const int j0 = cb0 * 16, j1 = cb1 * 16 < c->I ? cb1 * 16 : c->I, last = cb1 * 16 >= c->I;
    for (int r = r0; r < r1; r++) {
        float *gr = gs + (int64_t)(r - r0) * bw, *ur = us + (int64_t)(r - r0) * bw;
        float *hf = c->a8 ? c->hf + (int64_t)r * c->I + j0 : gr;   /* bf16: in place, then rounded */
        ktki_activations(c->act, c->alpha, c->limit, gr, ur, bg ? bg + j0 : NULL, bu ? bu + j0 : NULL, j1 - j0, hf);
        if (c->a8) continue;
        uint16_t *hr = c->h16 + (int64_t)r * c->KpI;
        for (int j = j0; j < j1; j++) hr[j] = ktk_f32_to_bf16(gr[j - j0]);
        if (last) memset(hr + c->I, 0, (size_t)(c->KpI - c->I) * 2);
        ktki_gather_to_tiles(c, 1, a, r, hr, (int64_t)j0 * 2, (int64_t)(last ? c->KpI : j1) * 2);
    }
}

static void gate_up_item(void *ctx, int64_t item, int tid) {
    fctx *c = ctx;
    const gu_item it = c->gu[c->base + item];
    float *gs = ktki_pool_thread_scratch(c->pool, tid), *us = gs + (int64_t)RT * (it.cb1 - it.cb0) * 16;
    ktki_forward_gate_up(c, it.a, it.r0, it.r1, it.cb0, it.cb1, gs, us, tid);
}

/* Decode path, gate/up: units [u0, u1) of (expert a, block b) = a * UI + b, past base, a guided chunk (pool),
 * split at experts. */
static void gate_up_decode(void *ctx, int64_t u0, int64_t u1, int tid) {
    fctx *c = ctx;
    u0 += c->base;
    u1 += c->base;
    float *gs = ktki_pool_thread_scratch(c->pool, tid), *us = gs + (int64_t)DECODE_ROWS * c->cw_gu * 16;
    for (int64_t u = u0; u < u1;) {
        const int a = (int)(u / c->UI), cb0 = (int)(u % c->UI);
        const int cb1 = u1 - u < c->UI - cb0 ? cb0 + (int)(u1 - u) : c->UI;
        ktki_forward_gate_up(c, a, c->off[a], c->off[a + 1], cb0, cb1, gs, us, tid);
        u += cb1 - cb0;
    }
}

/* Off the pipeline, the active experts [*a0, *a1) the open phases compute: every one, or the split part c->dpart's. */
static void part_span(const fctx *c, int *a0, int *a1) {
    *a0 = c->dpart < 0 ? 0 : c->pa[c->dpart];
    *a1 = c->dpart < 0 ? c->A : c->pa[c->dpart + 1];
}

/* ---- down + combine ---- */
static int lower_bound(const int32_t *v, int lo, int hi, int32_t x) {
    while (lo < hi) {
        int mid = lo + (hi - lo) / 2;
        if (v[mid] < x) lo = mid + 1;
        else hi = mid;
    }
    return lo;
}

void ktki_forward_accumulate(const fctx *c, const float *y, int bw, int jn, const float *bd, int r0, int r1, int t0,
                       float *acc) {
    for (int r = r0; r < r1; r++) {
        const float w = c->wt[r], *yr = y + (int64_t)(r - r0) * bw;
        float *ar = acc + (int64_t)(c->tok[r] - t0) * bw;
        if (bd) for (int j = 0; j < jn; j++) ar[j] += w * (yr[j] + bd[j]);
        else for (int j = 0; j < jn; j++) ar[j] += w * yr[j];
    }
}

/* out[t][j0, j0 + jn) = ar, as out's dtype; part 1 (a split task's deferred slots): out2 */
void ktki_forward_write_out(const fctx *c, int part, int t, int j0, int jn, const float *ar) {
    void *out = part ? c->t->out2 : c->t->out;
    if (c->t->out_dtype == KTK_DTYPE_F32) {
        memcpy((float *)out + (int64_t)t * c->H + j0, ar, (size_t)jn * sizeof(float));
    } else {
        uint16_t *o = (uint16_t *)out + (int64_t)t * c->H + j0;
        for (int j = 0; j < jn; j++) o[j] = ktk_f32_to_bf16(ar[j]);
    }
}

void ktki_forward_zero_out(const fctx *c, int part) {
    memset(part ? c->t->out2 : c->t->out, 0, (size_t)c->T * c->H * (size_t)ktki_dtype_size(c->t->out_dtype));
}

/* Down for column blocks [cb0, cb1) and tokens [t0, t1): every active expert of the part in ascending order, then
 * the part's out. The decode path runs consecutive one-row experts (at most KTK_GEMV_MAX) as one gemv, then
 * accumulates them in the same order. y, acc: the thread's scratch (y: RT rows x bw; acc: (t1 - t0) x bw). */
static void down_part(const fctx *c, int part, int cb0, int cb1, int t0, int t1, float *y, float *acc, int tid) {
    const int bw = (cb1 - cb0) * 16, j0 = cb0 * 16, jn = (cb1 * 16 < c->H ? cb1 * 16 : c->H) - j0;
    const int a1 = c->pa[part + 1];
    memset(acc, 0, (size_t)(t1 - t0) * bw * sizeof(float));
    for (int a = c->pa[part]; a < a1;) {
        const int lo = lower_bound(c->tok, c->off[a], c->off[a + 1], t0);
        const int hi = lower_bound(c->tok, lo, c->off[a + 1], t1);
        if (c->gemv && hi - lo == 1 && t0 == 0 && t1 == c->T) {   /* a run of one-row experts (all tokens) */
            ktk_mat d[KTK_GEMV_MAX];
            ktk_act h[KTK_GEMV_MAX];
            const ktk_mat *dp[KTK_GEMV_MAX];
            const ktk_act *hp[KTK_GEMV_MAX];
            float *yp[KTK_GEMV_MAX];
            int n = 0;
            for (; a < a1 && n < KTK_GEMV_MAX && c->off[a + 1] - c->off[a] == 1; a++, n++) {
                d[n] = ktki_experts_mat(c->ex, c->act_e[a], KTK_MAT_DOWN);
                h[n] = ktki_gather_rows(c, 1, a, c->off[a], c->off[a] + 1, tid);
                dp[n] = &d[n], hp[n] = &h[n], yp[n] = y + (int64_t)n * bw;
            }
            c->gemv(n, dp, cb0, cb1, hp, yp);
            for (int i = 0; i < n; i++) {
                const int r = c->off[a - n + i];
                const float *bd = ktki_experts_bias(c->ex, c->act_e[a - n + i], KTK_MAT_DOWN);
                ktki_forward_accumulate(c, yp[i], bw, jn, bd ? bd + j0 : NULL, r, r + 1, t0, acc);
            }
            continue;
        }
        if (lo < hi) {
            const ktk_mat d = ktki_experts_mat(c->ex, c->act_e[a], KTK_MAT_DOWN);
            const float *bd = ktki_experts_bias(c->ex, c->act_e[a], KTK_MAT_DOWN);
            for (int r0 = lo; r0 < hi; r0 += RT) {
                const int r1 = r0 + RT < hi ? r0 + RT : hi;
                ktk_act h = ktki_gather_rows(c, 1, a, r0, r1, tid);
                c->gemm(&d, cb0, cb1, &h, y, bw);
                ktki_forward_accumulate(c, y, bw, jn, bd ? bd + j0 : NULL, r0, r1, t0, acc);
            }
        }
        a++;
    }
    for (int t = t0; t < t1; t++) ktki_forward_write_out(c, part, t, j0, jn, acc + (int64_t)(t - t0) * bw);
}

/* Every part's down, or the one the phase is for (a split task off the pipeline: c->dpart) */
static void down_run(const fctx *c, int cb0, int cb1, int t0, int t1, float *y, float *acc, int tid) {
    for (int p = 0; p < c->nparts; p++)
        if (c->dpart < 0 || c->dpart == p) down_part(c, p, cb0, cb1, t0, t1, y, acc, tid);
}

static void down_item(void *ctx, int64_t item, int tid) {
    fctx *c = ctx;
    const int grp = (int)(item / c->ntc), tc = (int)(item % c->ntc);
    const int cb0 = grp * c->cw_dn, cb1 = cb0 + c->cw_dn < c->UH ? cb0 + c->cw_dn : c->UH;
    const int t0 = tc * TC, t1 = t0 + TC < c->T ? t0 + TC : c->T;
    float *y = ktki_pool_thread_scratch(c->pool, tid);
    down_run(c, cb0, cb1, t0, t1, y, y + (int64_t)RT * (cb1 - cb0) * 16, tid);
}

/* Decode path, down: column blocks [u0, u1) of H (a guided chunk), all T <= TC tokens. */
static void down_decode(void *ctx, int64_t u0, int64_t u1, int tid) {
    fctx *c = ctx;
    float *y = ktki_pool_thread_scratch(c->pool, tid), *acc = y + (int64_t)RT * c->cw_dn * 16;
    down_run(c, (int)u0, (int)u1, 0, c->T, y, acc, tid);
}

/* KTINJECT_PIPE (read at each one-token decode forward; tests and A/B measurements): 0 runs the two-phase path,
 * anything else (or unset) the pipeline where it applies (PIPE_DEFAULT). */
#ifndef PIPE_DEFAULT
#define PIPE_DEFAULT 1
#endif
static int pipe_enabled(void) {
    const char *v = getenv("KTINJECT_PIPE");
    if (v && (v[0] == '0' || v[0] == '1') && v[1] == 0) return v[0] == '1';
    return PIPE_DEFAULT;
}

/* KTINJECT_INT4_PATH, KTINJECT_FP8_PATH (read at each int4 / fp8 forward; for tests and crossover measurements):
 * auto (default), direct or dequant forces the int4 / fp8 kernels' path (KTK_INT4_PATH_*, KTK_FP8_PATH_*: the same
 * values); -1 for anything else. */
static int path_env(const char *name) {
    const char *v = getenv(name);
    if (!v || !*v || !strcmp(v, "auto")) return KTK_INT4_PATH_AUTO;
    if (!strcmp(v, "direct")) return KTK_INT4_PATH_DIRECT;
    if (!strcmp(v, "dequant")) return KTK_INT4_PATH_DEQUANT;
    return -1;
}

/* KTINJECT_DEFER_PHASES (read and checked at each split forward, used on the decode pipeline; A/B measurements): how
 * a split task's two parts run (pipeline.c says why each): one as one phase, cut (default) as one phase whose chunks
 * neither cross the parts' boundary nor are sized by the deferred part's units, two as a phase each; -1 for anything
 * else. cut is the default: in graph decode its immediate part was done earliest and its replays were the fastest
 * or level with two's (docs/performance.md has the figures). */
static int defer_phases_env(void) {
    const char *v = getenv("KTINJECT_DEFER_PHASES");
    if (!v || !*v || !strcmp(v, "cut")) return SPLIT_CUT;
    return !strcmp(v, "one") ? SPLIT_ONE : !strcmp(v, "two") ? SPLIT_TWO : -1;
}

/* KTINJECT_GEMV (read at each forward; tests and A/B measurements): 1 runs few-row forwards on the gemv decode
 * path wherever the kernels have gemv, 0 never; unset or anything else: the table's default (gemv_default). */
static int gemv_enabled(const ktk_kernels *k) {
    const char *v = getenv("KTINJECT_GEMV");
    if (v && (v[0] == '0' || v[0] == '1') && v[1] == 0) return v[0] == '1';
    return k->gemv_default;
}

/* The first step: fctx from the task, routing, the decode path's choice, block sizes and scratch. */
static int start(fctx *c, ktk_pool *pool, ktk_task *t) {
    const ktk_experts *ex = t->ex;
    const ktk_experts_config *cfg = &ex->cfg;
    const ktk_kernels *kern = ktki_dispatch_kernels();
    *c = (fctx){.t = t, .ex = ex, .pool = pool, .T = t->T, .k = t->k, .E = cfg->num_experts, .H = cfg->hidden,
                .I = cfg->intermediate, .quant = cfg->quant, .act = cfg->activation, .alpha = cfg->alpha,
                .limit = cfg->limit, .KpH = ex->Kp[KTK_MAT_GATE], .KpI = ex->Kp[KTK_MAT_DOWN],
                .UI = ex->Np[KTK_MAT_GATE] / 16, .UH = ex->Np[KTK_MAT_DOWN] / 16};
    const ktk_gemm_fn gemms[5] = {kern->gemm_bf16, kern->gemm_int8, kern->gemm_int4, kern->gemm_fp8,
                                  kern->gemm_mxfp4};
    const ktk_gemv_fn gemvs[5] = {kern->gemv_bf16, kern->gemv_int8, kern->gemv_int4, kern->gemv_fp8,
                                  kern->gemv_mxfp4};
    c->gemm = gemms[cfg->quant];
    c->a8 = cfg->quant == KTK_QUANT_INT8 || cfg->quant == KTK_QUANT_INT4;
    c->nt = ktki_pool_threads(pool);
    if (cfg->quant == KTK_QUANT_INT4 && (c->int4_path = path_env("KTINJECT_INT4_PATH")) < 0)
        return ktki_error(KTK_ERR_SHAPE, "KTINJECT_INT4_PATH=%.40s: expected auto, direct or dequant",
                          getenv("KTINJECT_INT4_PATH"));
    if ((cfg->quant == KTK_QUANT_FP8 || cfg->quant == KTK_QUANT_MXFP4) &&   /* mxfp4: fp8's path switch */
        (c->fp8_path = path_env("KTINJECT_FP8_PATH")) < 0)
        return ktki_error(KTK_ERR_SHAPE, "KTINJECT_FP8_PATH=%.40s: expected auto, direct or dequant",
                          getenv("KTINJECT_FP8_PATH"));
    c->nparts = t->slots == KTK_SLOTS_SPLIT ? 2 : 1;
    c->dpart = c->nparts == 2 ? 0 : -1;   /* off the pipeline a split task runs part 0's phases, then part 1's */
    if ((c->pipe_phases = c->nparts == 2 ? defer_phases_env() : SPLIT_ONE) < 0)
        return ktki_error(KTK_ERR_SHAPE, "KTINJECT_DEFER_PHASES=%.40s: expected one, cut or two",
                          getenv("KTINJECT_DEFER_PHASES"));
    const size_t n = (size_t)c->T * c->k, E = (size_t)c->E * c->nparts;   /* routing keys (slot_key) */
    const size_t T1 = (size_t)c->T + 1;
    uint8_t *rs = ktki_pool_scratch(pool, KTKI_SCR_ROUTE, 4 * a64(E * 4 + 4) + 3 * a64(n * 4) + a64(T1 * 4));
    if (!rs) return ktki_error(KTK_ERR_NOMEM, "forward: out of memory (routing tables)");
    c->start = (int32_t *)rs;
    c->act_e = (int32_t *)(rs + a64(E * 4 + 4));
    c->off = (int32_t *)(rs + 2 * a64(E * 4 + 4));
    c->tok = (int32_t *)(rs + 3 * a64(E * 4 + 4));
    c->wt = (float *)(rs + 3 * a64(E * 4 + 4) + a64(n * 4));
    c->tg = (int32_t *)(rs + 3 * a64(E * 4 + 4) + 2 * a64(n * 4));
    c->trow = (int32_t *)(rs + 4 * a64(E * 4 + 4) + 2 * a64(n * 4));
    c->toff = (int32_t *)(rs + 4 * a64(E * 4 + 4) + 3 * a64(n * 4));
    c->tile_rows = ktki_gather_tile_rows(kern, cfg->quant);
    int rc = ktki_route(c);
    if (rc != KTK_OK) return rc;
    atomic_fetch_add_explicit(&t->slots_run, (uint64_t)c->R, memory_order_relaxed);   /* read after the run */
    if (c->nparts == 2)
        atomic_fetch_add_explicit(&t->slots_rest, (uint64_t)(c->R - c->off[c->pa[1]]), memory_order_relaxed);
    if (c->maxrows <= DECODE_ROWS && c->T <= TC && gemv_enabled(kern) && c->int4_path != KTK_INT4_PATH_DEQUANT &&
        c->fp8_path != KTK_FP8_PATH_DEQUANT)
        c->gemv = gemvs[cfg->quant];
    c->pipe = c->gemv && c->R > 0 && pipe_enabled();
    /* Items of the gather (tokens) and of h's quantization (rows): a few rows each where a forward has few, so that
     * a batch's decode step spreads them over the threads (GATHER_ROWS an item left a batch's rows to two threads
     * while the others idled); one item (inline, no hand-off) for one token. */
    const int few = c->R < GATHER_ROWS * 2 * c->nt;
    c->gtok = few ? 1 : (GATHER_ROWS + c->k - 1) / c->k;
    c->hq_rows = c->R <= 2 * HQ_ROWS_FEW ? 2 * HQ_ROWS_FEW : few ? HQ_ROWS_FEW : GATHER_ROWS;
    ktki_profile_decode(pool, c->A, c->T);   /* counted where profiling and T is a decode step's */
    if (!plan(c))
        return ktki_error(KTK_ERR_NOMEM, "forward: out of memory (scratch for %d rows, H=%d, I=%d)", c->R, c->H,
                          c->I);
    return KTK_OK;
}

/* A phase of n items claimed one at a time, and one of n items claimed as ranges in guided chunks of [minc, maxc]. */
static int items(ktki_phase *ph, fctx *c, ktki_item_fn item, int64_t n) {
    *ph = (ktki_phase){item, NULL, c, n, 1, 0, 1};
    return KTKI_PHASE;
}

static int guided(ktki_phase *ph, fctx *c, ktki_range_fn range, int64_t n, int maxc, int minc) {
    *ph = (ktki_phase){NULL, range, c, n, maxc, 1, minc};
    return KTKI_PHASE;
}

/* The decode path's down phase claims at least this many column blocks a chunk (the A/B switch KTINJECT_DOWN_MINC
 * is retired: ktinject/envs.py, RETIRED). A chunk starts a stream per expert (its blocks are contiguous in each
 * expert's down matrix), and guided chunks of one block leave the down phase reading slower than gate/up; but
 * fewer, larger chunks leave a longer tail. Larger minimum chunks were faster on one host and slower on another
 * (and in bench serve there), so 1 (guided down to one block) stays the default (docs/performance.md). */
#define DOWN_MINC 1

/* Phases in order: gather, gate/up, (int8 / int4) h quantized, down; those of the decode path in guided chunks. A
 * forward with no row (all its experts GPU-resident or skipped) writes its zeros on this thread: as a phase of
 * column blocks it spent far longer in claims than the writes take, the threads barely busy. */
static int down_phase(ktki_phase *ph, fctx *c) {
    if (c->gemv) return guided(ph, c, down_decode, c->UH, c->cw_dn, DOWN_MINC);
    return items(ph, c, down_item, (int64_t)c->ntc * ((c->UH + c->cw_dn - 1) / c->cw_dn));
}

int ktki_forward_step(ktk_pool *pool, ktk_task *t, int first, ktki_phase *ph) {
    fctx *c = ktki_pool_scratch(pool, KTKI_SCR_JOB, sizeof *c);   /* the same buffer at every step (grow-only) */
    if (!c) return ktki_error(KTK_ERR_NOMEM, "forward: out of memory");
    if (first) {
        int rc = start(c, pool, t);
        if (rc != KTK_OK) return rc;
    }
    for (;;) {
        switch (c->step++) {
        case 0:
            if (c->R > 0) return items(ph, c, ktki_gather_item, (c->T + c->gtok - 1) / c->gtok);
            break;
        case 1:
            if (c->pipe) {   /* every part's units, or (a split task in two phases) part 0's */
                const int64_t n = c->pipe_phases == SPLIT_TWO ? ktki_pipeline_part_units(c, 0) : ktki_pipeline_units(c);
                c->base = 0;
                if (n <= 0) break;
                guided(ph, c, ktki_pipeline_range, n, c->cw_gu, 1);
                if (c->pipe_phases == SPLIT_CUT) ph->cut = ktki_pipeline_part_units(c, 0);
                return KTKI_PHASE;
            }
            if (c->R == 0) break;
            if (c->gemv) {   /* every expert's units, or the part's */
                int a0, a1;
                part_span(c, &a0, &a1);
                c->base = (int64_t)a0 * c->UI;
                return guided(ph, c, gate_up_decode, (int64_t)(a1 - a0) * c->UI, c->cw_gu, 1);
            }
            c->base = c->dpart == 1 ? c->gu_part1 : 0;
            return items(ph, c, gate_up_item, (c->dpart == 0 ? c->gu_part1 : c->ngu) - c->base);
        case 2:
            if (c->pipe) {   /* h quantized, down and out written inside the pipeline's phase; part 1's phase */
                const int64_t n = c->pipe_phases == SPLIT_TWO ? ktki_pipeline_part_units(c, 1) : 0;
                c->base = ktki_pipeline_part_units(c, 0);
                if (n > 0) return guided(ph, c, ktki_pipeline_range, n, c->cw_gu, 1);
                break;
            }
            if (c->R > 0 && c->a8) {   /* every row, or the part's */
                int a0, a1;
                part_span(c, &a0, &a1);
                c->hq_r0 = c->off[a0];
                c->hq_r1 = c->off[a1];
                return items(ph, c, ktki_gather_quantize_h_item, (c->hq_r1 - c->hq_r0 + c->hq_rows - 1) / c->hq_rows);
            }
            break;
        case 3:
            if (c->R == 0) {   /* every slot skipped (GPU-resident, deferred to the other part): zeros, here */
                for (int p = 0; p < c->nparts; p++) ktki_forward_zero_out(c, p);
                break;
            }
            if (c->pipe) break;
            return down_phase(ph, c);
        case 4:   /* a split task off the pipeline: part 0 done, its done word; then part 1's gate/up, h and down */
            if (c->pipe || c->R == 0 || c->dpart != 0) break;
            ktki_task_raise_top(t);
            c->dpart = 1;
            c->step = 1;
            break;
        default:
            return KTK_OK;
        }
    }
}

int ktki_forward(ktk_pool *pool, ktk_experts *ex, int T, int k, const void *hidden, int hidden_dtype,
                 const int64_t *ids, const void *weights, int weights_dtype, const uint8_t *skip, void *out,
                 int out_dtype) {
    ktk_task t; /* on the stack: the pool's last touch is the IDLE store, then wait returns */
    ktki_task_init(&t, pool);
    int rc = ktki_task_bind(&t, ktki_forward_step, ex, T, k, hidden, hidden_dtype, ids, weights, weights_dtype,
                            skip, out, out_dtype);
    if (rc != KTK_OK) return rc;
    if (ktki_job_run_inline(pool, &t)) {
        if (t.result != KTK_OK) ktki_error_set_msg(t.result, t.msg);
        return t.result;
    }
    rc = ktki_task_submit(&t);
    return rc == KTK_OK ? ktki_task_wait(&t) : rc;
}
