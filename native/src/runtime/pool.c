/* Persistent thread pool that a thread losing its core does not stall: one job at a time (a task's forward), run as
 * a chain of parallel phases by whichever threads are there; a task queue (job.c) and a watch list (watch.c).
 *
 * Why no leader and no barrier: on a shared host a thread can be off its core for a time slice of another process
 * (milliseconds). When each phase ended once all threads had arrived, and one leader thread alone picked up tasks
 * and started phases, every phase waited for a thread that had lost its core, work left or not: one busy process
 * beside graph decode slowed it many times over. Now:
 * - a phase is [0, nitems), claimed in chunks from one 64-bit word (generation | items | next unclaimed); chunks are
 *   fixed (maxc) or guided (remaining / (2 x threads), within [max(1, minc), maxc]; a phase's cut, where set, is a
 *   boundary no chunk crosses, the items before it sized by what is left before it): no thread has a fixed share;
 * - a phase ends when its items are done (a count), not when threads arrive: a thread that comes late finds nothing
 *   to claim and holds nothing; one that loses its core mid-chunk delays that chunk only;
 * - the thread that finishes a phase's last chunk runs the job's next serial step and publishes the next phase, or
 *   ends the job (the task's done flag); any idle thread takes queued tasks and raised go flags (job.c, watch.c);
 * - idle threads spin (KTINJECT_SPIN_US, default 50 us), then sleep on a futex; while the pool is "hot" (watch.c:
 *   a watched run started or ended within the watch spin window) they keep spinning but yield their core every
 *   YIELD_NS, so a runnable thread of another process, or the one driving the GPU, gets it at once.
 * Yielding between chunks, so that a thread sharing its core steps aside at a chunk's end rather than mid-chunk,
 * gained nothing measurable beside a busy process, so a thread simply runs until the scheduler takes its core.
 * Claims: a thread claims only with the word it read, and phase fields are rewritten only after the phase is done
 * (every item claimed), so a claim that succeeds read the fields of its own phase. Thread ids index per-thread
 * scratch: 0..n-1 the pool's threads, n a caller of ktk_forward on an idle pool, which runs the first steps and then
 * helps with chunks, holding id n (a flag) meanwhile, so an id is never used by two threads at once.
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

#include "pool.h"

#if !defined(KTK_TEST_BUILD) || !defined(CLAIM_BITS)   /* the stress test builds with a few bits: phases of */
#undef CLAIM_BITS                                       /* several windows */
#define CLAIM_BITS 20
#endif
#define CLAIM_MAX ((1LL << CLAIM_BITS) - 1)   /* items of one claim window (larger phases: several windows) */
#define YIELD_NS 15000                         /* hot idle threads yield their core this often */

static inline uint64_t claim_word(uint64_t gen, int64_t n, int64_t next) {
    return gen << (2 * CLAIM_BITS) | (uint64_t)n << CLAIM_BITS | (uint64_t)next;
}

/* ---- phases ---- */
/* Open window [base, base + n) of the current phase (n <= CLAIM_MAX): a new generation, nothing claimed or done. */
static void publish(ktk_pool *p, int64_t base, int64_t n) {
    atomic_store_explicit(&p->base, base, memory_order_relaxed);
    atomic_store_explicit(&p->ndone, 0, memory_order_relaxed);
    uint64_t gen = (atomic_load_explicit(&p->claim, memory_order_relaxed) >> (2 * CLAIM_BITS)) + 1;
    atomic_store_explicit(&p->claim, claim_word(gen & ((1ULL << (64 - 2 * CLAIM_BITS)) - 1), n, 0),
                          memory_order_release);
    ktki_event_signal(&p->work);
}

/* The job's next steps on this thread, up to the next phase of several items (published) or the job's end. Phases
 * of one item run here: no hand-off for them. */
