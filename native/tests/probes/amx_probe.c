/* AMX throughput probe: which tile-load patterns keep tdpbf16ps busy on this machine. Not a test; run on a CPU
 * with AMX:  cc -O2 -pthread native/tests/probes/amx_probe.c -o /tmp/amx_probe && /tmp/amx_probe [seconds]
 * Every pattern issues 4 tdpbf16ps per iteration into 4 C tiles (2 x 2); they differ in what is loaded when and
 * from where. Threads are pinned to CPUs 0..n-1 (or to one CPU of each core first with "cores"). */
#define _GNU_SOURCE
#include <pthread.h>
#include <sched.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>
#include <sys/syscall.h>

typedef struct __attribute__((aligned(64))) {
    unsigned char p, s, r[14];
    unsigned short c[16];
    unsigned char rows[16];
} cfg_t;

#define TL(t, p, s) __asm__ volatile("tileloadd (%0,%1,1), %%tmm" #t ::"r"((const void *)(p)), "r"((long)(s)) : "memory")
#define TD(c, a, b) __asm__ volatile("tdpbf16ps %%tmm" #b ", %%tmm" #a ", %%tmm" #c ::)
#define TDI(c, a, b) __asm__ volatile("tdpbssd %%tmm" #b ", %%tmm" #a ", %%tmm" #c ::)

static double now(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return t.tv_sec + t.tv_nsec * 1e-9;
}

enum { REG, L4_THEN_4TDP, INTERLEAVED, PIPELINED, TWO_LOADS, ONE_LOAD, B_L2_256K, B_L1_32K, AB_L2_1M, A_STRIDED,
       B_L2_PF, INT8_INTERLEAVED, INT8_REG, GROUP2, L4_COLFIRST, DB_1x2, DB_1x2_L2, L4_L2, DB_1x3, NPAT };
static const char *names[NPAT] = {"reg-only", "4 loads then 4 tdp (L1)", "interleaved (L1)", "pipelined (L1)",
                                  "2 loads/4 tdp (L1)", "1 load/4 tdp (L1)", "A L1, B stream 256K (L2)",
                                  "A L1, B stream 32K", "A,B stream 1M (L2)", "A rows 4K apart (L1 sets)",
                                  "A L1, B 256K + prefetcht0", "int8 interleaved (L1)", "int8 reg-only",
                                  "TL A0 B0 B1; TD TD; TL A1; TD TD", "4 loads, tdp column-first",
                                  "1x2 C, double-buffered A,B", "1x2 dbuf, B stream 256K", "4 loads then 4, B 256K",
                                  "1x3 C, A double-buffered"};

static int pattern;
static long iters;
static char *bufs[128];
static int cpus[128];

