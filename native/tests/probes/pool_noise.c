/* Probe (not a test): one-token decode through L int4 layers of Qwen3-30B-A3B shapes (H 2048, I 768, top-8 of 64
 * experts: 151 MB, every layer other experts than the last), quiet and with N background processes copying 1 GB
 * arrays ("noise"), for one or more builds of the native library (shared objects, e.g. before and after a
 * change) in one process: rounds of [each build x (quiet, noise)], the noise processes stopped (SIGSTOP) for quiet
 * turns, so a drifting host load falls on all variants alike. Usage (pool_noise.sh builds the objects):
 *   pool_noise [-t THREADS] [-p PIN] [-m watch|inline] [-n NOISE] [-r ROUNDS] [-k TOKENS] [-l LAYERS] [-g GAP_US]
 *              [-f] LIB.so...
 * watch: L watched tasks raised in turn by a driver thread that naps GAP_US between layers (the GPU's share of a
 * layer) and polls the done flags every ~2 us; with -f it asks for SCHED_FIFO, so that like a GPU it reacts at once
 * without holding a core (said on the first line; on a small VM it rather starved the pool). inline: ktk_forward per
 * layer from the main thread (bench decode's "CPU experts alone"). Prints ms per token, median of the rounds'
 * medians, for each build quiet and with noise, and every round's figure with the time the pool's threads waited
 * runnable without a core (schedstat) and the cores other processes (not the noise) kept busy meanwhile
 * (/proc/stat), to tell a quiet turn that was not quiet.
 */
#define _GNU_SOURCE
#include <dirent.h>
#include <dlfcn.h>
#include <pthread.h>
#include <sched.h>
#include <signal.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/prctl.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#include "ktinject.h"

#define H 2048
#define I 768
#define K 8
#define E 64
#define LMAX 64
#define RMAX 64

typedef struct {   /* one build of the library */
    const char *path;
    int (*experts_create)(const ktk_experts_config *, ktk_experts **);
    int (*experts_set)(ktk_experts *, int, int, const void *, int, int64_t, int64_t);
    int (*pool_create)(int, int, ktk_pool **);
    int (*pool_wake)(ktk_pool *);
    int (*task_create)(ktk_pool *, ktk_task **);
    int (*task_bind)(ktk_task *, ktk_experts *, int, int, const void *, int, const int64_t *, const void *, int,
                     const uint8_t *, void *, int);
    int (*task_watch)(ktk_task *, volatile uint32_t *, volatile uint32_t *);
    int (*forward)(ktk_pool *, ktk_experts *, int, int, const void *, int, const int64_t *, const void *, int,
                   const uint8_t *, void *, int);
    ktk_experts *ex;
    ktk_pool *pool;
    ktk_task *t[LMAX];
    _Atomic uint32_t go[LMAX], done[LMAX];
    double ms[2][RMAX];   /* [quiet, noise][round] */
    double foreign[2][RMAX];   /* cores busy with other processes meanwhile */
    double wait[2][RMAX];      /* ms per token the pool's threads waited runnable, in all */
    int tids[256], ntids;      /* the pool's threads */
} lib;

static int L = 48, gap = 100, watch = 1;
static float x[H], out[LMAX][H], wts[K];
static int64_t ids[LMAX][K];

static double now(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return ts.tv_sec + ts.tv_nsec * 1e-9;
}

static void nap_us(long us) {
    struct timespec ts = {0, us * 1000};
    nanosleep(&ts, NULL);
}

static int cmp(const void *a, const void *b) {
    double u = *(const double *)a, v = *(const double *)b;
    return u < v ? -1 : u > v;
}

static double median(double *v, int n) {
    qsort(v, (size_t)n, sizeof *v, cmp);
    return n % 2 ? v[n / 2] : 0.5 * (v[n / 2 - 1] + v[n / 2]);
}

/* CPU time (clock ticks) of the whole host (busy: all but idle and iowait) and of process pid (0: ourselves). */
static long long host_busy(void) {
    long long v[10] = {0}, busy = 0;
    FILE *f = fopen("/proc/stat", "r");
    if (!f) return 0;
    if (fscanf(f, "cpu %lld %lld %lld %lld %lld %lld %lld %lld", &v[0], &v[1], &v[2], &v[3], &v[4], &v[5], &v[6],
               &v[7]) == 8)
        busy = v[0] + v[1] + v[2] + v[5] + v[6] + v[7];
    fclose(f);
    return busy;
}

static long long proc_ticks(int pid) {
    char path[64], buf[1024];
    snprintf(path, sizeof path, pid ? "/proc/%d/stat" : "/proc/self/stat", pid);
    FILE *f = fopen(path, "r");
    if (!f) return 0;
    size_t n = fread(buf, 1, sizeof buf - 1, f);
    fclose(f);
    buf[n] = 0;
    char *s = strrchr(buf, ')');
    long long ut = 0, st = 0;
    if (s && sscanf(s + 2, "%*c %*d %*d %*d %*d %*d %*u %*u %*u %*u %*u %lld %lld", &ut, &st) == 2) return ut + st;
    return 0;
}

