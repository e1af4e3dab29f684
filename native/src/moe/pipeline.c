/* The decode pipeline: a decode forward's gate/up, h's quantization and down as one phase (forward.c runs it where
 * the gemv decode path applies and KTINJECT_PIPE is not 0).
 *
 * Why: a one-token forward reads every active expert's weights once in a short time, and as two phases (gate/up of every
 * expert, h quantized, then down of every column block) it paid each phase's tail, the serial step and the down
 * phase's ramp; a batch's decode step pays the same per layer. Here one phase holds both: units [0, A * UI) are
 * gate/up (expert a, block b) as in the two-phase path, then [A * UI, + groups * UHc) down (the experts of
 * group eg, at most PIPE_DN_EXPERTS, sizes balanced; column group g of PIPE_DN_BLOCKS blocks of H), claimed in that
 * order in guided chunks, so a down unit of the first experts overlaps the gate/up tail of the last. The thread
 * that ends an expert's last gate/up unit quantizes its h rows and marks them ready; a down unit waits for its
 * experts' marks (every gate/up unit is claimed before any down unit, and a chunk runs its units in order, so the
 * wait is for units running threads hold: no deadlock)
 * and writes each row's output for its columns into yd; the thread that ends a column group's last expert group
 * sums it per token, the token's rows in ascending order (= experts in ascending order, as down_run sums), acc = 0;
 * acc += w * (y + bias): the same bits as the two-phase path (tested). The same kernel calls as that path: one-row
 * experts' down matrices as one gemv (one expert a unit measured slower: a core needs many weight streams to read
 * fast), an expert with several rows as one gemm over them.
 * A split task (ktk_task_split: expert deferral, one job a layer) has two parts, the immediate slots' experts then
 * the deferred ones', each with its units in the order above, part 0's before part 1's: the thread that sums
 * part 0's last column group raises the task's done_top, and the threads go straight on to part 1's units (no
 * second job: no second routing, gather, phase start or tail). But in one phase the guided chunks near part 0's
 * end are sized by what is left of both parts (several down units a chunk where a plain forward's last are one), so part
 * 0's tail, which the GPU waits for, is long. KTINJECT_DEFER_PHASES (forward.c): cut keeps one phase but no chunk
 * crosses the boundary and part 0's are sized by its own units left (ktki_phase.cut); two runs each part as a phase
 * of its own: none of part 1's units then reads memory beside part 0's tail, at the price of part 1's ramp after
 * the done word. cut is the default: in graph decode its done word came earliest of the three (bench decode
 * --defer-layouts times them; docs/performance.md has the figures).
 * Legend: A active experts, R rows, T tokens, UI / UH 16-wide blocks of I / H, UHc groups of PIPE_DN_BLOCKS blocks.
 */
#include <sched.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "forward.h"

/* Expert groups of part p's down units: at most PIPE_DN_EXPERTS experts each */
static int part_groups(const fctx *c, int p) {
    return (c->pa[p + 1] - c->pa[p] + PIPE_DN_EXPERTS - 1) / PIPE_DN_EXPERTS;
}

/* Expert group eg of part p: its first active expert *a0 and count *n. Sizes differ by one at most (5 experts: 3 +
 * 2, not 4 + 1): a unit of one expert reads one weight stream, which a core reads slowly. A split task's layers
 * took a little less so; one group for all of a part's experts was slower (docs/performance.md). */
static void part_group(const fctx *c, int p, int eg, int *a0, int *n) {
    const int pa0 = c->pa[p], N = c->pa[p + 1] - pa0, G = part_groups(c, p);
    const int base = N / G, extra = N % G;   /* sizes base + 1 (the first extra groups) and base */
    *a0 = pa0 + eg * base + (eg < extra ? eg : extra);
    *n = base + (eg < extra);
}

/* Units of part p: its gate/up units, then its down units */
int64_t ktki_pipeline_part_units(const fctx *c, int p) {
    return (int64_t)(c->pa[p + 1] - c->pa[p]) * c->UI + (int64_t)part_groups(c, p) * c->UHc;
}

