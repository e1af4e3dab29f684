/* The pool's tasks: the queue, the watch list and how a thread picks up a task (any idle thread may).
 *
 * A job is claimed by a CAS of `running` 0 -> 1: queued tasks first, then watched tasks whose go flag is 1 (round
 * robin; go is reset to 0 once running is held); a synchronous ktk_forward on an idle pool runs its first steps on
 * its caller (ktki_pool_run_inline), which then helps with the chunks of its phases.
 * While tasks are watched (a CUDA graph drives the pool, one task per layer, GPU work in between):
 * - a watched task may chain another (ktk_task_watch_then: expert deferral): its run's end raises the other's go
 *   right after its own done, so the layer's deferred experts follow its immediate ones with no stream operation
 *   between; at most one go is raised at that moment (the GPU waits on this done before it raises the next);
 * - idle threads keep spinning and polling the go flags while a watched run started or ended within the watch spin
 *   window (KTINJECT_WATCH_SPIN_US, default 1000 us; ktk_pool_set_watch_spin_us), so a raised go flag is taken and
 *   its phases started within a microsecond or two instead of futex wake-ups (~25 us) at every layer; the window
 *   bounds the cost (between decode steps and in an idle chat they sleep); ktk_pool_wake (the graph runner calls it
 *   just before a replay) opens it early and wakes sleepers; unwatching the last task ends it;
 * - outside it thread 0 alone polls (the others sleep): spinning for 20 ms after the last watched run, then every
 *   ~50 us. Only the first layer of a step can wait for it, and the graph runner opens the window before a replay.
 * The watch list is copied on change and read without a lock: a reader's per-thread counter is odd while it scans,
 * and a writer frees the old copy (and unwatch returns) only after every scan that may have seen it has ended.
 */
#define _GNU_SOURCE
#include <limits.h>
#include <linux/futex.h>
#include <sched.h>
#include <stdlib.h>
#include <string.h>
#include <sys/syscall.h>
#include <time.h>
#include <unistd.h>

#include "pool.h"

void ktki_pool_mark_hot(ktk_pool *p) {
    int64_t w = atomic_load_explicit(&p->watch_spin_ns, memory_order_relaxed);
    atomic_store_explicit(&p->hot_until, w > 0 ? ktki_now_ns() + w : 0, memory_order_relaxed);
}

static int try_running(ktk_pool *p) {
    int free_ = 0;
    return atomic_compare_exchange_strong(&p->running, &free_, 1);
}

/* The pool released (running 0) by a job's end or a failed take: where a task was queued meanwhile, the threads that
 * found the pool busy and went idle are woken to take it (the job may have ended on a caller's thread, which does
 * not take queued tasks). running is stored seq_cst and queued read after it; an enqueue increments queued before
 * its event: either this sees the task or the enqueuer's event comes after the pool is free. */
static void release_running(ktk_pool *p) {
    atomic_store(&p->running, 0);
    if (atomic_load(&p->queued)) ktki_event_signal(&p->work);
}

/* A watched task's run ends (done flag, IDLE) before watch_running is cleared, which unwatch waits for; any other
 * releases the pool first, so that its caller, back from waiting, finds the pool free for its next forward. */
void ktki_pool_end_job(ktk_pool *p) {
    ktk_task *t = p->job;
    ktki_pool_profile_job_end(p);
    /* no thread sits out what comes next (a stale value kept one asleep through the next job's phases) */
    atomic_store_explicit(&p->sit_out, -1, memory_order_relaxed);
    if (p->job_watched) {
        volatile uint32_t *then = t->then;
        ktki_task_end(t, 1);
        if (then) __atomic_store_n(then, 1u, __ATOMIC_RELEASE);   /* after done: the GPU's wait is not delayed */
        ktki_pool_mark_hot(p);   /* ... idle threads stay awake for the next layer's go */
        atomic_store_explicit(&p->last_watched, ktki_now_ns(), memory_order_relaxed);
        atomic_store(&p->watch_running, NULL);
        release_running(p);
        if (then) ktki_event_signal(&p->work);   /* the chained task: this thread or any other takes it at once */
    } else {
        release_running(p);
        ktki_task_end(t, 0);   /* t may be gone from here on */
    }
    ktki_event_signal(&p->done_ev);
}