/* ns thread tid of this process waited runnable (schedstat), 0 if unknown. */
static long long run_delay(int tid) {
    char path[64];
    snprintf(path, sizeof path, "/proc/self/task/%d/schedstat", tid);
    FILE *f = fopen(path, "r");
    long long run = 0, wait = 0;
    if (f) {
        if (fscanf(f, "%lld %lld", &run, &wait) != 2) wait = 0;
        fclose(f);
    }
    return wait;
}

/* Thread ids of this process (up to max). */
static int list_tids(int *tids, int max) {
    int n = 0;
    DIR *d = opendir("/proc/self/task");
    struct dirent *e;
    while (d && (e = readdir(d)) && n < max)
        if (e->d_name[0] != '.') tids[n++] = atoi(e->d_name);
    if (d) closedir(d);
    return n;
}

static void noise_child(void) {
    size_t n = (size_t)1 << 30;
    char *a = malloc(n), *b = malloc(n);
    memset(a, 1, n);
    memset(b, 2, n);
    for (;;) {
        memcpy(b, a, n);
        memcpy(a, b, n);
    }
}

static void *sym(void *h, const char *name) {
    void *f = dlsym(h, name);
    if (!f) { printf("%s: %s\n", name, dlerror()); exit(1); }
    return f;
}

static void load(lib *b, int nt, int pin) {
    void *h = dlopen(b->path, RTLD_NOW | RTLD_LOCAL);
    if (!h) { printf("dlopen %s: %s\n", b->path, dlerror()); exit(1); }
    b->experts_create = sym(h, "ktk_experts_create");
    b->experts_set = sym(h, "ktk_experts_set");
    b->pool_create = sym(h, "ktk_pool_create");
    b->pool_wake = sym(h, "ktk_pool_wake");
    b->task_create = sym(h, "ktk_task_create");
    b->task_bind = sym(h, "ktk_task_bind");
    b->task_watch = sym(h, "ktk_task_watch");
    b->forward = sym(h, "ktk_forward");
    ktk_experts_config cfg = {E, H, I, KTK_QUANT_INT4, KTK_ACT_SILU, 0, 1.702f, 7.0f, 64};
    static float w[H * I];
    unsigned s = 1;
    for (int i = 0; i < H * I; i++) {
        s = s * 1103515245u + 12345u;
        w[i] = ((float)((s >> 8) & 0xffff) / 65536.0f - 0.5f) * 0.05f;
    }
    int before[256], nb = list_tids(before, 256), now_[256], nn;
    if (b->experts_create(&cfg, &b->ex) || b->pool_create(nt, pin, &b->pool)) exit(1);
    nn = list_tids(now_, 256);
    for (int i = 0; i < nn; i++) {   /* the threads the pool started */
        int old = 0;
        for (int j = 0; j < nb; j++) old |= now_[i] == before[j];
        if (!old && b->ntids < 256) b->tids[b->ntids++] = now_[i];
    }
    for (int e = 0; e < E; e++)
        for (int m = 0; m < 3; m++)
            if (b->experts_set(b->ex, e, m, w, KTK_DTYPE_F32, m == KTK_MAT_DOWN ? I : H, 1)) exit(1);
    for (int l = 0; l < L; l++) {
        if (b->task_create(b->pool, &b->t[l]) ||
            b->task_bind(b->t[l], b->ex, 1, K, x, KTK_DTYPE_F32, ids[l], wts, KTK_DTYPE_F32, NULL, out[l],
                         KTK_DTYPE_F32))
            exit(1);
        if (watch && b->task_watch(b->t[l], (volatile uint32_t *)&b->go[l], (volatile uint32_t *)&b->done[l]))
            exit(1);
    }
}

/* One token: L layers; ms. */
static double token(lib *b) {
    if (watch) b->pool_wake(b->pool);
    double t0 = now();
    for (int l = 0; l < L; l++) {
        if (!watch) {
            b->forward(b->pool, b->ex, 1, K, x, KTK_DTYPE_F32, ids[l], wts, KTK_DTYPE_F32, NULL, out[l],
                       KTK_DTYPE_F32);
            continue;
        }
        if (gap) nap_us(gap);
        atomic_store(&b->go[l], 1);
        while (atomic_load(&b->done[l]) != 1) nap_us(2);
        atomic_store(&b->done[l], 0);
    }
    double ms = (now() - t0) * 1e3;
    if (watch) nap_us(1000);   /* the host between steps */
    return ms;
}

