/* CPU feature detection (CPUID + XGETBV + AMX permission), ISA choice, physical core topology.
 *
 * Everything is detected once (pthread_once) on first use. The ISA in use is, in order: the last ktk_isa_set, else
 * KTINJECT_ISA (generic|avx2|avx512|amx), else the best available. A KTINJECT_ISA that is unknown or unavailable
 * puts the library in an ISA error state: ktk_isa_get returns -KTK_ERR_ISA and ktk_experts_create, ktk_task_bind and
 * ktk_forward fail with KTK_ERR_ISA and a message naming the variable, until ktk_isa_set picks a valid ISA.
 * An ISA whose kernel file is not linked in (weak symbol) counts as unavailable.
 */
#define _GNU_SOURCE
#include <pthread.h>
#include <sched.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <strings.h>
#include <sys/syscall.h>
#include <unistd.h>

#include "../internal.h"

#if defined(__x86_64__) || defined(__i386__)
#include <cpuid.h>
#define KTKI_X86 1
#endif

/* A missing ISA file just means "unavailable". */
extern const ktk_kernels *ktk_kernels_avx2(void) __attribute__((weak));
extern const ktk_kernels *ktk_kernels_avx512(void) __attribute__((weak));
extern const ktk_kernels *ktk_kernels_amx(void) __attribute__((weak));
extern const ktk_bwd_kernels *ktk_bwd_kernels_avx512(void) __attribute__((weak));
extern const ktk_bwd_kernels *ktk_bwd_kernels_avx2(void) __attribute__((weak));

static pthread_once_t g_once = PTHREAD_ONCE_INIT;
static uint32_t g_features;
static int g_best;
static _Atomic int g_isa;          /* ISA in use */
static _Atomic int g_isa_error;    /* 1 while KTINJECT_ISA is invalid and no ktk_isa_set happened */
static char g_isa_error_msg[KTKI_MSG_LEN];
static int g_cores;
static int g_order[4096];
static int g_norder;

#ifdef KTKI_X86
static uint64_t xgetbv0(void) {
    uint32_t lo, hi;
    __asm__ volatile("xgetbv" : "=a"(lo), "=d"(hi) : "c"(0));
    return ((uint64_t)hi << 32) | lo;
}

static int amx_permission(void) {
    /* ARCH_REQ_XCOMP_PERM = 0x1023, ARCH_GET_XCOMP_PERM = 0x1022, XFEATURE_XTILEDATA = 18 */
    if (syscall(SYS_arch_prctl, 0x1023, 18) != 0) return 0;
    unsigned long bitmask = 0;
    if (syscall(SYS_arch_prctl, 0x1022, &bitmask) != 0) return 0;
    return (bitmask >> 18) & 1;
}

static uint32_t detect_features(void) {
    unsigned a, b, c, d, max = __get_cpuid_max(0, NULL);
    uint32_t f = 0;
    if (max < 1 || !__get_cpuid(1, &a, &b, &c, &d)) return 0;
    int osxsave = (c >> 27) & 1, avx = (c >> 28) & 1;
    uint64_t xcr0 = osxsave ? xgetbv0() : 0;
    int os_ymm = (xcr0 & 0x6) == 0x6, os_zmm = (xcr0 & 0xe6) == 0xe6, os_tile = (xcr0 & 0x60000) == 0x60000;
    if (!avx || !os_ymm) return 0;
    if ((c >> 12) & 1) f |= KTK_CPU_FMA;
    if ((c >> 29) & 1) f |= KTK_CPU_F16C;
    if (max < 7) return f;
    __cpuid_count(7, 0, a, b, c, d);
    unsigned sub1 = a;
    if ((b >> 5) & 1) f |= KTK_CPU_AVX2;
    if (os_zmm) {
        if ((b >> 16) & 1) f |= KTK_CPU_AVX512F;
        if ((b >> 30) & 1) f |= KTK_CPU_AVX512BW;
        if ((b >> 31) & 1) f |= KTK_CPU_AVX512VL;
        if ((c >> 11) & 1) f |= KTK_CPU_AVX512_VNNI;
        if ((d >> 23) & 1) f |= KTK_CPU_AVX512_FP16;
    }
    if (os_tile) {
        if ((d >> 24) & 1) f |= KTK_CPU_AMX_TILE;
        if ((d >> 22) & 1) f |= KTK_CPU_AMX_BF16;
        if ((d >> 25) & 1) f |= KTK_CPU_AMX_INT8;
    }
    if (sub1 >= 1) {
        __cpuid_count(7, 1, a, b, c, d);
        if ((a >> 4) & 1) f |= KTK_CPU_AVX_VNNI;
        if (((a >> 5) & 1) && os_zmm) f |= KTK_CPU_AVX512_BF16;
    }
    if ((f & KTK_CPU_AMX_TILE) && amx_permission()) f |= KTK_CPU_AMX_OS;
    return f;
}
#else
static uint32_t detect_features(void) { return 0; }
#endif

