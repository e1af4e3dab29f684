/* Pool wake-ups: a tight ktk_submit / ktk_wait loop on 1- and 2-thread pools (a task queued while the pool's thread
 * was between its look at the queue and its sleep was once left queued forever: ktk_wait hung), and submits racing
 * the pool's destroy (each either runs or fails with KTK_ERR_STATE; none is stranded). A watchdog fails the test
 * where no iteration completes for 5 s. Prints "ok". */
#define _GNU_SOURCE
#include <pthread.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <unistd.h>

#include "ktinject.h"

#ifndef KTK_TEST_BUILD   /* the library's test hooks (KTINJECT_TEST_DELAY, ...) compile only into test builds */
#error "build the native tests with -DKTK_TEST_BUILD (tests/native/test_native.py does)"
#endif

enum { E = 4, H = 16, I = 16 };
static _Atomic long progress;
static float wb[I * H], x[H], w[1], out[H];
static int64_t ids[1] = {1};

static void *watchdog(void *arg) {
    (void)arg;
    long last = -1;
    for (int still = 0;; sleep(1)) {
        const long n = atomic_load(&progress);
        still = n == last ? still + 1 : 0;
        if (still >= 5) {
            printf("HANG: no submit / wait completed for 5 s (%ld done)\n", n);
            fflush(stdout);
            _exit(2);
        }
        last = n;
    }
    return NULL;
}

static ktk_experts *experts(void) {
    ktk_experts_config cfg = {E, H, I, KTK_QUANT_BF16, KTK_ACT_SILU, 0, 1.702f, 7.0f};
    ktk_experts *ex;
    if (ktk_experts_create(&cfg, &ex)) exit(1);
    for (int e = 0; e < E; e++)
        for (int m = 0; m < 3; m++) ktk_experts_set(ex, e, m, wb, KTK_DTYPE_F32, m == 2 ? I : H, 1);
    return ex;
}

static ktk_task *bound_task(ktk_pool *p, ktk_experts *ex) {
    ktk_task *t;
    if (ktk_task_create(p, &t) || ktk_task_bind(t, ex, 1, 1, x, KTK_DTYPE_F32, ids, w, KTK_DTYPE_F32, NULL, out,
                                                KTK_DTYPE_F32)) {
        printf("task: %s\n", ktk_last_error());
        exit(1);
    }
    return t;
}

static void *submit_until_error(void *arg) {
    ktk_task *t = arg;
    while (ktk_submit(t) == KTK_OK) {
        if (ktk_wait(t) != KTK_OK) break;
        atomic_fetch_add(&progress, 1);
    }
    return NULL;
}

int main(int argc, char **argv) {
    const long n = argc > 1 ? atol(argv[1]) : 200000;
    for (int i = 0; i < I * H; i++) wb[i] = 0.01f * (i % 7);
    for (int i = 0; i < H; i++) x[i] = 0.1f;
    w[0] = 1;
    ktk_experts *ex = experts();
    pthread_t wd;
    pthread_create(&wd, NULL, watchdog, NULL);
    for (int threads = 1; threads <= 2; threads++) {
        ktk_pool *p;
        if (ktk_pool_create(threads, 0, &p)) return 1;
        ktk_task *t = bound_task(p, ex);
        for (long i = 0; i < n; i++) {
            if (ktk_submit(t) || ktk_wait(t)) {
                printf("submit / wait: %s\n", ktk_last_error());
                return 1;
            }
            atomic_fetch_add(&progress, 1);
        }
        ktk_task_destroy(t);
        ktk_pool_destroy(p);
    }
    for (int round = 0; round < 200; round++) {   /* submits racing the destroy */
        ktk_pool *p;
        if (ktk_pool_create(2, 0, &p)) return 1;
        ktk_task *t = bound_task(p, ex);
        pthread_t th;
        pthread_create(&th, NULL, submit_until_error, t);
        usleep(200 + 37 * (round % 11));
        ktk_pool_destroy(p);
        pthread_join(th, NULL);   /* returns: its last submit ran or failed */
        ktk_task_destroy(t);
        atomic_fetch_add(&progress, 1);
    }
    ktk_experts_destroy(ex);
    printf("ok\n");
    return 0;
}