/* ---- the watch list ---- */
/* Scan the watch list for a raised go flag; with take, claim running and the task (go reset to 0). Returns the
 * task taken (take) or any raised one (!take), else NULL. Never dereferences a task outside a scan. */
static ktk_task *scan(ktk_pool *p, int tid, int take) {
    ktki_slot *me = &p->per_thread[tid];
    ktk_task *found = NULL;
    atomic_fetch_add(&me->scan, 1);
    ktki_wlist *w = atomic_load(&p->watch);
    const int n = w ? w->n : 0, s = n ? atomic_load_explicit(&p->watch_next, memory_order_relaxed) % n : 0;
    for (int j = 0; j < n && !found; j++) {
        ktk_task *t = w->t[(s + j) % n];
        if (__atomic_load_n(t->go, __ATOMIC_ACQUIRE) != 1) continue;
        if (!take) {
            found = t;
        } else if (try_running(p)) {
            if (__atomic_load_n(t->go, __ATOMIC_ACQUIRE) == 1) {   /* not taken and run by another meanwhile */
                __atomic_store_n(t->go, 0, __ATOMIC_RELAXED);
                atomic_store(&p->watch_running, t);
                atomic_store_explicit(&p->watch_next, (s + j + 1) % n, memory_order_relaxed);
                found = t;
            } else {
                release_running(p);
            }
        } else {
            break;   /* another job runs */
        }
    }
    atomic_fetch_add_explicit(&me->scan, 1, memory_order_release);
    return found;
}

int ktki_pool_go_raised(ktk_pool *p, int tid) {
    if (!atomic_load_explicit(&p->watch, memory_order_relaxed) || atomic_load_explicit(&p->running,
                                                                                      memory_order_relaxed))
        return 0;
    return scan(p, tid, 0) != NULL;
}

