/* Persistent thread pool: pinned threads, barrier-separated parallel phases, a task queue and a watch list.
 *
 * Thread 0 ("leader") takes tasks from the queue one after another (or, while tasks are watched, polls their go
 * flags) and runs each task's phases; a synchronous ktk_forward on an idle pool runs inline on its caller instead
 * (the caller takes thread 0's place: no hand-off to wait for). Inside a phase every thread, thread 0 included,
 * takes items from an atomic counter, then thread 0 waits until all threads have finished (the barrier). Idle threads
 * spin for a short while (KTINJECT_SPIN_US, default 50 us) and then sleep on a futex, so back-to-back phases do not
 * pay a wake-up. While tasks are watched (a CUDA graph drives the pool, one task per layer, GPU work in between):
 * - the leader spins on the go flags for 20 ms after the last watched run, then polls every ~50 us;
 * - the other threads keep spinning (no futex sleep) while a watched run started or ended within the "watch spin"
 *   window (KTINJECT_WATCH_SPIN_US, default 1000 us; ktk_pool_set_watch_spin_us), so a raised go flag starts every
 *   thread within a microsecond or two instead of a futex wake-up of all of them (~25 us) at every layer. The
 *   window bounds the cost: between decode steps (the host runs the sampling loop) and in an idle chat they sleep.
 *   ktk_pool_wake (the graph runner calls it just before a replay) opens the window early and wakes sleepers, so
 *   the first layer of a step does not pay the wake-up either. Unwatching the last task ends the window at once.
 * Scratch buffers are grow-only and kept by the pool: no allocation on the hot path once sizes are reached.
 */
#define _GNU_SOURCE
#include <errno.h>
#include <limits.h>
#include <linux/futex.h>
#include <pthread.h>
#include <sched.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/syscall.h>
#include <time.h>
#include <unistd.h>

#include "internal.h"

#define KTKI_WATCH_SPIN_NS 20000000LL /* leader keeps spinning on go flags this long after the last activity */
#define KTKI_WATCH_NAP_NS 50000L      /* then naps this long between polls */
#define KTKI_WATCH_SPIN_US_DEFAULT 1000 /* workers spin this long after watched activity (KTINJECT_WATCH_SPIN_US) */
#define KTKI_WATCH_SPIN_US_MAX 10000000LL

typedef struct {
    void *buf;
    size_t size;
    char pad[64 - sizeof(void *) - sizeof(size_t)];
} ktki_slot;

struct ktk_pool {
    int n, pin;
    int64_t spin_ns;
    _Atomic int64_t watch_spin_ns;  /* workers spin (no futex sleep) this long after watched activity */
    _Atomic int64_t hot_until __attribute__((aligned(64)));  /* now_ns() deadline of that spinning; 0: none */
    pthread_t *threads;
    int *started;
    /* phases */
    ktki_event phase;       /* bumped once per phase (and once to stop the workers) */
    ktki_event finished;    /* bumped by each worker at the end of a phase */
    ktki_item_fn fn;
    void *ctx;
    int64_t nitems;
    _Atomic int64_t next __attribute__((aligned(64)));
    _Atomic int stop_workers;
    /* queue + watch list (mu) */
    pthread_mutex_t mu;
    pthread_cond_t cv;       /* signalled when a watched run ends */
    ktk_task *head, *tail;
    ktki_event queue_ev;     /* bumped on enqueue, watch and stop */
    ktki_event done_ev;      /* bumped after a task run ends */
    int stop;
    ktk_task **watch;
    int nwatch, watch_cap, watch_next;
    ktk_task *watch_running;
    int running;             /* a task runs (on the leader, or inline on a caller of ktk_forward) */
    /* scratch */
    ktki_slot shared[KTKI_SCR_SLOTS];
    ktki_slot *per_thread;
};

/* ---- events ---- */
static int64_t now_ns(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (int64_t)ts.tv_sec * 1000000000LL + ts.tv_nsec;
}

static inline void cpu_relax(void) {
#if defined(__x86_64__) || defined(__i386__)
    __builtin_ia32_pause();
#endif
}

