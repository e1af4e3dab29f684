/* Tasks: one forward's arguments at a fixed address; submit/wait, the void(*)(void*) forms, watching and (expert
 * deferral) which slots of each token a task computes.
 *
 * A run (begin, steps, end: on whichever pool threads) ends with the task's state stored IDLE (its last touch of the
 * task) and the pool's done event signalled, so a waiter may free the task as soon as it sees IDLE. Errors: `result`
 * is the latest run's code; `sticky` keeps the first error that nobody could return at once (a failed
 * ktk_submit_fn, a failed run seen by ktk_wait_fn, a failed watched run) until ktk_wait or ktk_task_unwatch
 * returns it.
 */
#define _GNU_SOURCE
#include <stdio.h>
#include <string.h>

#include "pool.h"

void ktki_task_init(ktk_task *t, ktk_pool *pool) {
    memset(t, 0, sizeof *t);
    t->pool = pool;
    atomic_store(&t->state, KTKI_TASK_IDLE);
}

static int busy(const ktk_task *t) { return atomic_load(&t->state) != KTKI_TASK_IDLE; }

static void keep_sticky(ktk_task *t, int code, const char *msg) {
    if (code == KTK_OK || t->sticky != KTK_OK) return;
    t->sticky = code;
    snprintf(t->sticky_msg, sizeof t->sticky_msg, "%s", msg);
}

int ktki_task_bind(ktk_task *t, ktki_step_fn step, ktk_experts *ex, int T, int k, const void *hidden,
                   int hidden_dtype, const int64_t *ids, const void *weights, int weights_dtype, const uint8_t *skip,
                   void *out, int out_dtype) {
    if (busy(t)) return ktki_error(KTK_ERR_STATE, "ktk_task_bind: task is queued or running (ktk_wait first)");
    if (t->watched) return ktki_error(KTK_ERR_STATE, "ktk_task_bind: task is watched (ktk_task_unwatch first)");
    t->step = step;
    t->ex = ex;
    t->T = T;
    t->k = k;
    t->hidden = hidden;
    t->hidden_dtype = hidden_dtype;
    t->ids = ids;
    t->weights = weights;
    t->weights_dtype = weights_dtype;
    t->skip = skip;
    t->out = out;
    t->out_dtype = out_dtype;
    t->slots = KTK_SLOTS_ALL;   /* a new binding runs every slot until ktk_task_select says otherwise */
    t->slots_d = 0;
    t->slots_share = 0;
    t->out2 = NULL;
    t->done_top = NULL;
    t->bound = 1;
    return KTK_OK;
}

/* The checks both selections share: a bound task the pool does not hold, a known part (ALL only where allowed). */
static int select_check(const ktk_task *t, const char *fn, int slots, int all_ok) {
    if (busy(t)) return ktki_error(KTK_ERR_STATE, "%s: task is queued or running (ktk_wait first)", fn);
    if (t->watched) return ktki_error(KTK_ERR_STATE, "%s: task is watched (ktk_task_unwatch first)", fn);
    if (!t->bound) return ktki_error(KTK_ERR_STATE, "%s: task has no bound forward (bind first)", fn);
    if ((slots != KTK_SLOTS_ALL || !all_ok) && slots != KTK_SLOTS_TOP && slots != KTK_SLOTS_REST)
        return ktki_error(KTK_ERR_SHAPE, "%s: slots = %d (expected %sKTK_SLOTS_TOP %d or KTK_SLOTS_REST %d)", fn,
                          slots, all_ok ? "KTK_SLOTS_ALL 0, " : "", KTK_SLOTS_TOP, KTK_SLOTS_REST);
    return KTK_OK;
}