static void *run(void *arg) {
    long id = (long)arg;
    cpu_set_t set;
    CPU_ZERO(&set);
    CPU_SET(cpus[id], &set);
    pthread_setaffinity_np(pthread_self(), sizeof set, &set);
    cfg_t c;
    memset(&c, 0, sizeof c);
    c.p = 1;
    for (int i = 0; i < 8; i++) c.c[i] = 64, c.rows[i] = 16;
    __asm__ volatile("ldtilecfg %0" ::"m"(c));
    char *b = bufs[id];            /* 2 MB: [0, 64K) A area, [1M, 2M) B area */
    char *A = b, *B = b + (1 << 20);
    TL(4, A, 64); TL(5, A + 1024, 64); TL(6, B, 64); TL(7, B + 1024, 64);
    for (long i = 0; i < iters; i++) {
        switch (pattern) {
        case REG: TD(0, 4, 6); TD(1, 4, 7); TD(2, 5, 6); TD(3, 5, 7); break;
        case INT8_REG: TDI(0, 4, 6); TDI(1, 4, 7); TDI(2, 5, 6); TDI(3, 5, 7); break;
        case L4_THEN_4TDP:
            TL(4, A, 64); TL(5, A + 1024, 64); TL(6, B, 64); TL(7, B + 1024, 64);
            TD(0, 4, 6); TD(1, 4, 7); TD(2, 5, 6); TD(3, 5, 7); break;
        case INTERLEAVED: case B_L2_256K: case B_L1_32K: case AB_L2_1M: case A_STRIDED: case B_L2_PF: {
            long bo = 0, ao = 0, as = 64, at = 1024;
            if (pattern == B_L2_256K || pattern == B_L2_PF) bo = (i & 127) * 2048;
            if (pattern == B_L1_32K) bo = (i & 15) * 2048;
            if (pattern == AB_L2_1M) bo = (i & 255) * 2048, ao = (i & 255) * 2048;   /* 512K of A + 512K of B */
            if (pattern == A_STRIDED) as = 4096, at = 65536 - 4096, ao = (i & 15) * 64;
            const char *a = A + ao, *bb = B + bo;
            if (pattern == B_L2_PF) for (int l = 0; l < 32; l++) __builtin_prefetch(B + ((i + 8) & 127) * 2048 + l * 64, 0, 3);
            TL(4, a, as); TL(6, bb, 64); TD(0, 4, 6);
            TL(7, bb + 1024, 64); TD(1, 4, 7);
            TL(5, a + at, as); TD(2, 5, 6); TD(3, 5, 7);
            break;
        }
        case INT8_INTERLEAVED:
            TL(4, A, 64); TL(6, B, 64); TDI(0, 4, 6);
            TL(7, B + 1024, 64); TDI(1, 4, 7);
            TL(5, A + 1024, 64); TDI(2, 5, 6); TDI(3, 5, 7);
            break;
        case PIPELINED:
            TD(0, 4, 6); TD(1, 4, 7); TL(4, A, 64);
            TD(2, 5, 6); TL(6, B, 64); TD(3, 5, 7); TL(7, B + 1024, 64); TL(5, A + 1024, 64);
            break;
        case GROUP2:
            TL(4, A, 64); TL(6, B, 64); TL(7, B + 1024, 64); TD(0, 4, 6); TD(1, 4, 7);
            TL(5, A + 1024, 64); TD(2, 5, 6); TD(3, 5, 7); break;
        case L4_COLFIRST:
            TL(6, B, 64); TL(4, A, 64); TL(5, A + 1024, 64); TL(7, B + 1024, 64);
            TD(0, 4, 6); TD(2, 5, 6); TD(1, 4, 7); TD(3, 5, 7); break;
        case L4_L2: {
            const char *bb = B + (i & 127) * 2048;
            TL(4, A, 64); TL(5, A + 1024, 64); TL(6, bb, 64); TL(7, bb + 1024, 64);
            TD(0, 4, 6); TD(1, 4, 7); TD(2, 5, 6); TD(3, 5, 7); break;
        }
        case DB_1x2: case DB_1x2_L2: {   /* C tmm0,1; set 0: A tmm2, B tmm4,5; set 1: A tmm3, B tmm6,7; 2 k-steps */
            const char *bb = B + (pattern == DB_1x2_L2 ? (i & 63) * 4096 : 0);
            TL(3, A + 1024, 64); TL(6, bb + 2048, 64); TL(7, bb + 3072, 64);
            TD(0, 2, 4); TD(1, 2, 5);
            TL(2, A, 64); TL(4, bb, 64); TL(5, bb + 1024, 64);
            TD(0, 3, 6); TD(1, 3, 7);
            break;
        }
        case DB_1x3:   /* C tmm0,1,2; A tmm3 / tmm4 alternating; B tmm5,6,7; per iteration 2 k-steps = 6 tdp, scaled */
            TL(4, A + 1024, 64); TD(0, 3, 5); TD(1, 3, 6); TD(2, 3, 7);
            TL(5, B, 64); TL(6, B + 1024, 64); TL(7, B + 2048, 64);
            TL(3, A, 64); TD(0, 4, 5); TD(1, 4, 6); TD(2, 4, 7);
            TL(5, B + 3072, 64); TL(6, B + 4096, 64); TL(7, B + 5120, 64);
            break;
        case TWO_LOADS:
            TL(4, A, 64); TD(0, 4, 6); TD(1, 4, 7); TL(6, B, 64); TD(2, 5, 6); TD(3, 5, 7); break;
        case ONE_LOAD:
            TL(4, A, 64); TD(0, 4, 6); TD(1, 4, 7); TD(2, 5, 6); TD(3, 5, 7); break;
        }
    }
    __asm__ volatile("tilerelease");
    return 0;
}

