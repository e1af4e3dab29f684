/* Internal to the runtime (pool.c: threads, phases, idle; job.c: the queue, taking and ending jobs, inline runs;
 * watch.c: the watch list and its hot window; event.c: the events; profile.c: the profile's sums; task.c). */
#ifndef KTKI_POOL_H
#define KTKI_POOL_H
#include <pthread.h>

#include "../internal.h"

#define KTKI_WATCH_SPIN_NS 20000000LL    /* thread 0 spins on go flags this long after the last watched run */
#define KTKI_WATCH_NAP_NS 50000L         /* then naps this long between polls */
#define KTKI_WATCH_SPIN_US_DEFAULT 1000  /* idle threads spin this long after watched activity */
#define KTKI_WATCH_SPIN_US_MAX 10000000LL

typedef struct {
    void *buf;
    size_t size;
    _Atomic uint32_t scan;   /* odd while this thread reads the watch list (watch.c) */
} __attribute__((aligned(64))) ktki_slot;

typedef struct {
    int n;
    ktk_task *t[];
} ktki_wlist;

struct ktk_pool {
    int n, pin, cpus;   /* threads, pinned, CPUs this process may run on */
    int64_t spin_ns;
#ifdef KTK_TEST_BUILD
    int delay_tid, delay_count[2];   /* test hook (KTINJECT_TEST_DELAY, pool.c) */
    int64_t delay_us;
#endif
    _Atomic int64_t watch_spin_ns;  /* idle threads spin (no futex sleep) this long after watched activity */
    _Atomic int64_t hot_until __attribute__((aligned(64)));  /* now_ns() deadline of that spinning; 0: none */
    pthread_t *threads;
    int *started;
    /* the open phase: claim word (generation | window size | next unclaimed) and items done, own cache lines */
    _Atomic uint64_t claim __attribute__((aligned(64)));
    _Atomic int64_t ndone __attribute__((aligned(64)));
    _Atomic(ktki_item_fn) item __attribute__((aligned(64)));
    _Atomic(ktki_range_fn) range;
    _Atomic(void *) ctx;
    _Atomic int64_t base, total;   /* window start, items of the phase */
    _Atomic int maxc, guided, minc;
    _Atomic int64_t cut;           /* the phase's cut (ktki_phase), 0: none */
    /* the job: claimed by a CAS of running 0 -> 1; job, job_watched written by the claimer before it publishes */
    _Atomic int running __attribute__((aligned(64)));   /* job.c: ktki_job_claim / release */
    ktk_task *job;
    int job_watched;
    _Atomic int sit_out;   /* the pool thread that takes no chunks of this job (pool.c), or -1 */
    _Atomic(ktk_task *) watch_running;
    _Atomic int stop;
    _Atomic int refs;   /* the owner (ktk_pool_destroy) + one per ktk_task_create: memory freed at 0 */
    int dead;           /* under mu: destroyed (threads joined, watch list freed); tasks left must not use it */
    _Atomic int ext;   /* thread id n is in use by a caller of an inline run (job.c) */
    ktki_event work __attribute__((aligned(64)));  /* bumped on a new phase, task, watch and stop */
    ktki_event done_ev;                             /* bumped after a job ends */
    /* queue and watch list (mu serializes writers; the watch list is read without it) */
    pthread_mutex_t mu;
    ktk_task *head, *tail;
    _Atomic int queued;
    _Atomic(ktki_wlist *) watch;
    _Atomic int watch_next;            /* where the next scan starts (round robin) */
    _Atomic int64_t last_watched;      /* now_ns() at the end of the last watched run */
    /* profile (ktk_pool_set_profile): job and phase sums; per-thread chunk sums [n + 1][16] (own cache lines) */
    _Atomic int prof;
    _Atomic int prof_job;              /* the running job is profiled (prof when it started: a toggle takes effect
                                        * at the next job, so no sum mixes a job's clock with another's) */
    _Atomic int prof_cur;              /* index of the open phase in its job */
    int prof_phase;                    /* parallel phases of the running job so far (its writer runs the job) */
    int64_t prof_job_t0, prof_phase_t0;
    _Atomic int64_t prof_sum[KTK_PROFILE_LEN];
    _Atomic int64_t *prof_thr;
    /* scratch */
    ktki_slot shared[KTKI_SCR_SLOTS];
    ktki_slot *per_thread;             /* [n + 1] */
};

/* pool.c */
void ktki_pool_start_job(ktk_pool *p, ktk_task *t, int watched, int tid); /* running claimed by the caller */
int ktki_pool_run_chunk(ktk_pool *p, int tid);   /* 1 if it claimed and ran a chunk of the open phase */
int ktki_pool_items_left(ktk_pool *p, int tid);   /* chunks this thread may claim are left */
/* job.c */
int ktki_job_claim(ktk_pool *p);            /* 1 if this thread set running 0 -> 1 (the pool is its to start a job) */
void ktki_job_release(ktk_pool *p);         /* running 0; threads woken where a task was queued meanwhile */
void ktki_job_end(ktk_pool *p);             /* the running job's end (its last step returned) */
int ktki_job_take(ktk_pool *p, int tid);   /* 1 if it took a queued task or a raised go flag and ran steps */
/* watch.c */
void ktki_watch_mark_hot(ktk_pool *p);
int ktki_watch_go_raised(ktk_pool *p, int tid);   /* 1 if the pool is free and a watched go flag is raised */
ktk_task *ktki_watch_take(ktk_pool *p, int tid);  /* a raised one taken (running claimed, go reset), or NULL */
/* Outside the hot window, while tasks are watched: 1 after polling the go flags (thread 0) until something happened;
 * 0 if this thread should sleep (another thread, or nothing watched). */
int ktki_watch_nap(ktk_pool *p, int tid, uint32_t seen);
/* profile.c */
#define KTKI_PROF_SLOT(i) (2 + 4 * ((i) < KTK_PROFILE_PHASES ? (i) : KTK_PROFILE_PHASES - 1))
void ktki_profile_phase_open(ktk_pool *p);        /* a parallel phase of the profiled job opens (its publisher) */
void ktki_profile_phase_close(ktk_pool *p);       /* its last chunk ended on this thread */
void ktki_profile_job_end(ktk_pool *p);   /* the job's time into the profile, where profiled */
void ktki_profile_top(ktk_pool *p);       /* a split task's done_top raised now, where profiled */
#endif