void ktki_event_wait(ktki_event *ev, uint32_t seen, int64_t spin_ns) {
    int64_t deadline = 0;
    for (uint32_t i = 0; atomic_load_explicit(&ev->seq, memory_order_acquire) == seen; i++) {
        cpu_relax();
        if ((i & 63) != 63) continue;
        int64_t t = now_ns();
        if (deadline == 0) deadline = t + spin_ns;
        else if (t > deadline) break;
    }
    while (atomic_load(&ev->seq) == seen) {
        atomic_fetch_add(&ev->waiters, 1);
        if (atomic_load(&ev->seq) == seen)
            syscall(SYS_futex, (uint32_t *)&ev->seq, FUTEX_WAIT_PRIVATE, seen, NULL, NULL, 0);
        atomic_fetch_sub(&ev->waiters, 1);
    }
}

void ktki_event_signal(ktki_event *ev) {
    atomic_fetch_add(&ev->seq, 1);
    if (atomic_load(&ev->waiters) != 0)
        syscall(SYS_futex, (uint32_t *)&ev->seq, FUTEX_WAKE_PRIVATE, INT_MAX, NULL, NULL, 0);
}

/* ---- phases ---- */
static void run_items(ktk_pool *p, int tid) {
    ktki_item_fn fn = p->fn;
    void *ctx = p->ctx;
    int64_t n = p->nitems, i;
    while ((i = atomic_fetch_add_explicit(&p->next, 1, memory_order_relaxed)) < n) fn(ctx, i, tid);
}

void ktki_parallel(ktk_pool *p, ktki_item_fn fn, void *ctx, int64_t nitems) {
    if (nitems <= 0) return;
    if (p->n == 1 || nitems == 1) {
        for (int64_t i = 0; i < nitems; i++) fn(ctx, i, 0);
        return;
    }
    p->fn = fn;
    p->ctx = ctx;
    p->nitems = nitems;
    atomic_store_explicit(&p->next, 0, memory_order_relaxed);
    uint32_t target = atomic_load(&p->finished.seq) + (uint32_t)(p->n - 1);
    ktki_event_signal(&p->phase);
    run_items(p, 0);
    uint32_t v;
    while ((v = atomic_load_explicit(&p->finished.seq, memory_order_acquire)) != target)
        ktki_event_wait(&p->finished, v, p->spin_ns);
}

/* ---- threads ---- */
typedef struct {
    ktk_pool *pool;
    int tid, cpu;
} ktki_thread_arg;

static void pin_self(int cpu) {
    cpu_set_t set;
    CPU_ZERO(&set);
    CPU_SET(cpu, &set);
    (void)pthread_setaffinity_np(pthread_self(), sizeof set, &set); /* failure is fine: runs unpinned */
}

/* Workers between phases: spin while the pool is "hot" (within the watch spin window) or for the ordinary short
 * spin, then sleep on the phase event's futex. A ktk_pool_wake wakes sleepers without a phase: they spin again.
 * While hot, a spinning worker yields its CPU every ~10-20 us: a no-op when nothing else wants it, but the host
 * thread (which wakes up between decode steps, when all cores may be spinning) gets a core at once. */
static void worker_wait(ktk_pool *p, uint32_t seen) {
    ktki_event *ev = &p->phase;
    for (;;) {
        int64_t spin_until = 0;
        for (;;) {
            for (int i = 0; i < 256; i++) {
                if (atomic_load_explicit(&ev->seq, memory_order_acquire) != seen) return;
                cpu_relax();
            }
            int64_t t = now_ns();
            if (spin_until == 0) spin_until = t + p->spin_ns;
            if (t < spin_until) continue;
            if (t >= atomic_load_explicit(&p->hot_until, memory_order_relaxed)) break;
            sched_yield();
        }
        atomic_fetch_add(&ev->waiters, 1);
        if (atomic_load(&ev->seq) == seen)
            syscall(SYS_futex, (uint32_t *)&ev->seq, FUTEX_WAIT_PRIVATE, seen, NULL, NULL, 0);
        atomic_fetch_sub(&ev->waiters, 1);
        if (atomic_load_explicit(&ev->seq, memory_order_acquire) != seen) return;
    }
}