static double measure(int nth, int pat, double secs) {
    pattern = pat;
    iters = 20000;
    for (;;) {
        pthread_t t[128];
        double t0 = now();
        for (long i = 0; i < nth; i++) pthread_create(&t[i], 0, run, (void *)i);
        for (int i = 0; i < nth; i++) pthread_join(t[i], 0);
        double dt = now() - t0;
        const int tdp = (pat == DB_1x3 ? 6 : 4) * (pat == INT8_INTERLEAVED || pat == INT8_REG ? 2 : 1);   /* int8: K 64 */
        if (dt > secs || iters > (1L << 34)) return (double)nth * iters * tdp * 2.0 * 16 * 16 * 32 / dt / 1e12;
        iters = (long)(iters * (secs * 1.3 / (dt > 1e-4 ? dt : 1e-4)));
    }
}

int main(int argc, char **argv) {
    if (syscall(SYS_arch_prctl, 0x1023, 18)) { fprintf(stderr, "no AMX permission\n"); return 1; }
    double secs = argc > 1 ? atof(argv[1]) : 0.2;
    int ncpu = (int)sysconf(_SC_NPROCESSORS_ONLN);
    /* core-first order: the first CPU of each core, then the siblings */
    int core_of[128], n = 0;
    for (int c = 0; c < ncpu && c < 128; c++) {
        char p[128];
        snprintf(p, sizeof p, "/sys/devices/system/cpu/cpu%d/topology/thread_siblings_list", c);
        FILE *f = fopen(p, "r");
        int first = c;
        if (f) { if (fscanf(f, "%d", &first) != 1) first = c; fclose(f); }
        core_of[c] = first;
    }
    for (int c = 0; c < ncpu; c++) if (core_of[c] == c) cpus[n++] = c;
    int cores = n;
    for (int c = 0; c < ncpu; c++) if (core_of[c] != c) cpus[n++] = c;
    printf("cpus %d, cores %d; order:", ncpu, cores);
    for (int i = 0; i < n; i++) printf(" %d", cpus[i]);
    printf("\n");
    for (int i = 0; i < 128; i++) {
        bufs[i] = aligned_alloc(4096, 2 << 20);
        memset(bufs[i], 0, 2 << 20);
    }
    const char *list = getenv("PROBE_CPUS");   /* e.g. 0,2,4,6: the order threads are pinned in */
    if (list) {
        n = 0;
        for (const char *q = list; *q;) { cpus[n++] = atoi(q); while (*q && *q != ',') q++; if (*q) q++; }
        printf("PROBE_CPUS order:");
        for (int i = 0; i < n; i++) printf(" %d", cpus[i]);
        printf("\n");
    }
    if (getenv("PROBE_PAIRS")) {   /* reg-only on every pair of CPUs: ~1x one thread where they share a core */
        int all[128];
        memcpy(all, cpus, sizeof all);
        for (int j = 0; j < ncpu; j++)
            for (int k = j + 1; k < ncpu; k++) {
                cpus[0] = j, cpus[1] = k;
                double r = measure(2, REG, secs);
                if (r < 3.3) printf("pair %d,%d shares: %.2f TFLOPS\n", j, k, r);
            }
        memcpy(cpus, all, sizeof all);
        return 0;
    }
    int counts[] = {1, 2, n / 2, n};
    printf("%-28s", "TFLOPS (int8 TOPS) threads");
    for (int k = 0; k < 4; k++) printf(" %8d", counts[k]);
    printf("\n");
    for (int pat = 0; pat < NPAT; pat++) {
        printf("%-28s", names[pat]);
        for (int k = 0; k < 4; k++) { printf(" %8.2f", measure(counts[k], pat, secs)); fflush(stdout); }
        printf("\n");
    }
    return 0;
}