int main(int argc, char **argv) {
    int nt = 2, pin = 1, noise = 1, rounds = 5, tokens = 10, want_fifo = 0, opt;
    while ((opt = getopt(argc, argv, "t:p:m:n:r:k:l:g:f")) != -1) {
        switch (opt) {
        case 't': nt = atoi(optarg); break;
        case 'p': pin = atoi(optarg); break;
        case 'm': watch = !strcmp(optarg, "watch"); break;
        case 'n': noise = atoi(optarg); break;
        case 'r': rounds = atoi(optarg) < RMAX ? atoi(optarg) : RMAX; break;
        case 'k': tokens = atoi(optarg); break;
        case 'l': L = atoi(optarg) < LMAX ? atoi(optarg) : LMAX; break;
        case 'g': gap = atoi(optarg); break;
        case 'f': want_fifo = 1; break;
        default: return 2;
        }
    }
    int nlib = argc - optind;
    if (nlib < 1) { printf("usage: see the comment at the top of pool_noise.c\n"); return 2; }
    setvbuf(stdout, NULL, _IOLBF, 0);
    prctl(PR_SET_TIMERSLACK, 1000UL);
    for (int i = 0; i < H; i++) x[i] = (float)((i * 37) % 101) / 101.0f - 0.5f;
    for (int k = 0; k < K; k++) wts[k] = 1.0f / K;
    for (int l = 0; l < L; l++)
        for (int k = 0; k < K; k++) ids[l][k] = (l % (E / K)) * K + k;
    lib *libs = calloc((size_t)nlib, sizeof *libs);
    for (int i = 0; i < nlib; i++) {
        libs[i].path = argv[optind + i];
        load(&libs[i], nt, pin);
    }
    pid_t kids[64];
    for (int i = 0; i < noise && i < 64; i++) {
        if ((kids[i] = fork()) == 0) noise_child();
        kill(kids[i], SIGSTOP);
    }
    struct sched_param sp = {.sched_priority = 1};   /* after the pools and the noise: they must not inherit it */
    int fifo = watch && want_fifo && pthread_setschedparam(pthread_self(), SCHED_FIFO, &sp) == 0;
    printf("threads %d pin %d %s%s, noise %d, %d layers, gap %d us, %d rounds x %d tokens\n", nt, pin,
           watch ? "watch" : "inline", watch ? (fifo ? " (driver SCHED_FIFO)" : " (driver SCHED_OTHER)") : "", noise,
           L, gap, rounds, tokens);
    double *v = malloc(sizeof(double) * (size_t)tokens);
    for (int r = 0; r < rounds; r++)
        for (int j = 0; j < 2 * nlib; j++) {
            const int noisy = (j + r) & 1, li = (j / 2 + r) % nlib;
            for (int i = 0; i < noise; i++) kill(kids[i], noisy ? SIGCONT : SIGSTOP);
            if (noisy) nap_us(200000);   /* the copies are running */
            token(&libs[li]);            /* warm-up */
            long long b0 = host_busy(), o0 = proc_ticks(0);
            for (int i = 0; i < noise; i++) o0 += proc_ticks(kids[i]);
            long long w0 = 0, w1 = 0;
            for (int i = 0; i < libs[li].ntids; i++) w0 += run_delay(libs[li].tids[i]);
            double t0 = now();
            for (int k = 0; k < tokens; k++) v[k] = token(&libs[li]);
            for (int i = 0; i < libs[li].ntids; i++) w1 += run_delay(libs[li].tids[i]);
            libs[li].wait[noisy][r] = (w1 - w0) / 1e6 / tokens;
            long long b1 = host_busy(), o1 = proc_ticks(0);
            for (int i = 0; i < noise; i++) o1 += proc_ticks(kids[i]);
            libs[li].foreign[noisy][r] = (double)((b1 - b0) - (o1 - o0)) / sysconf(_SC_CLK_TCK) / (now() - t0);
            libs[li].ms[noisy][r] = median(v, tokens);
        }
    for (int i = 0; i < noise; i++) kill(kids[i], SIGKILL);
    for (int i = 0; i < noise; i++) waitpid(kids[i], NULL, 0);
    for (int i = 0; i < nlib; i++) {
        double q[RMAX], n[RMAX];
        memcpy(q, libs[i].ms[0], sizeof q);
        memcpy(n, libs[i].ms[1], sizeof n);
        double mq = median(q, rounds), mn = median(n, rounds);
        printf("%s: quiet %.2f ms/token, noise %.2f (%.0f%% of quiet speed); rounds quiet", libs[i].path, mq, mn,
               100 * mq / mn);
        for (int r = 0; r < rounds; r++) printf(" %.2f", libs[i].ms[0][r]);
        printf(", noise");
        for (int r = 0; r < rounds; r++) printf(" %.2f", libs[i].ms[1][r]);
        printf("; pool threads waited runnable (ms/token, all threads), quiet");
        for (int r = 0; r < rounds; r++) printf(" %.1f", libs[i].wait[0][r]);
        printf(", noise");
        for (int r = 0; r < rounds; r++) printf(" %.1f", libs[i].wait[1][r]);
        printf("; other processes' cores, quiet");
        for (int r = 0; r < rounds; r++) printf(" %.1f", libs[i].foreign[0][r]);
        printf(", noise");
        for (int r = 0; r < rounds; r++) printf(" %.1f", libs[i].foreign[1][r]);
        printf("\n");
    }
    return 0;   /* pools and tasks are left to exit */
}