/* Extend the workers' spinning to now + watch spin window (called around watched runs and on watch). */
static void mark_hot(ktk_pool *p) {
    int64_t w = atomic_load_explicit(&p->watch_spin_ns, memory_order_relaxed);
    atomic_store_explicit(&p->hot_until, w > 0 ? now_ns() + w : 0, memory_order_relaxed);
}

static void worker_loop(ktk_pool *p, int tid) {
    uint32_t seen = 0; /* not the current value: a phase may start before this thread does */
    for (;;) {
        worker_wait(p, seen);
        seen = atomic_load(&p->phase.seq);
        if (atomic_load(&p->stop_workers)) return;
        run_items(p, tid);
        ktki_event_signal(&p->finished);
    }
}

/* Under mu: a watched task whose *go is 1 (round robin), its *go reset to 0; NULL if none. */
static ktk_task *poll_watch(ktk_pool *p) {
    for (int j = 0; j < p->nwatch; j++) {
        int i = (p->watch_next + j) % p->nwatch;
        ktk_task *t = p->watch[i];
        if (__atomic_load_n(t->go, __ATOMIC_ACQUIRE) == 1) {
            __atomic_store_n(t->go, 0, __ATOMIC_RELAXED);
            p->watch_next = (i + 1) % p->nwatch;
            p->watch_running = t;
            return t;
        }
    }
    return NULL;
}

/* Under mu: the next task for the leader (queue first, then raised go flags), marking the pool running. */
static ktk_task *take_task(ktk_pool *p, int *watched) {
    ktk_task *t = NULL;
    *watched = 0;
    if (p->running) return NULL;   /* a caller runs a forward inline (ktki_pool_run_inline) */
    if ((t = p->head)) {
        p->head = t->next;
        if (!p->head) p->tail = NULL;
    } else if (p->nwatch) {
        t = poll_watch(p);
        *watched = t != NULL;
    }
    if (t) p->running = 1;
    return t;
}

static void leader_loop(ktk_pool *p) {
    int64_t last_active = now_ns();
    for (;;) {
        uint32_t qseen = atomic_load(&p->queue_ev.seq);
        int watched;
        pthread_mutex_lock(&p->mu);
        ktk_task *t = take_task(p, &watched);
        int stop = p->stop, poll = p->nwatch && !p->running;
        pthread_mutex_unlock(&p->mu);
        if (t) {
            if (watched) mark_hot(p);    /* spinning workers stay awake for this run's phases */
            ktki_task_run(t, watched);   /* t may be gone once it returns */
            if (watched) mark_hot(p);    /* ... and for the next layer's go */
            pthread_mutex_lock(&p->mu);
            p->running = 0;
            if (watched) p->watch_running = NULL;
            pthread_cond_broadcast(&p->cv);
            pthread_mutex_unlock(&p->mu);
            ktki_event_signal(&p->done_ev);
            last_active = now_ns();
        } else if (stop) {
            return;
        } else if (poll) {
            int64_t t = now_ns(), hot = atomic_load_explicit(&p->hot_until, memory_order_relaxed);
            if (t - last_active < KTKI_WATCH_SPIN_NS || t < hot) {
                for (int i = 0; i < 32; i++) cpu_relax();
            } else {
                struct timespec nap = {0, KTKI_WATCH_NAP_NS};
                nanosleep(&nap, NULL);
            }
        } else {
            ktki_event_wait(&p->queue_ev, qseen, p->spin_ns);
        }
    }
}

int ktki_pool_run_inline(ktk_pool *p, ktk_task *t) {
    pthread_mutex_lock(&p->mu);
    int free_now = !p->running && !p->head && !p->stop;
    if (free_now) p->running = 1;
    pthread_mutex_unlock(&p->mu);
    if (!free_now) return 0;
    ktki_task_run(t, 0);
    pthread_mutex_lock(&p->mu);
    p->running = 0;
    const int waiting = p->head != NULL || p->nwatch > 0;
    pthread_mutex_unlock(&p->mu);
    /* Wake the leader only if it may wait for this: tasks were queued meanwhile, or tasks are watched (it polls
     * their flags, but waits on the queue event while the pool is running). A signal every time restarted its spin
     * window, so back-to-back inline forwards kept it spinning on a CPU of its own (on 2 CPUs: three spinning
     * threads, 21-23 instead of 7 us a one-token forward of a tiny layer). Later enqueues and watches signal. */
    if (waiting) ktki_event_signal(&p->queue_ev);
    return 1;
}

