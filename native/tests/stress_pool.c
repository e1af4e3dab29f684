/* Stress test of the pool, tasks and watch flags, built with -fsanitize=thread (or address) by
 * tests/native/test_native.py::test_pool_stress_sanitizers: three threads call ktk_forward on one pool while a task is
 * submitted/waited and then driven through go/done flags (changing the watch spin window and waking the pool on
 * the way); then pools of 2..4 threads of which one is artificially delayed (KTINJECT_TEST_DELAY: it sleeps before
 * each chunk it claims and, every other time, while holding it) run forwards and watched tasks. Every result must
 * be bit-identical to the one of a 1-thread pool (the plain path). A split task (ktk_task_split, expert deferral)
 * is driven the same way, its immediate part checked as soon as its done_top word is seen (the early raise's
 * ordering) and its deferred part at the run's done. Pools of 1..5 threads are then created and
 * destroyed with work queued. Prints "ok" and exits 0 on success.
 */
#define _GNU_SOURCE
#include <pthread.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "ktinject.h"

#ifndef KTK_TEST_BUILD   /* the library's test hooks (KTINJECT_TEST_DELAY, ...) compile only into test builds */
#error "build the native tests with -DKTK_TEST_BUILD (tests/native/test_native.py does)"
#endif

#define E 8
#define H 40
#ifdef STRESS_I   /* a wider I: gate/up chunks of several units, so a cut phase's chunks could cross its boundary */
#define I STRESS_I
#else
#define I 24
#endif
#ifdef STRESS_T   /* -DSTRESS_T=3 -DSTRESS_K=4 with KTINJECT_GEMV=1: the decode path (every expert <= 4 rows) */
#define T STRESS_T
#define K STRESS_K
#else
#define T 33
#define K 2
#endif

static ktk_pool *pool;
static ktk_experts *ex;
static float ref[T * H], ref_top[T * H], ref_rest[T * H];   /* all slots; a split's two parts (d = 1) */
static float x[T * H], w[T * K];
static int64_t ids[T * K];
static _Atomic uint32_t go, done, done_top;

static void fill(float *v, int n, unsigned seed) {
    for (int i = 0; i < n; i++) {
        seed = seed * 1103515245u + 12345u;
        v[i] = (float)((seed >> 8) & 0xffff) / 65536.0f - 0.5f;
    }
}

static int forward(ktk_pool *p, float *out) {
    return ktk_forward(p, ex, T, K, x, KTK_DTYPE_F32, ids, w, KTK_DTYPE_F32, NULL, out, KTK_DTYPE_F32);
}

static void fail(const char *what) {
    printf("FAIL %s: %s\n", what, ktk_last_error());
    exit(1);
}

static void *caller(void *arg) {
    float out[T * H];
    (void)arg;
    for (int it = 0; it < 200; it++) {
        if (forward(pool, out)) fail("ktk_forward");
        if (memcmp(out, ref, sizeof out)) fail("concurrent forward differs");
    }
    return NULL;
}

static void setup(void) {
    ktk_experts_config cfg = {E, H, I, KTK_QUANT_INT8, KTK_ACT_SILU, 0, 1.702f, 7.0f};
    static float wbuf[I * H];
    if (ktk_experts_create(&cfg, &ex)) fail("create");
    for (int e = 0; e < E; e++)
        for (int m = 0; m < 3; m++) {
            fill(wbuf, I * H, 100u + (unsigned)(e * 3 + m));
            if (ktk_experts_set(ex, e, m, wbuf, KTK_DTYPE_F32, m == KTK_MAT_DOWN ? I : H, 1)) fail("set");
        }
    fill(x, T * H, 7);
    fill(w, T * K, 9);
    for (int i = 0; i < T * K; i++) ids[i] = (i * 5 + i / K) % E;
}