static void advance(ktk_pool *p, int tid) {
    ktki_phase ph;
    while (ktki_task_step(p->job, &ph)) {
        if (ph.nitems <= 0) continue;
        if (ph.nitems == 1) {
            if (ph.range) ph.range(ph.ctx, 0, 1, tid);
            else ph.item(ph.ctx, 0, tid);
            continue;
        }
        atomic_store_explicit(&p->item, ph.item, memory_order_relaxed);
        atomic_store_explicit(&p->range, ph.range, memory_order_relaxed);
        atomic_store_explicit(&p->ctx, ph.ctx, memory_order_relaxed);
        atomic_store_explicit(&p->maxc, ph.maxc < 1 ? 1 : ph.maxc, memory_order_relaxed);
        atomic_store_explicit(&p->guided, ph.guided, memory_order_relaxed);
        atomic_store_explicit(&p->minc, ph.minc < 1 ? 1 : ph.minc, memory_order_relaxed);
        atomic_store_explicit(&p->cut, ph.cut, memory_order_relaxed);
        atomic_store_explicit(&p->total, ph.nitems, memory_order_relaxed);
        if (atomic_load_explicit(&p->prof_job, memory_order_relaxed)) ktki_profile_phase_open(p);
        publish(p, 0, ph.nitems < CLAIM_MAX ? ph.nitems : CLAIM_MAX);
        return;
    }
    ktki_job_end(p);
}

/* A caller that runs a job inline (thread id n) helps with its chunks; where the pool's threads and it would
 * outnumber the CPUs, pool thread n-1 sits the job out (all of them working on too few CPUs made one-token forwards
 * slower than the caller and one thread fewer; docs/performance.md has the figures). */
void ktki_pool_start_job(ktk_pool *p, ktk_task *t, int watched, int tid) {
    p->job = t;
    p->job_watched = watched;
    const int prof = atomic_load_explicit(&p->prof, memory_order_relaxed);
    atomic_store_explicit(&p->prof_job, prof, memory_order_relaxed);   /* published with the job's first phase */
    if (prof) {
        p->prof_job_t0 = ktki_event_now_ns();
        p->prof_phase = 0;
    }
    atomic_store_explicit(&p->sit_out, tid == p->n && p->n + 1 > p->cpus ? p->n - 1 : -1, memory_order_relaxed);
    if (watched) ktki_watch_mark_hot(p);   /* idle threads stay awake for this run's phases */
    ktki_task_begin(t);
    advance(p, tid);
}

/* Claim a chunk of the open window: 1 with [*i0, *i1) and the window's size *n, 0 if nothing is left (for tid). */
static int claim(ktk_pool *p, int tid, int64_t *i0, int64_t *i1, int64_t *n) {
    uint64_t w = atomic_load_explicit(&p->claim, memory_order_acquire);
    for (;;) {
        const int64_t size = (int64_t)(w >> CLAIM_BITS) & CLAIM_MAX, next = (int64_t)w & CLAIM_MAX;
        if (next >= size || tid == atomic_load_explicit(&p->sit_out, memory_order_relaxed)) return 0;
        int64_t c = atomic_load_explicit(&p->maxc, memory_order_relaxed), left = size - next;
        if (atomic_load_explicit(&p->guided, memory_order_relaxed)) {
            /* a cut in this window: the chunks before it are sized by (and end at) what is left before it */
            const int64_t cut = atomic_load_explicit(&p->cut, memory_order_relaxed) -
                                atomic_load_explicit(&p->base, memory_order_relaxed);
            if (cut > next && cut < size) left = cut - next;
            const int64_t g = left / (2 * (int64_t)p->n), lo = atomic_load_explicit(&p->minc, memory_order_relaxed);
            c = g < lo ? (lo < c ? lo : c) : g < c ? g : c;   /* never above maxc: scratch is sized for it */
        }
        if (c > left) c = left;
        if (atomic_compare_exchange_weak_explicit(&p->claim, &w, w + (uint64_t)c, memory_order_acquire,
                                                  memory_order_acquire)) {
            *i0 = next;
            *i1 = next + c;
            *n = size;
            return 1;
        }
    }
}

#ifdef KTK_TEST_BUILD
/* Test hook KTINJECT_TEST_DELAY=TID:US (test builds only: native/tests): thread TID sleeps US us before every other
 * claim of a phase with items left (it comes late) and after every other chunk it claims (it holds the chunk while
 * off its core). */