int ktki_task_select(ktk_task *t, int slots, int d) {
    int rc = select_check(t, "ktk_task_select", slots, 1);
    if (rc != KTK_OK) return rc;
    if (slots != KTK_SLOTS_ALL && (d < 1 || d >= t->k))
        return ktki_error(KTK_ERR_SHAPE, "ktk_task_select: d = %d deferred slots of k = %d (expected 1 <= d < k)", d,
                          t->k);
    t->slots = slots;
    t->slots_d = slots == KTK_SLOTS_ALL ? 0 : d;
    t->slots_share = 0;
    return KTK_OK;
}

int ktki_task_select_share(ktk_task *t, int slots, float share) {
    int rc = select_check(t, "ktk_task_select_share", slots, 0);
    if (rc != KTK_OK) return rc;
    if (!(share > 0 && share < 1))   /* NaN fails too */
        return ktki_error(KTK_ERR_SHAPE, "ktk_task_select_share: share = %g of the routing weight (expected a "
                          "finite 0 < share < 1)", (double)share);
    t->slots = slots;
    t->slots_d = 0;
    t->slots_share = share;
    return KTK_OK;
}

int ktki_task_split(ktk_task *t, int d, float share, void *out2, volatile uint32_t *done_top) {
    const int by_share = d == 0;
    if (!by_share && share != 0)   /* (before anything changes: a rejected call keeps the selection it had) */
        return ktki_error(KTK_ERR_SHAPE, "ktk_task_split: d = %d and share = %g: give one of them (the other 0)", d,
                          (double)share);
    if (t->bound && (out2 == t->out || out2 == t->hidden))
        return ktki_error(KTK_ERR_SHAPE, "ktk_task_split: out2 is the bound %s (expected a buffer of its own)",
                          out2 == t->out ? "out" : "hidden");
    int rc = by_share ? ktki_task_select_share(t, KTK_SLOTS_TOP, share) : ktki_task_select(t, KTK_SLOTS_TOP, d);
    if (rc != KTK_OK) return rc;
    t->slots = KTK_SLOTS_SPLIT;
    t->out2 = out2;
    t->done_top = done_top;
    return KTK_OK;
}

/* profiled: raised inside the job (moe/forward.c, moe/pipeline.c: its pool is still running it), timed in the pool's profile */
static void raise_top(ktk_task *t, int profiled) {
    if (t->done_top && !atomic_exchange_explicit(&t->top_raised, 1, memory_order_acq_rel)) {
        __atomic_store_n(t->done_top, 1u, __ATOMIC_RELEASE);
        if (profiled) ktki_profile_top(t->pool);
    }
}

void ktki_task_raise_top(ktk_task *t) { raise_top(t, 1); }

int ktki_task_signal(ktk_task *t, volatile uint32_t *done) {
    if (busy(t)) return ktki_error(KTK_ERR_STATE, "ktk_task_signal: task is queued or running (ktk_wait first)");
    if (t->watched) return ktki_error(KTK_ERR_STATE, "ktk_task_signal: task is watched (its done word is the watch's)");
    t->signal = done;
    return KTK_OK;
}

int ktki_task_submit(ktk_task *t) {
    if (!t->bound) return ktki_error(KTK_ERR_STATE, "ktk_submit: task has no bound forward (ktk_task_bind first)");
    if (t->watched) return ktki_error(KTK_ERR_STATE, "ktk_submit: task is watched; it runs when *go is raised");
    if (ktki_pool_stopped(t->pool)) return ktki_error(KTK_ERR_STATE, "ktk_submit: the task's pool is destroyed");
    int expected = KTKI_TASK_IDLE;
    if (!atomic_compare_exchange_strong(&t->state, &expected, KTKI_TASK_QUEUED))
        return ktki_error(KTK_ERR_STATE, "ktk_submit: task is already queued or running (ktk_wait first)");
    if (!ktki_job_enqueue(t->pool, t)) {   /* the pool's destroy began after the check above */
        atomic_store(&t->state, KTKI_TASK_IDLE);
        return ktki_error(KTK_ERR_STATE, "ktk_submit: the task's pool is destroyed");
    }
    return KTK_OK;
}