int ktki_pipeline_plan(fctx *c) {
    c->UHc = (c->UH + PIPE_DN_BLOCKS - 1) / PIPE_DN_BLOCKS;
    const size_t ca = a64((size_t)c->A * 4), cg = a64((size_t)c->UHc * c->nparts * 4);
    char *b = ktki_pool_scratch(c->pool, KTKI_SCR_PIPE, 2 * ca + cg + (size_t)c->R * c->UH * 16 * sizeof(float));
    if (!b) return 0;
    c->gu_left = (_Atomic int32_t *)b;
    c->h_ready = (_Atomic int32_t *)(b + ca);
    c->dn_left = (_Atomic int32_t *)(b + 2 * ca);
    c->yd = (float *)(b + 2 * ca + cg);
    for (int a = 0; a < c->A; a++) {   /* relaxed: the phase's publication releases them */
        atomic_store_explicit(&c->gu_left[a], c->UI, memory_order_relaxed);
        atomic_store_explicit(&c->h_ready[a], 0, memory_order_relaxed);
    }
    for (int p = 0; p < c->nparts; p++)
        for (int g = 0; g < c->UHc; g++)
            atomic_store_explicit(&c->dn_left[p * c->UHc + g], part_groups(c, p), memory_order_relaxed);
    atomic_store_explicit(&c->top_left, c->UHc, memory_order_relaxed);
    if (c->nparts == 2) {   /* a part with no row has no unit: its zeros here (the immediate part's done at once) */
        if (c->pa[1] == 0) {
            ktki_forward_zero_out(c, 0);
            ktki_task_raise_top(c->t);
        }
        if (c->pa[1] == c->A) ktki_forward_zero_out(c, 1);
    }
    return 1;
}

int64_t ktki_pipeline_units(const fctx *c) {
    int64_t n = 0;
    for (int p = 0; p < c->nparts; p++) n += ktki_pipeline_part_units(c, p);
    return n;
}

/* The active expert of row r: the a with off[a] <= r < off[a + 1]. */
static int row_expert(const fctx *c, int r) {
    int lo = 0, hi = c->A - 1;
    while (lo < hi) {
        const int mid = (lo + hi + 1) / 2;
        if (c->off[mid] <= r) lo = mid;
        else hi = mid - 1;
    }
    return lo;
}

/* Column group g of every token: its rows' outputs (of part p) summed in ascending row order, then the part's out. */
static void combine(const fctx *c, int p, int g) {
    const int j0 = g * PIPE_DN_BLOCKS * 16, j1 = (g + 1) * PIPE_DN_BLOCKS * 16 < c->H ? (g + 1) * PIPE_DN_BLOCKS * 16
                                                                                   : c->H;
    const int r0 = c->off[c->pa[p]], r1 = c->off[c->pa[p + 1]];
    float acc[PIPE_DN_BLOCKS * 16];
    for (int t = 0; t < c->T; t++) {
        memset(acc, 0, sizeof acc);
        for (int i = c->toff[t]; i < c->toff[t + 1]; i++) {   /* trow: ascending rows, so ascending experts */
            const int r = c->trow[i];
            if (r < r0 || r >= r1) continue;
            const float *bd = c->ex->bias_off[KTK_MAT_DOWN] < 0 ? NULL
                              : ktki_experts_bias(c->ex, c->act_e[row_expert(c, r)], KTK_MAT_DOWN);
            ktki_forward_accumulate(c, c->yd + (int64_t)r * c->UH * 16 + j0, j1 - j0, j1 - j0, bd ? bd + j0 : NULL, r,
                                r + 1, t, acc);
        }
        ktki_forward_write_out(c, p, t, j0, j1 - j0, acc);
    }
}

/* Spins, yielding the core every PIPE_YIELD_NS (as the pool's hot idle threads do): the unit's holder may have lost
 * its core, and a thread waiting here must not keep it from getting one back. */
#define PIPE_YIELD_NS 15000
static void wait_h(const fctx *c, int a) {
    int64_t yield_at = 0;
    for (unsigned i = 1; !atomic_load_explicit(&c->h_ready[a], memory_order_acquire); i++) {
        ktki_cpu_relax();
        if (i % 16) continue;
        const int64_t t = ktki_event_now_ns();
        if (!yield_at) yield_at = t + PIPE_YIELD_NS;
        else if (t >= yield_at) {
            sched_yield();
            yield_at = ktki_event_now_ns() + PIPE_YIELD_NS;
        }
    }
}

/* Down of experts [a0, a0 + n), blocks [cb0, cb1) of H -> their rows of yd. ys: the thread's scratch (a gemm's
 * rows x blocks). */