int ktki_pool_take_task(ktk_pool *p, int tid) {
    if (atomic_load_explicit(&p->running, memory_order_relaxed)) return 0;
    if (atomic_load(&p->queued)) {
        pthread_mutex_lock(&p->mu);
        ktk_task *t = p->head;
        if (t && try_running(p)) {
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
    ktk_task *t = scan(p, tid, 1);
    if (!t) return 0;
    ktki_pool_start_job(p, t, 1, tid);
    return 1;
}

int ktki_pool_nap(ktk_pool *p, int tid, uint32_t seen) {
    if (tid != 0 || !atomic_load(&p->watch)) return 0;
    int64_t yield_at = 0;
    while (atomic_load(&p->watch) && atomic_load_explicit(&p->work.seq, memory_order_acquire) == seen &&
           !ktki_pool_items_left(p, tid) && !ktki_pool_go_raised(p, tid)) {
        const int64_t t = ktki_now_ns();
        if (t - atomic_load_explicit(&p->last_watched, memory_order_relaxed) < KTKI_WATCH_SPIN_NS ||
            t < atomic_load_explicit(&p->hot_until, memory_order_relaxed)) {
            for (int i = 0; i < 32; i++) ktki_cpu_relax();
            if (t >= yield_at) {
                sched_yield();
                yield_at = t + 15000;
            }
        } else {
            struct timespec nap = {0, KTKI_WATCH_NAP_NS};
            nanosleep(&nap, NULL);
        }
    }
    return 1;
}

/* Under mu: publish the watch list with `add` added and `remove` removed; free the old copy once no scan may read it.
 * Returns KTK_OK or KTK_ERR_NOMEM (nothing changed). */
static int set_watch(ktk_pool *p, ktk_task *add, ktk_task *remove) {
    ktki_wlist *old = atomic_load(&p->watch);
    const int n = old ? old->n : 0;
    ktki_wlist *w = malloc(sizeof *w + (size_t)(n + 1) * sizeof(ktk_task *));
    if (!w) return ktki_error(KTK_ERR_NOMEM, "ktk_task_watch: out of memory");
    w->n = 0;
    for (int i = 0; i < n; i++)
        if (old->t[i] != remove) w->t[w->n++] = old->t[i];
    if (add) w->t[w->n++] = add;
    if (w->n == 0) {
        free(w);
        w = NULL;
    }
    atomic_store(&p->watch, w);
    atomic_store_explicit(&p->watch_next, 0, memory_order_relaxed);
    for (int i = 0; i < p->n; i++) {   /* scans that may have loaded `old` end */
        const uint32_t s = atomic_load(&p->per_thread[i].scan);
        while ((s & 1) && atomic_load(&p->per_thread[i].scan) == s) sched_yield();
    }
    free(old);
    return KTK_OK;
}

int ktki_pool_watch(ktk_pool *p, ktk_task *t) {
    pthread_mutex_lock(&p->mu);
    if (p->dead || atomic_load(&p->stop)) {
        pthread_mutex_unlock(&p->mu);
        return ktki_error(KTK_ERR_STATE, "ktk_task_watch: the task's pool is destroyed");
    }
    int rc = set_watch(p, t, NULL);
    if (rc == KTK_OK) ktki_pool_mark_hot(p);   /* a graph that signals it is about to run */
    pthread_mutex_unlock(&p->mu);
    ktki_event_signal(&p->work);
    return rc;
}

void ktki_pool_unwatch(ktk_pool *p, ktk_task *t) {
    pthread_mutex_lock(&p->mu);
    if (p->dead) {   /* destroyed: its threads are joined and its watch list is gone */
        pthread_mutex_unlock(&p->mu);
        return;
    }
    while (set_watch(p, NULL, t) != KTK_OK) sched_yield();   /* out of memory: try again */
    if (!atomic_load(&p->watch)) atomic_store(&p->hot_until, 0);   /* nothing watched: threads may sleep at once */
    pthread_mutex_unlock(&p->mu);
    for (;;) {   /* no scan can take t any more; a run of it may still be going */
        uint32_t seen = atomic_load(&p->done_ev.seq);
        if (atomic_load(&p->watch_running) != t) break;
        ktki_event_wait(&p->done_ev, seen, p->spin_ns);
    }
}

/* ---- queue, inline runs, wake ---- */
int ktki_pool_enqueue(ktk_pool *p, ktk_task *t) {
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

int ktki_pool_run_inline(ktk_pool *p, ktk_task *t) {
    if (atomic_load(&p->queued) || atomic_load(&p->stop)) return 0;
    ext_lock(p);
    if (!try_running(p)) {
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
        const int64_t until = ktki_now_ns() + p->spin_ns;
        while (atomic_load(&ev->seq) == seen && !ktki_pool_items_left(p, p->n) && ktki_now_ns() < until)
            for (int i = 0; i < 64; i++) ktki_cpu_relax();
        if (atomic_load(&ev->seq) == seen && !ktki_pool_items_left(p, p->n)) ktki_event_wait(ev, seen, 0);
    }
}

void ktki_pool_set_watch_spin_us(ktk_pool *p, int64_t us) {
    atomic_store(&p->watch_spin_ns, us * 1000LL);
    pthread_mutex_lock(&p->mu);
    if (atomic_load(&p->watch)) ktki_pool_mark_hot(p);   /* a shorter window takes effect now, a longer from now */
    pthread_mutex_unlock(&p->mu);
}

int64_t ktki_pool_watch_spin_us(const ktk_pool *p) { return atomic_load(&p->watch_spin_ns) / 1000; }

void ktki_pool_wake(ktk_pool *p) {
    if (!atomic_load(&p->watch)) return;
    ktki_pool_mark_hot(p);
    if (atomic_load(&p->work.waiters) != 0)   /* sleepers see no new work and spin (hot) */
        syscall(SYS_futex, (uint32_t *)&p->work.seq, FUTEX_WAKE_PRIVATE, INT_MAX, NULL, NULL, 0);
}