static int cpu_has_isa(uint32_t f, int isa) {
    const uint32_t avx2 = KTK_CPU_AVX2 | KTK_CPU_FMA | KTK_CPU_F16C;
    const uint32_t avx512 = avx2 | KTK_CPU_AVX512F | KTK_CPU_AVX512BW | KTK_CPU_AVX512VL;
    const uint32_t amx = avx512 | KTK_CPU_AMX_TILE | KTK_CPU_AMX_BF16 | KTK_CPU_AMX_INT8 | KTK_CPU_AMX_OS;
    switch (isa) {
    case KTK_ISA_GENERIC: return 1;
    case KTK_ISA_AVX2: return (f & avx2) == avx2 && ktk_kernels_avx2 != NULL;
    case KTK_ISA_AVX512: return (f & avx512) == avx512 && ktk_kernels_avx512 != NULL;
    case KTK_ISA_AMX: return (f & amx) == amx && ktk_kernels_amx != NULL;
    default: return 0;
    }
}

/* ---- topology ---- */
static int parse_first_cpu(const char *path) {
    FILE *fp = fopen(path, "r");
    int first = -1;
    if (!fp) return -1;
    if (fscanf(fp, "%d", &first) != 1) first = -1;
    fclose(fp);
    return first;
}

/* Core id of a CPU: the first CPU listed in its thread_siblings_list (core_cpus_list on newer kernels). */
static int core_of(int cpu) {
    char path[128];
    snprintf(path, sizeof path, "/sys/devices/system/cpu/cpu%d/topology/core_cpus_list", cpu);
    int first = parse_first_cpu(path);
    if (first >= 0) return first;
    snprintf(path, sizeof path, "/sys/devices/system/cpu/cpu%d/topology/thread_siblings_list", cpu);
    first = parse_first_cpu(path);
    return first >= 0 ? first : cpu;
}

static void detect_topology(void) {
    cpu_set_t set;
    int n = 0, seconds[4096], nsec = 0;
    static unsigned char seen_core[CPU_SETSIZE];
    memset(seen_core, 0, sizeof seen_core);
    if (sched_getaffinity(0, sizeof set, &set) == 0) {
        for (int cpu = 0; cpu < CPU_SETSIZE && n + nsec < 4096; cpu++) {
            if (!CPU_ISSET(cpu, &set)) continue;
            int core = core_of(cpu);
            if (core < 0 || core >= CPU_SETSIZE) core = cpu;
            if (!seen_core[core]) { seen_core[core] = 1; g_order[n++] = cpu; }
            else seconds[nsec++] = cpu;
        }
    }
    if (n == 0) {   /* no affinity information: all online CPUs, no pinning order beyond their numbers */
        long online = sysconf(_SC_NPROCESSORS_ONLN);
        n = online > 0 ? (int)(online < 4096 ? online : 4096) : 1;
        for (int i = 0; i < n; i++) g_order[i] = i;
    }
    g_cores = n;
    memcpy(g_order + n, seconds, (size_t)nsec * sizeof(int));
    g_norder = n + nsec;
}

