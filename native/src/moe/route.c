/* The route step of a forward (forward.c runs it first, on one thread): which (token, slot) pairs the task computes
 * (every slot; expert deferral's immediate or deferred ones; a split task's both, keyed apart) and the rows they
 * become, sorted by (expert, token), with each token's rows for the gather and the combine.
 * Legend: T tokens, k slots per token, E experts, A active experts, R rows.
 */
#include <math.h>
#include <string.h>

#include "forward.h"

static float routing_weight(const ktk_task *t, int64_t i) {
    if (t->weights_dtype == KTK_DTYPE_F32) return ((const float *)t->weights)[i];
    return ktk_bf16_to_f32(((const uint16_t *)t->weights)[i]);
}

/* Whether the task computes slot i (= token * k + j) of its ids: every slot, or for expert deferral the token's
 * immediate slots ("top") or its deferred ones ("rest"). A slot's rank is the number of the token's slots with a
 * larger weight, or an equal weight and a lower slot: the two parts split each token's k slots exactly, whatever the
 * weights. Deferred: by count (ktk_task_select) the d lowest-ranked; by share (ktk_task_select_share) a slot of rank
 * r > 0 whose cum(r) = (weights of the slots of rank >= r) / (all k weights) <= share, both summed in double in
 * slot order, and none where the total is not a finite positive number. One pass over the token's k weights. */
static int slot_deferred(const ktk_task *t, int k, int64_t i) {
    const int64_t row = i - i % k;
    const int j = (int)(i - row);
    const float w = routing_weight(t, i);
    const int mass = t->slots_share > 0;
    int rank = 0;
    double total = 0, below = 0;   /* mass: all k weights, and those of slot j and the slots ranked below it */
    for (int m = 0; m < k; m++) {
        const float v = routing_weight(t, row + m);
        const int above = v > w || (v == w && m < j);
        rank += above;
        if (mass) {
            total += v;
            if (!above) below += v;
        }
    }
    return mass ? rank > 0 && isfinite(total) && total > 0 && below / total <= t->slots_share
                : rank >= k - t->slots_d;
}

/* The routing key of slot i: its expert, or -1 where the task skips it; a split task (ktk_task_split) keys its
 * deferred slots E + expert, so that they come after every immediate one (part 1). */
static int64_t slot_key(const ktk_task *t, int k, int E, int64_t i) {
    const int64_t id = t->ids[i];
    if (t->skip && t->skip[id]) return -1;
    if (t->slots == KTK_SLOTS_ALL) return id;
    const int deferred = slot_deferred(t, k, i);
    if (t->slots == KTK_SLOTS_SPLIT) return deferred ? E + id : id;
    return deferred == (t->slots == KTK_SLOTS_REST) ? id : -1;
}

/* The route step (serial): validate ids, count rows per routing key, the active experts in key order (a split task:
 * part 0's, then part 1's, pa[]), rows sorted by (key, token), and the rows of each token (toff / trow). */
int ktki_route(fctx *c) {
    const ktk_task *t = c->t;
    const int64_t n = (int64_t)c->T * c->k;
    int32_t *cnt = c->start;
    const int keys = c->E * c->nparts;
    memset(cnt, 0, (size_t)keys * sizeof *cnt);
    for (int64_t i = 0; i < n; i++) {
        int64_t id = t->ids[i];
        if (id < 0 || id >= c->E)
            return ktki_error(KTK_ERR_RANGE, "expert id out of range: ids[%lld][%lld] (token %lld, slot %lld) = %lld, "
                              "expected 0 <= id < E = %d", (long long)(i / c->k), (long long)(i % c->k),
                              (long long)(i / c->k), (long long)(i % c->k), (long long)id, c->E);
        const int64_t key = slot_key(t, c->k, c->E, i);
        if (key >= 0) cnt[key]++;
    }
    c->A = c->R = c->maxrows = 0;
    for (int key = 0; key < keys; key++) {
        if (key == c->E) c->pa[1] = c->A;   /* split: part 1 (deferred) from here */
        if (cnt[key] == 0) continue;
        const int e = key % c->E;
        if (cnt[key] > c->maxrows) c->maxrows = cnt[key];
        for (int w = 0; w < 3; w++)
            if (!c->ex->ready[(int64_t)e * 3 + w])
                return ktki_error(KTK_ERR_STATE, "expert %d is routed to but its %s weights were never set "
                                  "(ktk_experts_set)", e, w == 0 ? "gate" : w == 1 ? "up" : "down");
        c->act_e[c->A] = e;
        c->off[c->A++] = c->R;
        int32_t rows = cnt[key];
        cnt[key] = c->R;   /* from here on: next free row of the key */
        c->R += rows;
    }
    c->off[c->A] = c->R;
    c->pa[0] = 0;
    c->pa[c->nparts] = c->A;   /* parts: active experts [pa[p], pa[p + 1]) */
    memset(c->toff, 0, (size_t)(c->T + 1) * sizeof *c->toff);
    for (int64_t i = 0; i < n; i++) {   /* token-major: rows of each expert come out sorted by token */
        const int64_t key = slot_key(t, c->k, c->E, i);
        if (key < 0) continue;
        int32_t r = c->start[key]++;
        c->tok[r] = (int32_t)(i / c->k);
        c->wt[r] = routing_weight(t, i);
        c->toff[c->tok[r] + 1]++;
    }
    /* rows by token (counting sort), for the gather: a token's hidden state is quantized once for all its rows */
    for (int tk = 0; tk < c->T; tk++) c->toff[tk + 1] += c->toff[tk];
    for (int r = 0; r < c->R; r++) c->trow[c->toff[c->tok[r]]++] = r;
    for (int tk = c->T; tk > 0; tk--) c->toff[tk] = c->toff[tk - 1];   /* the fill advanced each start to its end */
    c->toff[0] = 0;
    return KTK_OK;
}