/* Submit/wait, then go/done handshakes driven from this thread (as a CUDA stream would), iters of each. */
static void drive_task(ktk_pool *pool, int iters) {
    static float out[T * H];
    ktk_task *task;
    if (ktk_task_create(pool, &task)) fail("task_create");
    if (ktk_task_bind(task, ex, T, K, x, KTK_DTYPE_F32, ids, w, KTK_DTYPE_F32, NULL, out, KTK_DTYPE_F32))
        fail("bind");
    for (int it = 0; it < iters; it++) {
        if (ktk_submit(task) || ktk_wait(task)) fail("submit/wait");
        if (memcmp(out, ref, sizeof out)) fail("task result differs");
    }
    if (ktk_task_watch(task, (volatile uint32_t *)&go, (volatile uint32_t *)&done)) fail("watch");
    for (int it = 0; it < iters; it++) {
        /* the watch spin window changes and wakes race with the pool's threads (sleeping or spinning) */
        if (it % 10 == 0 && ktk_pool_set_watch_spin_us(pool, it % 20 ? 0 : 5000)) fail("set_watch_spin_us");
        if (it % 3 == 0 && ktk_pool_wake(pool)) fail("wake");
        memset(out, 0, sizeof out);
        atomic_store(&go, 1);
        while (atomic_load(&done) != 1) {
        }
        atomic_store(&done, 0);
        if (memcmp(out, ref, sizeof out)) fail("watched result differs");
    }
    if (ktk_task_unwatch(task)) fail("unwatch");
    /* both deferral parts in one run: the immediate one complete once done_top is seen, the rest at done */
    static float out2[T * H];
    if (ktk_task_split(task, 1, 0.0f, out2, (volatile uint32_t *)&done_top)) fail("split");
    if (ktk_task_watch(task, (volatile uint32_t *)&go, (volatile uint32_t *)&done)) fail("watch (split)");
    for (int it = 0; it < iters; it++) {
        memset(out, 0, sizeof out);
        memset(out2, 0, sizeof out2);
        atomic_store(&go, 1);
        while (atomic_load(&done_top) != 1) {
        }
        if (memcmp(out, ref_top, sizeof out)) fail("split: immediate part differs at done_top");
        while (atomic_load(&done) != 1) {
        }
        atomic_store(&done_top, 0);
        atomic_store(&done, 0);
        if (memcmp(out2, ref_rest, sizeof out2)) fail("split: deferred part differs");
    }
    if (ktk_task_unwatch(task)) fail("unwatch (split)");
    ktk_task_destroy(task);
}

/* ref_top / ref_rest: the two parts of d = 1 as separate tasks on a 1-thread pool */
static void part_refs(ktk_pool *p) {
    float *outs[2] = {ref_top, ref_rest};
    for (int part = 0; part < 2; part++) {
        ktk_task *t;
        if (ktk_task_create(p, &t)) fail("task_create (refs)");
        if (ktk_task_bind(t, ex, T, K, x, KTK_DTYPE_F32, ids, w, KTK_DTYPE_F32, NULL, outs[part], KTK_DTYPE_F32) ||
            ktk_task_select(t, part ? KTK_SLOTS_REST : KTK_SLOTS_TOP, 1) || ktk_submit(t) || ktk_wait(t))
            fail("part reference");
        ktk_task_destroy(t);
    }
}

/* Pools of 2..4 threads, thread 0 or the last one delayed by the test hook: forwards and a driven task. */
static void delayed(void) {
    for (int n = 2; n <= 4; n++)
        for (int last = 0; last < 2; last++) {
            char v[32];
            snprintf(v, sizeof v, "%d:300", last ? n - 1 : 0);
            setenv("KTINJECT_TEST_DELAY", v, 1);   /* read when the pool is created */
            ktk_pool *p;
            if (ktk_pool_create(n, 0, &p)) fail("pool_create (delayed)");
            unsetenv("KTINJECT_TEST_DELAY");
            float out[T * H];
            for (int it = 0; it < 10; it++) {
                if (forward(p, out)) fail("ktk_forward (delayed)");
                if (memcmp(out, ref, sizeof out)) fail("forward with a delayed thread differs");
            }
            drive_task(p, 10);
            ktk_pool_destroy(p);
        }
}

int main(void) {
    setup();
    if (ktk_pool_create(1, 0, &pool)) fail("pool_create");
    if (forward(pool, ref)) fail("reference forward");   /* the plain path: one pool thread */
    part_refs(pool);
    ktk_pool_destroy(pool);
    if (ktk_pool_create(3, 1, &pool)) fail("pool_create");
    pthread_t th[3];
    for (int i = 0; i < 3; i++) pthread_create(&th[i], NULL, caller, NULL);
    drive_task(pool, 100);
    for (int i = 0; i < 3; i++) pthread_join(th[i], NULL);
    ktk_pool_destroy(pool);
    delayed();
    for (int n = 1; n < 6; n++) {   /* destroy with a task queued (the task is destroyed first, as documented) */
        static float out[T * H];
        ktk_pool *p;
        ktk_task *t;
        if (ktk_pool_create(n, n & 1, &p) || ktk_task_create(p, &t)) fail("create");
        if (ktk_task_bind(t, ex, T, K, x, KTK_DTYPE_F32, ids, w, KTK_DTYPE_F32, NULL, out, KTK_DTYPE_F32))
            fail("bind");
        if (ktk_submit(t)) fail("submit");
        ktk_task_destroy(t);
        ktk_pool_destroy(p);
    }
    ktk_experts_destroy(ex);
    printf("ok\n");
    return 0;
}
