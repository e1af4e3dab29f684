/* The pool's profile (ktk_pool_set_profile, ktk_pool_profile): sums of jobs, their parallel phases and the
 * threads' chunks (pool.c calls in where a job is profiled: pool.h's prof fields), and the distinct experts of
 * decode steps (moe/forward.c). For measurements; off, pool.c reads one flag per job and per chunk. */
#include "pool.h"

/* A new parallel phase of the running job opens now (its publisher runs the job: no other writer). */
void ktki_profile_phase_open(ktk_pool *p) {
    p->prof_phase_t0 = ktki_event_now_ns();
    if (p->prof_phase == 0)   /* the job's head: its start (go seen, or submitted) to its first parallel phase */
        atomic_fetch_add_explicit(&p->prof_sum[KTK_PROFILE_HEAD], p->prof_phase_t0 - p->prof_job_t0,
                                  memory_order_relaxed);
    atomic_store_explicit(&p->prof_cur, p->prof_phase++, memory_order_relaxed);   /* published with the phase */
}

/* The open phase's last chunk ended on this thread. */
void ktki_profile_phase_close(ktk_pool *p) {
    const int s = KTKI_PROF_SLOT(atomic_load_explicit(&p->prof_cur, memory_order_relaxed));
    atomic_fetch_add_explicit(&p->prof_sum[s], 1, memory_order_relaxed);
    atomic_fetch_add_explicit(&p->prof_sum[s + 1], ktki_event_now_ns() - p->prof_phase_t0, memory_order_relaxed);
}

int ktki_profile_set(ktk_pool *p, int on) {
    if (!p->prof_thr) return 0;
    atomic_store(&p->prof, on != 0);
    return 1;
}

int ktki_profile_read(ktk_pool *p, int64_t *out, int n) {
    int64_t sum[KTK_PROFILE_LEN];
    for (int i = 0; i < KTK_PROFILE_LEN; i++) sum[i] = atomic_exchange(&p->prof_sum[i], 0);
    _Atomic int64_t *thr = p->prof_thr;
    for (int t = 0; thr && t <= p->n; t++)
        for (int i = 0; i < KTK_PROFILE_PHASES; i++) {
            sum[2 + 4 * i + 2] += atomic_exchange(&thr[t * 16 + 2 * i], 0);
            sum[2 + 4 * i + 3] += atomic_exchange(&thr[t * 16 + 2 * i + 1], 0);
        }
    if (n > KTK_PROFILE_LEN) n = KTK_PROFILE_LEN;
    for (int i = 0; i < n; i++) out[i] = sum[i];
    return n;
}

void ktki_profile_decode(ktk_pool *p, int experts, int tokens) {
    if (!atomic_load_explicit(&p->prof_job, memory_order_relaxed) || tokens > KTK_PROFILE_DECODE_T) return;
    atomic_fetch_add_explicit(&p->prof_sum[KTK_PROFILE_DECODE], 1, memory_order_relaxed);
    atomic_fetch_add_explicit(&p->prof_sum[KTK_PROFILE_DECODE + 1], experts, memory_order_relaxed);
    atomic_fetch_add_explicit(&p->prof_sum[KTK_PROFILE_DECODE + 2], tokens, memory_order_relaxed);
}

/* A split task's immediate part raised its done word (task.c), in the running job. */
void ktki_profile_top(ktk_pool *p) {
    if (!atomic_load_explicit(&p->prof_job, memory_order_relaxed)) return;
    atomic_fetch_add_explicit(&p->prof_sum[KTK_PROFILE_TOP], 1, memory_order_relaxed);
    atomic_fetch_add_explicit(&p->prof_sum[KTK_PROFILE_TOP + 1], ktki_event_now_ns() - p->prof_job_t0, memory_order_relaxed);
}

void ktki_profile_job_end(ktk_pool *p) {
    if (!atomic_load_explicit(&p->prof_job, memory_order_relaxed)) return;
    atomic_fetch_add_explicit(&p->prof_sum[0], 1, memory_order_relaxed);
    atomic_fetch_add_explicit(&p->prof_sum[1], ktki_event_now_ns() - p->prof_job_t0, memory_order_relaxed);
}