static void *thread_main(void *argp) {
    ktki_thread_arg arg = *(ktki_thread_arg *)argp;
    free(argp);
    char name[16];
    snprintf(name, sizeof name, "ktk-%d", arg.tid);
    pthread_setname_np(pthread_self(), name);
    if (arg.pool->pin && arg.cpu >= 0) pin_self(arg.cpu);
    if (arg.tid == 0) leader_loop(arg.pool);
    else worker_loop(arg.pool, arg.tid);
    return NULL;
}

static void stop_and_join(ktk_pool *p) {
    pthread_mutex_lock(&p->mu);
    p->stop = 1;
    pthread_mutex_unlock(&p->mu);
    ktki_event_signal(&p->queue_ev);
    if (p->started[0]) pthread_join(p->threads[0], NULL);  /* the leader drains the queue first */
    atomic_store(&p->stop_workers, 1);
    ktki_event_signal(&p->phase);
    for (int i = 1; i < p->n; i++)
        if (p->started[i]) pthread_join(p->threads[i], NULL);
}

static void free_pool(ktk_pool *p) {
    for (int s = 0; s < KTKI_SCR_SLOTS; s++) free(p->shared[s].buf);
    if (p->per_thread)
        for (int i = 0; i < p->n; i++) free(p->per_thread[i].buf);
    free(p->per_thread);
    free(p->watch);
    free(p->threads);
    free(p->started);
    pthread_mutex_destroy(&p->mu);
    pthread_cond_destroy(&p->cv);
    free(p);
}

int ktki_pool_create(int nthreads, int pin, ktk_pool **out) {
    ktk_pool *p = calloc(1, sizeof *p);
    if (!p) return ktki_error(KTK_ERR_NOMEM, "ktk_pool_create: out of memory");
    p->n = nthreads;
    p->pin = pin != 0;
    const char *spin = getenv("KTINJECT_SPIN_US");
    long us = spin ? strtol(spin, NULL, 10) : 50;
    p->spin_ns = (us < 0 ? 0 : us > 1000000 ? 1000000 : us) * 1000LL;
    const char *wspin = getenv("KTINJECT_WATCH_SPIN_US");
    long long wus = wspin ? strtoll(wspin, NULL, 10) : KTKI_WATCH_SPIN_US_DEFAULT;
    atomic_store(&p->watch_spin_ns,
                 (wus < 0 ? 0 : wus > KTKI_WATCH_SPIN_US_MAX ? KTKI_WATCH_SPIN_US_MAX : wus) * 1000LL);
    pthread_mutex_init(&p->mu, NULL);
    pthread_cond_init(&p->cv, NULL);
    p->threads = calloc((size_t)nthreads, sizeof *p->threads);
    p->started = calloc((size_t)nthreads, sizeof *p->started);
    p->per_thread = calloc((size_t)nthreads, sizeof *p->per_thread);
    int *order = malloc(4096 * sizeof(int));
    if (!p->threads || !p->started || !p->per_thread || !order) {
        free(order);
        free_pool(p);
        return ktki_error(KTK_ERR_NOMEM, "ktk_pool_create: out of memory");
    }
    int ncpu = ktki_cpu_order(order, 4096);
    for (int i = 0; i < nthreads; i++) {
        ktki_thread_arg *arg = malloc(sizeof *arg);
        int rc = arg ? 0 : ENOMEM;
        if (arg) {
            *arg = (ktki_thread_arg){p, i, ncpu > 0 ? order[i % ncpu] : -1};
            rc = pthread_create(&p->threads[i], NULL, thread_main, arg);
            if (rc) free(arg);
        }
        if (rc) {
            free(order);
            stop_and_join(p);
            free_pool(p);
            return ktki_error(KTK_ERR_THREAD, "ktk_pool_create: could not start thread %d of %d (%s)", i,
                              nthreads, strerror(rc));
        }
        p->started[i] = 1;
    }
    free(order);
    *out = p;
    return KTK_OK;
}

