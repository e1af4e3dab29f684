/* The read loop of ktinject.bench.memory (the CPU's read bandwidth beside the decode figures): compiled with the
 * system C compiler when a bench first measures, loaded with ctypes (memory.py: _compile, and the variants' meaning).
 * Not part of the native library: nothing here runs outside the benchmarks. */
#define _GNU_SOURCE
#include <pthread.h>
#include <sched.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <time.h>
#include <unistd.h>
#include <immintrin.h>

#define STEP 256   /* bytes per stream per step: 4 cache lines */
#define PF4(b, d) do { if (d) { __builtin_prefetch((b) + (d)); __builtin_prefetch((b) + (d) + 64); \
                                __builtin_prefetch((b) + (d) + 128); __builtin_prefetch((b) + (d) + 192); } } while (0)

__attribute__((target("avx512f"))) static uint64_t read512(const char *p, size_t per, int S, int pf) {
    __m512i a0 = _mm512_setzero_si512(), a1 = a0, a2 = a0, a3 = a0;
    for (size_t i = 0; i < per; i += STEP)
        for (int q = 0; q < S; q++) {
            const char *b = p + q * per + i;
            PF4(b, pf);
            a0 = _mm512_xor_si512(a0, _mm512_load_si512((const void *)b));
            a1 = _mm512_xor_si512(a1, _mm512_load_si512((const void *)(b + 64)));
            a2 = _mm512_xor_si512(a2, _mm512_load_si512((const void *)(b + 128)));
            a3 = _mm512_xor_si512(a3, _mm512_load_si512((const void *)(b + 192)));
        }
    a0 = _mm512_xor_si512(_mm512_xor_si512(a0, a1), _mm512_xor_si512(a2, a3));
    return (uint64_t)_mm512_reduce_add_epi64(a0);
}

__attribute__((target("avx2"))) static uint64_t read256(const char *p, size_t per, int S, int pf) {
    __m256i a0 = _mm256_setzero_si256(), a1 = a0, a2 = a0, a3 = a0;
    for (size_t i = 0; i < per; i += STEP)
        for (int q = 0; q < S; q++) {
            const char *b = p + q * per + i;
            PF4(b, pf);
            for (int c = 0; c < STEP; c += 128) {
                a0 = _mm256_xor_si256(a0, _mm256_load_si256((const __m256i *)(b + c)));
                a1 = _mm256_xor_si256(a1, _mm256_load_si256((const __m256i *)(b + c + 32)));
                a2 = _mm256_xor_si256(a2, _mm256_load_si256((const __m256i *)(b + c + 64)));
                a3 = _mm256_xor_si256(a3, _mm256_load_si256((const __m256i *)(b + c + 96)));
            }
        }
    a0 = _mm256_xor_si256(_mm256_xor_si256(a0, a1), _mm256_xor_si256(a2, a3));
    return (uint64_t)_mm256_extract_epi64(a0, 0) ^ (uint64_t)_mm256_extract_epi64(a0, 3);
}

static uint64_t read64(const char *p, size_t per, int S, int pf) {
    uint64_t a[8] = {0};
    for (size_t i = 0; i < per; i += STEP)
        for (int q = 0; q < S; q++) {
            const uint64_t *b = (const uint64_t *)(p + q * per + i);
            PF4((const char *)b, pf);
            for (int k = 0; k < STEP / 8; k++) a[k & 7] ^= b[k];
        }
    return a[0] ^ a[1] ^ a[2] ^ a[3] ^ a[4] ^ a[5] ^ a[6] ^ a[7];
}

int ktb_loads(void) {   /* 2 = AVX-512, 1 = AVX2, 0 = 64-bit words */
    __builtin_cpu_init();
    return __builtin_cpu_supports("avx512f") ? 2 : __builtin_cpu_supports("avx2") ? 1 : 0;
}

typedef struct {
    char *p; size_t n; int streams, pf, cpu, loads, fill; pthread_barrier_t *bar; uint64_t r;
    char *base; size_t total, chunk; int tid, nth;   /* chunk > 0: chunks tid, tid + nth, ... of base[0, total) */
} job;