static void wait_idle(ktk_task *t) {
    ktki_event *ev = ktki_pool_done_event(t->pool);
    int64_t spin = ktki_pool_spin_ns(t->pool);
    for (;;) {
        uint32_t seen = atomic_load(&ev->seq);
        if (atomic_load_explicit(&t->state, memory_order_acquire) == KTKI_TASK_IDLE) return;
        ktki_event_wait(ev, seen, spin);
    }
}

int ktki_task_wait(ktk_task *t) {
    wait_idle(t);
    if (t->sticky != KTK_OK) {
        int code = t->sticky;
        t->sticky = KTK_OK;
        ktki_error_set_msg(code, t->sticky_msg);
        return code;
    }
    if (t->result != KTK_OK) ktki_error_set_msg(t->result, t->msg);
    return t->result;
}

void ktki_task_submit_fn(ktk_task *t) {
    int rc = ktki_task_submit(t);
    keep_sticky(t, rc, ktki_error_msg());
}

void ktki_task_wait_fn(ktk_task *t) {
    wait_idle(t);
    keep_sticky(t, t->result, t->msg);
}

void ktki_task_begin(ktk_task *t) {
    t->begin_ns = ktki_event_now_ns();
    atomic_store(&t->state, KTKI_TASK_RUNNING);
    atomic_store_explicit(&t->top_raised, 0, memory_order_relaxed);
    t->steps = 0;
}

int ktki_task_step(ktk_task *t, ktki_phase *ph) {
    ktki_error_clear();
    int rc = t->step(t->pool, t, t->steps++ == 0, ph);
    if (rc == KTKI_PHASE) return 1;
    t->result = rc;
    if (rc != KTK_OK) snprintf(t->msg, sizeof t->msg, "%s", ktki_error_msg());
    else t->msg[0] = 0;
    return 0;
}

void ktki_task_end(ktk_task *t, int watched) {
    /* a run that failed, or had no row to compute (R == 0: its zeros written in a serial step), raises it here;
     * not profiled: the pool may already be running another job (job.c releases it first for a submitted task) */
    if (t->slots == KTK_SLOTS_SPLIT) raise_top(t, 0);
    t->end_ns = ktki_event_now_ns();
    if (watched) {
        keep_sticky(t, t->result, t->msg);
        __atomic_store_n(t->done, 1u, __ATOMIC_RELEASE);
    } else if (t->signal) {
        __atomic_store_n(t->signal, 1u, __ATOMIC_RELEASE);   /* out complete (or the run failed): see ktk_task_signal */
    }
    atomic_store_explicit(&t->state, KTKI_TASK_IDLE, memory_order_release);
}

int ktki_task_watch(ktk_task *t, volatile uint32_t *go, volatile uint32_t *done, volatile uint32_t *then) {
    if (!t->bound) return ktki_error(KTK_ERR_STATE, "ktk_task_watch: task has no bound forward (bind first)");
    if (t->watched) return ktki_error(KTK_ERR_STATE, "ktk_task_watch: task is already watched");
    wait_idle(t);   /* a submitted run finishes first */
    t->go = go;
    t->done = done;
    t->then = then;
    t->watched = 1;
    int rc = ktki_watch_add(t->pool, t);
    if (rc != KTK_OK) t->watched = 0;
    return rc;
}

int ktki_task_unwatch(ktk_task *t) {
    if (!t->watched) return ktki_error(KTK_ERR_STATE, "ktk_task_unwatch: task is not watched");
    ktki_watch_remove(t->pool, t);
    t->watched = 0;
    t->go = t->done = t->then = NULL;
    if (t->sticky != KTK_OK) {
        int code = t->sticky;
        t->sticky = KTK_OK;
        ktki_error_set_msg(code, t->sticky_msg);
        return code;
    }
    return KTK_OK;
}

void ktki_task_finish(ktk_task *t) {
    if (t->watched) ktki_watch_remove(t->pool, t);
    t->watched = 0;
    wait_idle(t);
}