void ktki_pool_destroy(ktk_pool *p) {
    stop_and_join(p);
    free_pool(p);
}

int ktki_pool_threads(const ktk_pool *p) { return p->n; }

void ktki_pool_set_watch_spin_us(ktk_pool *p, int64_t us) {
    atomic_store(&p->watch_spin_ns, us * 1000LL);
    pthread_mutex_lock(&p->mu);
    if (p->nwatch) mark_hot(p);   /* a shorter window takes effect now, a longer one from now */
    pthread_mutex_unlock(&p->mu);
}

int64_t ktki_pool_watch_spin_us(const ktk_pool *p) { return atomic_load(&p->watch_spin_ns) / 1000; }

void ktki_pool_wake(ktk_pool *p) {
    pthread_mutex_lock(&p->mu);
    int watched = p->nwatch != 0;
    if (watched) mark_hot(p);
    pthread_mutex_unlock(&p->mu);
    if (watched && atomic_load(&p->phase.waiters) != 0)   /* sleepers see no new phase and spin (hot) */
        syscall(SYS_futex, (uint32_t *)&p->phase.seq, FUTEX_WAKE_PRIVATE, INT_MAX, NULL, NULL, 0);
}

int64_t ktki_pool_spin_ns(const ktk_pool *p) { return p->spin_ns; }
ktki_event *ktki_pool_done_event(ktk_pool *p) { return &p->done_ev; }

/* ---- scratch ---- */
static void *grow(ktki_slot *s, size_t bytes) {
    if (bytes <= s->size && s->buf) return s->buf;
    size_t size = bytes + bytes / 4 + 4096;
    size = (size + 63) & ~(size_t)63;
    void *buf = NULL;
    if (posix_memalign(&buf, 64, size) != 0) return NULL;
    free(s->buf);
    s->buf = buf;
    s->size = size;
    return buf;
}

void *ktki_scratch(ktk_pool *p, int slot, size_t bytes) { return grow(&p->shared[slot], bytes); }

int ktki_thread_scratch_reserve(ktk_pool *p, size_t bytes) {
    for (int i = 0; i < p->n; i++)
        if (!grow(&p->per_thread[i], bytes)) return 0;
    return 1;
}

void *ktki_thread_scratch(ktk_pool *p, int tid) { return p->per_thread[tid].buf; }

/* ---- queue and watch list ---- */
void ktki_pool_enqueue(ktk_pool *p, ktk_task *t) {
    t->next = NULL;
    pthread_mutex_lock(&p->mu);
    if (p->tail) p->tail->next = t;
    else p->head = t;
    p->tail = t;
    pthread_mutex_unlock(&p->mu);
    ktki_event_signal(&p->queue_ev);
}

int ktki_pool_watch(ktk_pool *p, ktk_task *t) {
    pthread_mutex_lock(&p->mu);
    if (p->nwatch == p->watch_cap) {
        int cap = p->watch_cap ? 2 * p->watch_cap : 16;
        ktk_task **w = realloc(p->watch, (size_t)cap * sizeof *w);
        if (!w) {
            pthread_mutex_unlock(&p->mu);
            return ktki_error(KTK_ERR_NOMEM, "ktk_task_watch: out of memory");
        }
        p->watch = w;
        p->watch_cap = cap;
    }
    p->watch[p->nwatch++] = t;
    mark_hot(p);   /* a graph that signals it is about to run */
    pthread_mutex_unlock(&p->mu);
    ktki_event_signal(&p->queue_ev);
    return KTK_OK;
}

void ktki_pool_unwatch(ktk_pool *p, ktk_task *t) {
    pthread_mutex_lock(&p->mu);
    while (p->watch_running == t) pthread_cond_wait(&p->cv, &p->mu);
    for (int i = 0; i < p->nwatch; i++) {
        if (p->watch[i] != t) continue;
        memmove(p->watch + i, p->watch + i + 1, (size_t)(p->nwatch - i - 1) * sizeof *p->watch);
        p->nwatch--;
        break;
    }
    p->watch_next = 0;
    if (!p->nwatch) atomic_store(&p->hot_until, 0);   /* nothing watched: workers may sleep at once */
    pthread_mutex_unlock(&p->mu);
}