static uint64_t read_any(const job *j, const char *p, size_t n) {
    size_t per = n / (size_t)j->streams / STEP * STEP;
    uint64_t r = j->loads == 2 ? read512(p, per, j->streams, j->pf)
               : j->loads == 1 ? read256(p, per, j->streams, j->pf) : read64(p, per, j->streams, j->pf);
    for (size_t i = per * (size_t)j->streams; i < n; i++) r ^= (unsigned char)p[i];
    return r;
}

static void *run(void *arg) {
    job *j = arg;
    if (j->cpu >= 0) {
        cpu_set_t set;
        CPU_ZERO(&set);
        CPU_SET(j->cpu, &set);
        (void)pthread_setaffinity_np(pthread_self(), sizeof set, &set);
    }
    pthread_barrier_wait(j->bar);
    if (j->fill) {   /* distinct words: no two pages alike (nothing for KSM/dedup to merge) */
        uint64_t *w = (uint64_t *)j->p, x = (uint64_t)(uintptr_t)j->p;
        for (size_t i = 0; i < j->n / 8; i++) w[i] = (x + i) * 0x9E3779B97F4A7C15ull;
        return NULL;
    }
    uint64_t r = 0;
    if (j->chunk)
        for (size_t c = (size_t)j->tid * j->chunk; c + j->chunk <= j->total; c += (size_t)j->nth * j->chunk)
            r ^= read_any(j, j->base + c, j->chunk);
    else
        r = read_any(j, j->p, j->n);
    j->r = r;
    return NULL;
}

/* Runs `threads` threads (thread i pinned to cpus[i] when cpus[i] >= 0) over 4 KB-aligned slices of buf (chunk 0)
 * or over chunks of `chunk` bytes dealt round robin (the whole chunks of buf: all threads read near each other, as
 * the decode kernels do), all started together; returns the seconds from the start barrier to the last join
 * (thread creation excluded). */
double ktb_run(char *buf, size_t bytes, int threads, const int *cpus, int streams, int pf, int loads, int fill,
               size_t chunk, uint64_t *result) {
    pthread_t th[1024];
    job jobs[1024];
    pthread_barrier_t bar;
    struct timespec t0, t1;
    if (threads < 1) threads = 1;
    if (threads > 1024) threads = 1024;
    if (streams < 1) streams = 1;
    pthread_barrier_init(&bar, NULL, (unsigned)threads + 1);
    size_t pages = bytes / 4096;
    for (int i = 0; i < threads; i++) {
        size_t a = pages * (size_t)i / (size_t)threads * 4096, b = pages * (size_t)(i + 1) / (size_t)threads * 4096;
        if (i == threads - 1) b = bytes;
        jobs[i] = (job){buf + a, b - a, streams, pf, cpus ? cpus[i] : -1, loads, fill, &bar, 0,
                        buf, bytes, fill ? 0 : chunk, i, threads};
        pthread_create(&th[i], NULL, run, &jobs[i]);
    }
    pthread_barrier_wait(&bar);
    clock_gettime(CLOCK_MONOTONIC, &t0);
    uint64_t r = 0;
    for (int i = 0; i < threads; i++) { pthread_join(th[i], NULL); r ^= jobs[i].r; }
    clock_gettime(CLOCK_MONOTONIC, &t1);
    pthread_barrier_destroy(&bar);
    if (result) *result = r;
    return (double)(t1.tv_sec - t0.tv_sec) + 1e-9 * (double)(t1.tv_nsec - t0.tv_nsec);
}

char *ktb_alloc(size_t bytes) {   /* 2 MB aligned, transparent huge pages asked for; not touched */
    void *p = NULL;
    if (posix_memalign(&p, 1 << 21, bytes)) return NULL;
#ifdef MADV_HUGEPAGE
    (void)madvise(p, bytes, MADV_HUGEPAGE);
#endif
    return p;
}

void ktb_free(char *p) { free(p); }

long ktb_l3(void) {   /* glibc reads CPUID here, which a VM's sysfs may understate; 0 if unknown */
#ifdef _SC_LEVEL3_CACHE_SIZE
    long v = sysconf(_SC_LEVEL3_CACHE_SIZE);
    return v > 0 ? v : 0;
#else
    return 0;
#endif
}