const char *ktki_dispatch_isa_name(int isa) {
    static const char *names[] = {"generic", "avx2", "avx512", "amx"};
    return isa >= KTK_ISA_GENERIC && isa <= KTK_ISA_AMX ? names[isa] : NULL;
}

static int isa_from_name(const char *s) {
    for (int i = KTK_ISA_GENERIC; i <= KTK_ISA_AMX; i++)
        if (strcasecmp(s, ktki_dispatch_isa_name(i)) == 0) return i;
    return -1;
}

static void init_once(void) {
    g_features = detect_features();
    g_best = KTK_ISA_GENERIC;
    for (int i = KTK_ISA_AVX2; i <= KTK_ISA_AMX; i++)
        if (cpu_has_isa(g_features, i)) g_best = i;
    atomic_store(&g_isa, g_best);
    detect_topology();
    const char *env = getenv("KTINJECT_ISA");
    if (env && *env) {
        int isa = isa_from_name(env);
        if (isa < 0) {
            snprintf(g_isa_error_msg, sizeof g_isa_error_msg,
                     "KTINJECT_ISA=%.40s: unknown ISA (expected generic, avx2, avx512 or amx)", env);
            atomic_store(&g_isa_error, 1);
        } else if (!cpu_has_isa(g_features, isa)) {
            snprintf(g_isa_error_msg, sizeof g_isa_error_msg,
                     "KTINJECT_ISA=%.40s: not available on this CPU/OS/build (best available: %s)", env,
                     ktki_dispatch_isa_name(g_best));
            atomic_store(&g_isa_error, 1);
        } else {
            atomic_store(&g_isa, isa);
        }
    }
}

static void init(void) { pthread_once(&g_once, init_once); }

uint32_t ktki_dispatch_cpu_features(void) { init(); return g_features; }
int ktki_dispatch_isa_best(void) { init(); return g_best; }
int ktki_dispatch_isa_available(int isa) { init(); return cpu_has_isa(g_features, isa); }
int ktki_dispatch_physical_cores(void) { init(); return g_cores; }

int ktki_dispatch_cpu_order(int *cpus, int max) {
    init();
    int n = g_norder < max ? g_norder : max;
    memcpy(cpus, g_order, (size_t)n * sizeof(int));
    return n;
}

int ktki_dispatch_isa_check(void) {
    init();
    if (atomic_load(&g_isa_error)) return ktki_error(KTK_ERR_ISA, "%s", g_isa_error_msg);
    return KTK_OK;
}

int ktki_dispatch_isa_get(void) {
    int rc = ktki_dispatch_isa_check();
    return rc == KTK_OK ? atomic_load(&g_isa) : -rc;
}

int ktki_dispatch_isa_set(int isa) {
    init();
    if (!cpu_has_isa(g_features, isa))
        return ktki_error(KTK_ERR_ISA, "ktk_isa_set: ISA %s is not available on this CPU/OS/build (best: %s)",
                          ktki_dispatch_isa_name(isa), ktki_dispatch_isa_name(g_best));
    atomic_store(&g_isa, isa);
    atomic_store(&g_isa_error, 0);
    return KTK_OK;
}

const ktk_kernels *ktki_dispatch_kernels(void) {
    init();
    switch (atomic_load(&g_isa)) {
    case KTK_ISA_AMX: return ktk_kernels_amx();
    case KTK_ISA_AVX512: return ktk_kernels_avx512();
    case KTK_ISA_AVX2: return ktk_kernels_avx2();
    default: return ktk_kernels_generic();
    }
}

/* The backward kernels of the ISA in use (amx: the AVX-512 ones), or NULL: the generic step (generic). */
const ktk_bwd_kernels *ktki_dispatch_backward(void) {
    init();
    const int isa = atomic_load(&g_isa);
    if ((isa == KTK_ISA_AMX || isa == KTK_ISA_AVX512) && ktk_bwd_kernels_avx512) return ktk_bwd_kernels_avx512();
    if (isa == KTK_ISA_AVX2 && ktk_bwd_kernels_avx2) return ktk_bwd_kernels_avx2();
    return NULL;
}
