/* The pool's watch list: tasks that a pool thread starts when their go word rises (a CUDA graph raises it), and
 * the hot window in which idle threads poll for that. A raised go flag is taken after the queue (job.c), round
 * robin; go is reset to 0 once the pool's `running` is held.
 * While tasks are watched (a CUDA graph drives the pool, one task per layer, GPU work in between):
 * - a watched task may chain another (ktk_task_watch_then: expert deferral): its run's end raises the other's go
 *   right after its own done, so the layer's deferred experts follow its immediate ones with no stream operation
 *   between; at most one go is raised at that moment (the GPU waits on this done before it raises the next);
 * - idle threads keep spinning and polling the go flags while a watched run started or ended within the watch spin
 *   window (KTINJECT_WATCH_SPIN_US, default 1000 us; ktk_pool_set_watch_spin_us), so a raised go flag is taken and
 *   its phases started at once instead of after futex wake-ups at every layer; the window bounds the cost (between
 *   decode steps and in an idle chat they sleep); ktk_pool_wake (the graph runner calls it just before a replay)
 *   opens it early and wakes sleepers; unwatching the last task ends it;
 * - outside it thread 0 alone polls (the others sleep): spinning for KTKI_WATCH_SPIN_NS after the last watched run,
 *   then every KTKI_WATCH_NAP_NS (pool.h). Only the first layer of a step can wait for it, and the graph runner
 *   opens the window before a replay.
 * The watch list is copied on change and read without a lock: a reader's per-thread counter is odd while it scans,
 * and a writer frees the old copy (and unwatch returns) only after every scan that may have seen it has ended.
 */
#define _GNU_SOURCE
#include <limits.h>
#include <linux/futex.h>
#include <sched.h>
#include <stdlib.h>
#include <sys/syscall.h>
#include <time.h>
#include <unistd.h>

#include "pool.h"

void ktki_watch_mark_hot(ktk_pool *p) {
    int64_t w = atomic_load_explicit(&p->watch_spin_ns, memory_order_relaxed);
    atomic_store_explicit(&p->hot_until, w > 0 ? ktki_event_now_ns() + w : 0, memory_order_relaxed);
}

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
        } else if (ktki_job_claim(p)) {
            if (__atomic_load_n(t->go, __ATOMIC_ACQUIRE) == 1) {   /* not taken and run by another meanwhile */
                __atomic_store_n(t->go, 0, __ATOMIC_RELAXED);
                atomic_store(&p->watch_running, t);
                atomic_store_explicit(&p->watch_next, (s + j + 1) % n, memory_order_relaxed);
                found = t;
            } else {
                ktki_job_release(p);
            }
        } else {
            break;   /* another job runs */
        }
    }
    atomic_fetch_add_explicit(&me->scan, 1, memory_order_release);
    return found;
}

int ktki_watch_go_raised(ktk_pool *p, int tid) {
    if (!atomic_load_explicit(&p->watch, memory_order_relaxed) || atomic_load_explicit(&p->running,
                                                                                      memory_order_relaxed))
        return 0;
    return scan(p, tid, 0) != NULL;
}

ktk_task *ktki_watch_take(ktk_pool *p, int tid) { return scan(p, tid, 1); }

int ktki_watch_nap(ktk_pool *p, int tid, uint32_t seen) {
    if (tid != 0 || !atomic_load(&p->watch)) return 0;
    int64_t yield_at = 0;
    while (atomic_load(&p->watch) && atomic_load_explicit(&p->work.seq, memory_order_acquire) == seen &&
           !ktki_pool_items_left(p, tid) && !ktki_watch_go_raised(p, tid)) {
        const int64_t t = ktki_event_now_ns();
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

int ktki_watch_add(ktk_pool *p, ktk_task *t) {
    pthread_mutex_lock(&p->mu);
    if (p->dead || atomic_load(&p->stop)) {
        pthread_mutex_unlock(&p->mu);
        return ktki_error(KTK_ERR_STATE, "ktk_task_watch: the task's pool is destroyed");
    }
    int rc = set_watch(p, t, NULL);
    if (rc == KTK_OK) ktki_watch_mark_hot(p);   /* a graph that signals it is about to run */
    pthread_mutex_unlock(&p->mu);
    ktki_event_signal(&p->work);
    return rc;
}

void ktki_watch_remove(ktk_pool *p, ktk_task *t) {
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

void ktki_watch_set_spin_us(ktk_pool *p, int64_t us) {
    atomic_store(&p->watch_spin_ns, us * 1000LL);
    pthread_mutex_lock(&p->mu);
    if (atomic_load(&p->watch)) ktki_watch_mark_hot(p);   /* a shorter window takes effect now, a longer from now */
    pthread_mutex_unlock(&p->mu);
}

int64_t ktki_watch_spin_us(const ktk_pool *p) { return atomic_load(&p->watch_spin_ns) / 1000; }

void ktki_watch_wake(ktk_pool *p) {
    if (!atomic_load(&p->watch)) return;
    ktki_watch_mark_hot(p);
    if (atomic_load(&p->work.waiters) != 0)   /* sleepers see no new work and spin (hot) */
        syscall(SYS_futex, (uint32_t *)&p->work.seq, FUTEX_WAKE_PRIVATE, INT_MAX, NULL, NULL, 0);
}
