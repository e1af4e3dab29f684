/* Which job the pool runs next, and how a job ends: the queue, a thread taking a queued task or a raised go flag
 * (watch.c), inline runs on a caller's thread.
 *
 * A job is claimed by a CAS of `running` 0 -> 1 (ktki_job_claim): queued tasks first, then watched tasks whose go
 * flag is 1 (watch.c: round robin; go is reset to 0 once running is held); a synchronous ktk_forward on an idle pool
 * runs its first steps on its caller (ktki_job_run_inline), which then helps with the chunks of its phases.
 */
#define _GNU_SOURCE
#include <stdlib.h>

#include "pool.h"

int ktki_job_claim(ktk_pool *p) {
    int free_ = 0;
    return atomic_compare_exchange_strong(&p->running, &free_, 1);
}

/* The pool released (running 0) by a job's end or a failed take: where a task was queued meanwhile, the threads that
 * found the pool busy and went idle are woken to take it (the job may have ended on a caller's thread, which does
 * not take queued tasks). running is stored seq_cst and queued read after it; an enqueue increments queued before
 * its event: either this sees the task or the enqueuer's event comes after the pool is free. */
void ktki_job_release(ktk_pool *p) {
    atomic_store(&p->running, 0);
    if (atomic_load(&p->queued)) ktki_event_signal(&p->work);
}

/* A watched task's run ends (done flag, IDLE) before watch_running is cleared, which unwatch waits for; any other
 * releases the pool first, so that its caller, back from waiting, finds the pool free for its next forward. */
void ktki_job_end(ktk_pool *p) {
    ktk_task *t = p->job;
    ktki_profile_job_end(p);
    /* no thread sits out what comes next (a stale value kept one asleep through the next job's phases) */
    atomic_store_explicit(&p->sit_out, -1, memory_order_relaxed);
    if (p->job_watched) {
        volatile uint32_t *then = t->then;
        ktki_task_end(t, 1);
        if (then) __atomic_store_n(then, 1u, __ATOMIC_RELEASE);   /* after done: the GPU's wait is not delayed */
        ktki_watch_mark_hot(p);   /* ... idle threads stay awake for the next layer's go */
        atomic_store_explicit(&p->last_watched, ktki_event_now_ns(), memory_order_relaxed);
        atomic_store(&p->watch_running, NULL);
        ktki_job_release(p);
        if (then) ktki_event_signal(&p->work);   /* the chained task: this thread or any other takes it at once */
    } else {
        ktki_job_release(p);
        ktki_task_end(t, 0);   /* t may be gone from here on */
    }
    ktki_event_signal(&p->done_ev);
}

int ktki_job_take(ktk_pool *p, int tid) {
    if (atomic_load_explicit(&p->running, memory_order_relaxed)) return 0;
    if (atomic_load(&p->queued)) {
        pthread_mutex_lock(&p->mu);
        ktk_task *t = p->head;
        if (t && ktki_job_claim(p)) {
            p->head = t->next;
            if (!p->head) p->tail = NULL;
            atomic_fetch_sub(&p->queued, 1);
        } else {
            t = NULL;
        }
        pthread_mutex_unlock(&p->mu);
        if (t) {
            ktki_pool_start_job(p, t, 0, tid);
            return 1;
        }
    }
    if (!atomic_load_explicit(&p->watch, memory_order_relaxed)) return 0;
    ktk_task *t = ktki_watch_take(p, tid);
    if (!t) return 0;
    ktki_pool_start_job(p, t, 1, tid);
    return 1;
}

int ktki_job_enqueue(ktk_pool *p, ktk_task *t) {
    t->next = NULL;
    pthread_mutex_lock(&p->mu);
    if (atomic_load(&p->stop)) {   /* (set under mu: the threads may have exited on an empty queue already) */
        pthread_mutex_unlock(&p->mu);
        return 0;
    }
    if (p->tail) p->tail->next = t;
    else p->head = t;
    p->tail = t;
    atomic_fetch_add(&p->queued, 1);
    pthread_mutex_unlock(&p->mu);
    ktki_event_signal(&p->work);
    return 1;
}

/* Thread id n (its scratch) is shared by callers of inline runs: held (ext) while one runs steps or a chunk. */
static void ext_lock(ktk_pool *p) {
    int free_ = 0;
    while (!atomic_compare_exchange_weak(&p->ext, &free_, 1)) {
        free_ = 0;
        ktki_cpu_relax();
    }
}

int ktki_job_run_inline(ktk_pool *p, ktk_task *t) {
    if (atomic_load(&p->queued) || atomic_load(&p->stop)) return 0;
    ext_lock(p);
    if (!ktki_job_claim(p)) {
        atomic_store(&p->ext, 0);
        return 0;
    }
    ktki_pool_start_job(p, t, 0, p->n);   /* its first steps here */
    atomic_store(&p->ext, 0);
    /* then it helps with chunks until its task is done (a chunk claimed just after that may be of the next job:
     * run under ext all the same), and waits when none is left */
    ktki_event *ev = &p->done_ev;
    for (;;) {
        const uint32_t seen = atomic_load(&ev->seq);
        if (atomic_load_explicit(&t->state, memory_order_acquire) == KTKI_TASK_IDLE) return 1;
        if (ktki_pool_items_left(p, p->n)) {
            ext_lock(p);
            const int ran = ktki_pool_run_chunk(p, p->n);
            atomic_store_explicit(&p->ext, 0, memory_order_release);
            if (ran) continue;
        }
        const int64_t until = ktki_event_now_ns() + p->spin_ns;
        while (atomic_load(&ev->seq) == seen && !ktki_pool_items_left(p, p->n) && ktki_event_now_ns() < until)
            for (int i = 0; i < 64; i++) ktki_cpu_relax();
        if (atomic_load(&ev->seq) == seen && !ktki_pool_items_left(p, p->n)) ktki_event_wait(ev, seen, 0);
    }
}