static void down_group(const fctx *c, int a0, int n, int cb0, int cb1, float *ys, int tid) {
    const int bw = (cb1 - cb0) * 16;
    ktk_mat d[PIPE_DN_EXPERTS];
    ktk_act h[PIPE_DN_EXPERTS];
    const ktk_mat *dp[PIPE_DN_EXPERTS];
    const ktk_act *hp[PIPE_DN_EXPERTS];
    float *y[PIPE_DN_EXPERTS];
    int m = 0;   /* one-row experts, as one gemv */
    for (int a = a0; a < a0 + n; a++) {
        wait_h(c, a);
        const int r0 = c->off[a], rows = c->off[a + 1] - r0;
        const ktk_mat w = ktki_experts_mat(c->ex, c->act_e[a], KTK_MAT_DOWN);
        float *yr = c->yd + (int64_t)r0 * c->UH * 16 + (int64_t)cb0 * 16;
        if (rows == 1) {
            d[m] = w;
            h[m] = ktki_gather_rows(c, 1, a, r0, r0 + 1, tid);
            dp[m] = &d[m], hp[m] = &h[m], y[m++] = yr;
            continue;
        }
        const ktk_act x = ktki_gather_rows(c, 1, a, r0, r0 + rows, tid);
        c->gemm(&w, cb0, cb1, &x, ys, bw);
        for (int r = 0; r < rows; r++)
            memcpy(yr + (int64_t)r * c->UH * 16, ys + (int64_t)r * bw, (size_t)bw * sizeof(float));
    }
    if (m) c->gemv(m, dp, cb0, cb1, hp, y);
}

/* Units [u0, u1) of part p (its gate/up units, then its down units). */
static void part_range(fctx *c, int p, int64_t u0, int64_t u1, int tid) {
    float *gs = ktki_pool_thread_scratch(c->pool, tid), *us = gs + (int64_t)DECODE_ROWS * c->cw_gu * 16;
    const int pa0 = c->pa[p], pa1 = c->pa[p + 1];
    const int64_t ngu = (int64_t)(pa1 - pa0) * c->UI;
    for (int64_t u = u0; u < u1 && u < ngu;) {   /* gate/up */
        const int a = pa0 + (int)(u / c->UI), cb0 = (int)(u % c->UI);
        const int cb1 = u1 - u < c->UI - cb0 ? cb0 + (int)(u1 - u) : c->UI;
        ktki_forward_gate_up(c, a, c->off[a], c->off[a + 1], cb0, cb1, gs, us, tid);
        if (atomic_fetch_sub_explicit(&c->gu_left[a], cb1 - cb0, memory_order_acq_rel) == cb1 - cb0) {
            if (c->a8) ktki_gather_quantize_h_rows(c, c->off[a], c->off[a + 1]);
            atomic_store_explicit(&c->h_ready[a], 1, memory_order_release);
        }
        u += cb1 - cb0;
    }
    _Atomic int32_t *left = c->dn_left + (int64_t)p * c->UHc;
    for (int64_t u = u0 > ngu ? u0 : ngu; u < u1;) {   /* down */
        const int eg = (int)((u - ngu) / c->UHc), g0 = (int)((u - ngu) % c->UHc);
        const int g1 = u1 - u < c->UHc - g0 ? g0 + (int)(u1 - u) : c->UHc;
        const int cb0 = g0 * PIPE_DN_BLOCKS, cb1 = g1 * PIPE_DN_BLOCKS < c->UH ? g1 * PIPE_DN_BLOCKS : c->UH;
        int a0, n;
        part_group(c, p, eg, &a0, &n);
        down_group(c, a0, n, cb0, cb1, gs, tid);
        for (int g = g0; g < g1; g++) {
            if (atomic_fetch_sub_explicit(&left[g], 1, memory_order_acq_rel) != 1) continue;
            combine(c, p, g);
            /* a split task's immediate part complete: its done word now, before the deferred part's units */
            if (c->nparts == 2 && p == 0 && atomic_fetch_sub_explicit(&c->top_left, 1, memory_order_acq_rel) == 1)
                ktki_task_raise_top(c->t);
        }
        u += g1 - g0;
    }
}

/* A guided chunk [u0, u1) of the open phase, units [base + u0, base + u1): part 0's units, then part 1's
 * (a split task). */
void ktki_pipeline_range(void *ctx, int64_t u0, int64_t u1, int tid) {
    fctx *c = ctx;
    int64_t base = 0;
    u0 += c->base;
    u1 += c->base;
#if defined(KTK_TEST_BUILD) && defined(KTK_CHECK_CUT)   /* the pool stress test: a chunk of a cut phase never
                                                          * crosses the parts' boundary */
    const int64_t cut = ktki_pipeline_part_units(c, 0);
    if (c->nparts == 2 && c->pipe_phases == SPLIT_CUT && u0 < cut && u1 > cut) {
        fprintf(stderr, "pipe: chunk [%lld, %lld) crosses the cut at %lld\n", (long long)u0, (long long)u1,
                (long long)cut);
        abort();
    }
#endif
    for (int p = 0; p < c->nparts && u0 < u1; p++) {
        const int64_t end = base + ktki_pipeline_part_units(c, p);
        if (u0 < end) {
            const int64_t v1 = u1 < end ? u1 : end;
            part_range(c, p, u0 - base, v1 - base, tid);
            u0 = v1;
        }
        base = end;
    }
}
