/* Events: a 32-bit sequence word that waiters watch. A waiter spins on it for a while (a wake-up within the spin
 * costs no system call), then sleeps on a futex; a signal bumps the word and wakes sleepers only where there are
 * any. The pool's work and done events are of this kind (pool.h); their spins, and the profile, read the clock here.
 */
#define _GNU_SOURCE
#include <limits.h>
#include <linux/futex.h>
#include <sys/syscall.h>
#include <time.h>
#include <unistd.h>

#include "pool.h"

int64_t ktki_event_now_ns(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (int64_t)ts.tv_sec * 1000000000LL + ts.tv_nsec;
}

void ktki_event_wait(ktki_event *ev, uint32_t seen, int64_t spin_ns) {
    int64_t deadline = 0;
    for (uint32_t i = 0; atomic_load_explicit(&ev->seq, memory_order_acquire) == seen; i++) {
        ktki_cpu_relax();
        if ((i & 63) != 63) continue;
        int64_t t = ktki_event_now_ns();
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