static void test_delay(ktk_pool *p, int tid, int holding) {
    if (tid != p->delay_tid || (p->delay_count[holding]++ & 1)) return;
    struct timespec ts = {p->delay_us / 1000000, (long)(p->delay_us % 1000000) * 1000};
    nanosleep(&ts, NULL);
}

static void read_test_delay(ktk_pool *p) {
    const char *delay = getenv("KTINJECT_TEST_DELAY");
    p->delay_tid = -1;
    if (delay && strchr(delay, ':')) {
        p->delay_tid = atoi(delay);
        p->delay_us = strtoll(strchr(delay, ':') + 1, NULL, 10);
    }
}
#endif

int ktki_pool_run_chunk(ktk_pool *p, int tid) {
    int64_t i0, i1, n;
#ifdef KTK_TEST_BUILD
    if (p->delay_tid >= 0 && ktki_pool_items_left(p, tid)) test_delay(p, tid, 0);
#endif
    if (!claim(p, tid, &i0, &i1, &n)) return 0;
#ifdef KTK_TEST_BUILD
    if (p->delay_tid >= 0) test_delay(p, tid, 1);
#endif
    const int64_t base = atomic_load_explicit(&p->base, memory_order_relaxed);
    ktki_range_fn range = atomic_load_explicit(&p->range, memory_order_relaxed);
    ktki_item_fn item = atomic_load_explicit(&p->item, memory_order_relaxed);
    void *ctx = atomic_load_explicit(&p->ctx, memory_order_relaxed);
    _Atomic int64_t *thr = atomic_load_explicit(&p->prof_job, memory_order_relaxed) ? p->prof_thr : NULL;
    const int64_t t0 = thr ? ktki_event_now_ns() : 0;
    const int ph = thr ? atomic_load_explicit(&p->prof_cur, memory_order_relaxed) : 0;
    if (range) range(ctx, base + i0, base + i1, tid);
    else for (int64_t i = base + i0; i < base + i1; i++) item(ctx, i, tid);
    if (thr) {   /* this thread's own line: no contention */
        const int s = KTKI_PROF_SLOT(ph) - 2;   /* 4 i */
        atomic_fetch_add_explicit(&thr[tid * 16 + s / 2], ktki_event_now_ns() - t0, memory_order_relaxed);
        atomic_fetch_add_explicit(&thr[tid * 16 + s / 2 + 1], 1, memory_order_relaxed);
    }
    if (atomic_fetch_add_explicit(&p->ndone, i1 - i0, memory_order_acq_rel) + (i1 - i0) != n) return 1;
    /* the phase's window is done and this thread finished it: the next window, else the job's next steps */
    const int64_t total = atomic_load_explicit(&p->total, memory_order_relaxed);
    if (thr && base + n >= total) ktki_profile_phase_close(p);
    if (base + n < total) publish(p, base + n, total - base - n < CLAIM_MAX ? total - base - n : CLAIM_MAX);
    else advance(p, tid);
    return 1;
}

int ktki_pool_items_left(ktk_pool *p, int tid) {
    uint64_t w = atomic_load_explicit(&p->claim, memory_order_acquire);
    return (int64_t)(w & CLAIM_MAX) < ((int64_t)(w >> CLAIM_BITS) & CLAIM_MAX) &&
           tid != atomic_load_explicit(&p->sit_out, memory_order_relaxed);
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

/* Until there may be something to do: a new phase, task or stop (the work event moved), or a raised go flag. Spins
 * for spin_ns; then, while hot, keeps spinning and yields every YIELD_NS; else sleeps on the work event (thread 0,
 * while tasks are watched, polls the go flags instead: watch.c). */
static void idle(ktk_pool *p, int tid, uint32_t seen) {
    ktki_event *ev = &p->work;
    const uint32_t done = atomic_load(&p->done_ev.seq);
    if (tid == atomic_load(&p->sit_out) && atomic_load(&p->running)) {   /* until the job ends: no wake-up per phase */
        ktki_event_wait(&p->done_ev, done, 0);
        return;
    }
    const int64_t t0 = ktki_event_now_ns();
    int64_t yield_at = t0 + YIELD_NS;
    for (uint32_t i = 1;; i++) {
        if (atomic_load_explicit(&ev->seq, memory_order_acquire) != seen || ktki_pool_items_left(p, tid)) return;
        ktki_cpu_relax();
        if (i & 31) continue;
        if (ktki_watch_go_raised(p, tid)) return;
        if (i & 255) continue;
        if (atomic_load(&p->stop)) {   /* the pool is being destroyed: the caller checks whether to exit */
            sched_yield();
            return;
        }
        const int64_t t = ktki_event_now_ns();
        if (t < t0 + p->spin_ns) continue;
        if (t < atomic_load_explicit(&p->hot_until, memory_order_relaxed)) {
            if (t >= yield_at) {
                sched_yield();
                yield_at = ktki_event_now_ns() + YIELD_NS;
            }
            continue;
        }
        if (ktki_watch_nap(p, tid, seen)) return;   /* thread 0 polled until something happened */
        break;
    }
    atomic_fetch_add(&ev->waiters, 1);
    if (atomic_load(&ev->seq) == seen)
        syscall(SYS_futex, (uint32_t *)&ev->seq, FUTEX_WAIT_PRIVATE, seen, NULL, NULL, 0);
    atomic_fetch_sub(&ev->waiters, 1);
}

/* The work event's sequence is read before looking for work, not after: an enqueue (queued++, then the event) that
 * lands between this thread's look at the queue and its idle() moves the event past `seen`, so idle returns at once
 * instead of sleeping with a task queued (a lost wake-up: a 1-thread pool's tight submit / wait loop hung;
 * native/tests/test_wakeup.c). */
static void thread_loop(ktk_pool *p, int tid) {
    for (;;) {
        const uint32_t seen = atomic_load_explicit(&p->work.seq, memory_order_acquire);
        if (ktki_pool_run_chunk(p, tid) || ktki_job_take(p, tid)) continue;
        if (atomic_load(&p->stop) && !atomic_load(&p->running) && !atomic_load(&p->queued)) return;
        idle(p, tid, seen);
    }
}

static void *thread_main(void *argp) {
    ktki_thread_arg arg = *(ktki_thread_arg *)argp;
    free(argp);
    char name[16];
    snprintf(name, sizeof name, "ktk-%d", arg.tid);
    pthread_setname_np(pthread_self(), name);
    if (arg.pool->pin && arg.cpu >= 0) pin_self(arg.cpu);
    thread_loop(arg.pool, arg.tid);
    return NULL;
}

static void stop_and_join(ktk_pool *p) {
    pthread_mutex_lock(&p->mu);   /* against an enqueue in flight: it sees stop, or its task is queued first */
    atomic_store(&p->stop, 1);   /* threads run what is queued first */
    pthread_mutex_unlock(&p->mu);
    ktki_event_signal(&p->work);
    for (int i = 0; i < p->n; i++)
        if (p->started[i]) pthread_join(p->threads[i], NULL);
}

static void free_pool(ktk_pool *p) {
    for (int s = 0; s < KTKI_SCR_SLOTS; s++) free(p->shared[s].buf);
    if (p->per_thread)
        for (int i = 0; i <= p->n; i++) free(p->per_thread[i].buf);
    free(p->per_thread);
    free((void *)p->prof_thr);
    free(atomic_load(&p->watch));
    free(p->threads);
    free(p->started);
    pthread_mutex_destroy(&p->mu);
    free(p);
}

static void read_env(ktk_pool *p) {
    const char *spin = getenv("KTINJECT_SPIN_US");
    long us = spin ? strtol(spin, NULL, 10) : 50;
    p->spin_ns = (us < 0 ? 0 : us > 1000000 ? 1000000 : us) * 1000LL;
    const char *wspin = getenv("KTINJECT_WATCH_SPIN_US");
    long long wus = wspin ? strtoll(wspin, NULL, 10) : KTKI_WATCH_SPIN_US_DEFAULT;
    atomic_store(&p->watch_spin_ns,
                 (wus < 0 ? 0 : wus > KTKI_WATCH_SPIN_US_MAX ? KTKI_WATCH_SPIN_US_MAX : wus) * 1000LL);
#ifdef KTK_TEST_BUILD
    read_test_delay(p);
#endif
}

int ktki_pool_create(int nthreads, int pin, ktk_pool **out) {
    ktk_pool *p = calloc(1, sizeof *p);
    if (!p) return ktki_error(KTK_ERR_NOMEM, "ktk_pool_create: out of memory");
    p->n = nthreads;
    atomic_store(&p->refs, 1);
    const char *pin_env = getenv("KTINJECT_PIN");   /* 0 / 1 overrides the caller's choice (A/B measurements) */
    p->pin = pin_env && (pin_env[0] == '0' || pin_env[0] == '1') && !pin_env[1] ? pin_env[0] == '1' : pin != 0;
    read_env(p);
    pthread_mutex_init(&p->mu, NULL);
    p->threads = calloc((size_t)nthreads, sizeof *p->threads);
    p->started = calloc((size_t)nthreads, sizeof *p->started);
    p->per_thread = calloc((size_t)nthreads + 1, sizeof *p->per_thread);
    void *prof = NULL;   /* the profile's per-thread sums (ktk_pool_set_profile): 128 bytes a thread */
    _Static_assert(2 * KTK_PROFILE_PHASES <= 16, "per-thread profile: 16 sums a thread, 2 a phase");
    if (posix_memalign(&prof, 64, (size_t)(nthreads + 1) * 16 * sizeof(int64_t)) == 0) {
        memset(prof, 0, (size_t)(nthreads + 1) * 16 * sizeof(int64_t));
        p->prof_thr = prof;
    }
    int *order = malloc(4096 * sizeof(int));
    if (!p->threads || !p->started || !p->per_thread || !order) {
        free(order);
        free_pool(p);
        return ktki_error(KTK_ERR_NOMEM, "ktk_pool_create: out of memory");
    }
    int ncpu = ktki_dispatch_cpu_order(order, 4096);
    cpu_set_t allowed;
    p->cpus = sched_getaffinity(0, sizeof allowed, &allowed) == 0 ? CPU_COUNT(&allowed) : nthreads + 1;
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

/* The threads stop (after queued work); tasks still watched are dropped from the watch list, and the memory stays
 * until the last task made on the pool is destroyed too (ktki_pool_release): Python's garbage collector frees a
 * pool and its tasks in any order (a Task's attributes drop its pool before its native task), and a task destroyed
 * after its pool used to unwatch itself from the freed pool (heap corruption at interpreter exit). */
void ktki_pool_destroy(ktk_pool *p) {
    stop_and_join(p);
    pthread_mutex_lock(&p->mu);
    p->dead = 1;
    free(atomic_load(&p->watch));   /* no thread scans it any more */
    atomic_store(&p->watch, NULL);
    pthread_mutex_unlock(&p->mu);
    ktki_pool_release(p);
}

void ktki_pool_retain(ktk_pool *p) { atomic_fetch_add(&p->refs, 1); }

void ktki_pool_release(ktk_pool *p) {
    if (atomic_fetch_sub(&p->refs, 1) == 1) free_pool(p);
}

int ktki_pool_stopped(const ktk_pool *p) { return atomic_load(&p->stop) != 0; }

int ktki_pool_threads(const ktk_pool *p) { return p->n; }
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

void *ktki_pool_scratch(ktk_pool *p, int slot, size_t bytes) { return grow(&p->shared[slot], bytes); }

int ktki_pool_thread_scratch_reserve(ktk_pool *p, size_t bytes) {
    for (int i = 0; i <= p->n; i++)
        if (!grow(&p->per_thread[i], bytes)) return 0;
    return 1;
}

void *ktki_pool_thread_scratch(ktk_pool *p, int tid) { return p->per_thread[tid].buf; }
