/* ktinject native core: internal declarations shared by the generic C files (not the ISA kernel files).
 *
 * Layering, by folder: api.c holds every public ktk_* entry point and checks its arguments; the ktki_* functions
 * below assume valid arguments and are named for the file that defines them (ktki_<file>_*). moe/ (one MoE layer's
 * experts and forward) calls runtime/ (the pool, tasks) and kernels/ (dispatch, activations, the ISA kernels);
 * runtime/ calls kernels/ (topology) but nothing in moe/: a task runs its job through a step function pointer;
 * kernels/ calls neither; error.c, called by all, calls nothing (tests/test_layering.py checks this).
 * Legend: T tokens, k experts per token, E experts, H hidden, I expert intermediate,
 * R routed rows (token, expert pairs that are computed here), A active experts (>= 1 row, not skipped).
 */
#ifndef KTK_INTERNAL_H
#define KTK_INTERNAL_H
#include <stdatomic.h>
#include <stddef.h>
#include <stdint.h>

#include "ktinject.h"
#include "kernels/kernels.h"

#define KTKI_MSG_LEN 320

/* Bytes of one element of an activation / output dtype (F32, else a 16-bit float). */
static inline int64_t ktki_dtype_size(int dtype) { return dtype == KTK_DTYPE_F32 ? 4 : 2; }
/* n rounded up to a multiple of 64 (cache-line-aligned carving of the scratch buffers). */
static inline size_t a64(size_t n) { return (n + 63) & ~(size_t)63; }

static inline void ktki_cpu_relax(void) {
#if defined(__x86_64__) || defined(__i386__)
    __builtin_ia32_pause();
#endif
}

/* ---- errors (error.c): thread-local message, read back by ktk_last_error ---- */
/* Sets this thread's message and returns code (so: return ktki_error(KTK_ERR_SHAPE, "...")). */
int ktki_error(int code, const char *fmt, ...) __attribute__((format(printf, 2, 3)));
void ktki_error_clear(void);
const char *ktki_error_msg(void);
void ktki_error_set_msg(int code, const char *msg); /* copy a message saved elsewhere (task results) */

/* ---- dispatch (kernels/dispatch.c) ---- */
uint32_t ktki_dispatch_cpu_features(void);
int ktki_dispatch_isa_best(void);
int ktki_dispatch_isa_available(int isa);
int ktki_dispatch_isa_check(void);   /* KTK_OK, or KTK_ERR_ISA + message while KTINJECT_ISA is invalid/unavailable */
int ktki_dispatch_isa_get(void);          /* ISA in use, or -KTK_ERR_ISA (message set) */
int ktki_dispatch_isa_set(int isa);
const char *ktki_dispatch_isa_name(int isa); /* "generic", "avx2", "avx512", "amx"; NULL out of range (ktk_isa_name) */
const ktk_kernels *ktki_dispatch_kernels(void); /* the table of the ISA in use (generic while the ISA is in error) */
int ktki_dispatch_physical_cores(void);
/* CPUs in pinning order: the first CPU of each physical core, then the remaining hyper-threads. Returns count. */
int ktki_dispatch_cpu_order(int *cpus, int max);

/* ---- events (runtime/event.c): a 32-bit sequence word; waiters spin a while, then sleep on a futex ---- */
typedef struct {
    _Atomic uint32_t seq;
    _Atomic uint32_t waiters;
} ktki_event;
int64_t ktki_event_now_ns(void);                                       /* CLOCK_MONOTONIC, the spins' clock */
void ktki_event_wait(ktki_event *ev, uint32_t seen, int64_t spin_ns); /* returns once seq != seen */
void ktki_event_signal(ktki_event *ev);                                /* seq++, wakes sleepers */

/* ---- pool (runtime/pool.c, job.c, watch.c, profile.c) ---- */
/* A job (one task's forward) is a chain of serial steps and parallel phases. A phase is [0, nitems): chunks of it
 * are claimed by whichever threads come (at most maxc items each; guided: remaining / (2 x threads), at least minc or 1,
 * remaining counted up to the cut where one is set) and run as range(ctx, i0, i1, tid), or item(ctx, i, tid) for each i; tid indexes per-thread scratch (0..n). */
typedef void (*ktki_item_fn)(void *ctx, int64_t item, int tid);
typedef void (*ktki_range_fn)(void *ctx, int64_t i0, int64_t i1, int tid);
typedef struct {
    ktki_item_fn item;     /* one of item, range */
    ktki_range_fn range;
    void *ctx;
    int64_t nitems;
    int maxc, guided;
    int minc;              /* guided: at least this many items a chunk (0 or 1: one) */
    int64_t cut;           /* guided: no chunk crosses item cut, and chunks before it are sized by the items left
                              before it (0: none; a split task's parts in one phase) */
} ktki_phase;
int ktki_pool_create(int nthreads, int pin, ktk_pool **out);
void ktki_pool_destroy(ktk_pool *pool);   /* stops the threads; memory freed once no task holds it */
void ktki_pool_retain(ktk_pool *pool);    /* a task made on it (ktk_task_create) */
void ktki_pool_release(ktk_pool *pool);   /* that task destroyed, or the pool (last one frees it) */
int ktki_pool_stopped(const ktk_pool *pool);
int ktki_pool_threads(const ktk_pool *pool);
int ktki_profile_set(ktk_pool *pool, int on);          /* 0: out of memory */
int ktki_profile_read(ktk_pool *pool, int64_t *out, int n);
void ktki_profile_decode(ktk_pool *pool, int experts, int tokens);   /* a forward's routing, where profiled */
void ktki_watch_set_spin_us(ktk_pool *pool, int64_t us); /* us checked by the caller */
int64_t ktki_watch_spin_us(const ktk_pool *pool);
void ktki_watch_wake(ktk_pool *pool);
/* Grow-only scratch. Shared slots: one buffer per slot for the job being run; per-thread: one buffer per thread id
 * (n + 1 of them). Call from a job's serial steps only; NULL when out of memory. */
enum { KTKI_SCR_ROUTE, KTKI_SCR_ITEMS, KTKI_SCR_X, KTKI_SCR_H, KTKI_SCR_HF, KTKI_SCR_XT, KTKI_SCR_HT, KTKI_SCR_JOB,
       KTKI_SCR_PIPE, KTKI_SCR_SLOTS };
void *ktki_pool_scratch(ktk_pool *pool, int slot, size_t bytes);
int ktki_pool_thread_scratch_reserve(ktk_pool *pool, size_t bytes);
void *ktki_pool_thread_scratch(ktk_pool *pool, int tid);
/* Queue (tasks run one after another; runtime/job.c) and watch list (runtime/watch.c). */
int ktki_job_enqueue(ktk_pool *pool, ktk_task *task);   /* 0: the pool is being destroyed (not queued) */
/* Run task's serial steps on the calling thread if the pool is idle and wait for its end; 1 if it ran, 0 if the
 * pool was busy. */
int ktki_job_run_inline(ktk_pool *pool, ktk_task *task);
int ktki_watch_add(ktk_pool *pool, ktk_task *task);
void ktki_watch_remove(ktk_pool *pool, ktk_task *task); /* returns when no pool thread touches the task */
int64_t ktki_pool_spin_ns(const ktk_pool *pool);
/* Signalled after any task of the pool ends (the task memory may be gone by then: waiters re-check their task). */
ktki_event *ktki_pool_done_event(ktk_pool *pool);

/* ---- experts (moe/experts.c) ---- */
struct ktk_experts {
    ktk_experts_config cfg;
    int32_t out_n[3], in_k[3];  /* per KTK_MAT_*: N, K */
    int32_t Np[3], Kp[3];       /* padded */
    int64_t mat_off[3];         /* byte offset of each matrix inside one expert's region */
    int64_t bias_off[3];        /* byte offset of each bias (float [N]) inside the region, -1 without bias */
    int64_t expert_bytes;       /* bytes of one expert's region (64-byte multiple) */
    int64_t nbytes;             /* E * expert_bytes */
    uint8_t *base;              /* mmap'ed, zero-filled */
    uint8_t *ready;             /* [E][3]: matrix set (not part of the packed bytes) */
};
ktk_mat ktki_experts_mat(const ktk_experts *ex, int e, int which);
const float *ktki_experts_bias(const ktk_experts *ex, int e, int which); /* NULL without bias */
int ktki_experts_create(const ktk_experts_config *cfg, ktk_experts **out);
void ktki_experts_destroy(ktk_experts *ex);
int ktki_experts_set(ktk_experts *ex, int e, int which, const void *src, int dtype, int64_t so, int64_t si);
int ktki_experts_set_quantized(ktk_experts *ex, int e, int which, const int8_t *q, int64_t qso, int64_t qsi,
                               const float *scale, int64_t sso, int64_t ssg);
int ktki_experts_set_fp8(ktk_experts *ex, int e, int which, const uint8_t *q, int64_t qso, int64_t qsi,
                         const float *scale, int64_t sso, int64_t ssg);
int ktki_experts_set_mxfp4(ktk_experts *ex, int e, int which, const uint8_t *blocks, int64_t bso,
                           const uint8_t *scales, int64_t sso);
int ktki_experts_set_bias(ktk_experts *ex, int e, int which, const void *src, int dtype);
int ktki_experts_get(const ktk_experts *ex, int e, int which, float *dst);
int ktki_experts_import(ktk_experts *ex, const void *src, int64_t size);
int ktki_experts_raw(const ktk_experts *ex, int e, int which, ktk_raw *out);

/* ---- packing and conversions (moe/pack.c) ---- */
/* dst[i] = (float)src[i * stride] for i < n; stride in elements. */
void ktki_pack_to_f32(const void *src, int dtype, int64_t n, int64_t stride, float *dst);
/* Symmetric int8 quantization of one row: q = rint(x / s), s = max|x| / 127 (0 -> all zero). Returns sum of q. */
int32_t ktki_pack_quantize_row(const float *x, int64_t n, int8_t *q, float *scale);
void ktki_pack_bf16(const ktk_mat *m, uint16_t *data, int n, const float *row);
void ktki_pack_int8(const ktk_mat *m, int8_t *data, float *scale, int32_t *wsum, int n, const float *row,
                    int8_t *qtmp);
void ktki_pack_int4(const ktk_mat *m, uint8_t *data, float *scale, int n, const float *row);
/* Row n from already-quantized values (ktk_experts_set_quantized; ranges checked by the caller). */
void ktki_pack_int8_q(const ktk_mat *m, int8_t *data, float *scale, int32_t *wsum, int n, const int8_t *q,
                      int64_t qsi, float s);
void ktki_pack_int4_q(const ktk_mat *m, uint8_t *data, float *scale, int n, const int8_t *q, int64_t qsi,
                      const float *s, int64_t ssg);
/* fp8: float -> e4m3 bits (nearest even, saturating at +-448); one block_rows band of rows [n0, n1) quantized per
 * block (rows[(n - n0) * K + c]); row n from e4m3 bits (ktk_experts_set_fp8, checked by the caller) with, where n
 * starts a 16-row block, its band's scales s[g * ssg]. */
uint8_t ktki_pack_f32_to_e4m3(float f);
void ktki_pack_fp8(const ktk_mat *m, uint8_t *data, float *scale, int n0, int n1, const float *rows);
void ktki_pack_fp8_q(const ktk_mat *m, uint8_t *data, float *scale, int n, const uint8_t *q, int64_t qsi,
                     const float *s, int64_t ssg);
/* mxfp4: row n (finite: checked by the caller) quantized per group of 32; row n from a release's
 * bytes (K / 2 bytes of e2m1 pairs, K / 32 e8m0 bytes; scales checked by the caller). */
void ktki_pack_mxfp4(const ktk_mat *m, uint8_t *data, uint8_t *scale, int n, const float *row);
void ktki_pack_mxfp4_q(const ktk_mat *m, uint8_t *data, uint8_t *scale, int n, const uint8_t *blocks,
                       const uint8_t *scales);
void ktki_pack_unpack(const ktk_mat *m, int n, float *row);   /* row n as float (dequantized), c < K */

/* ---- activation functions (kernels/activations.c) ---- */
/* out[j] = act(g[j] + bg[j], u[j] + bu[j]) for j < n (bg, bu may be NULL: 0) */
void ktki_activations(int act, float alpha, float limit, const float *g, const float *u, const float *bg,
                      const float *bu, int n, float *out);

/* ---- tasks (runtime/task.c) and the forward (moe/forward.c) ---- */
enum { KTKI_TASK_IDLE, KTKI_TASK_QUEUED, KTKI_TASK_RUNNING };
#define KTKI_PHASE (-1)
/* The next step of a task's job (first: the run's first step): KTKI_PHASE with *ph to run, or a KTK_* code when the
 * job is done (error message on the calling thread). The runtime calls it through the task (ktk_task.step). */
typedef int (*ktki_step_fn)(ktk_pool *pool, ktk_task *task, int first, ktki_phase *ph);
struct ktk_task {
    ktk_pool *pool;
    ktki_step_fn step;         /* the bound job's steps: ktki_forward_step */
    /* bound forward (pointers are read when the task runs) */
    ktk_experts *ex;
    int T, k, hidden_dtype, weights_dtype, out_dtype, bound;
    const void *hidden;
    const int64_t *ids;
    const void *weights;
    const uint8_t *skip;
    void *out;
    int slots, slots_d;        /* which slots of each token run: KTK_SLOTS_* and d (ktk_task_select) */
    float slots_share;         /* > 0: deferral by weight share instead of d (ktk_task_select_share) */
    _Atomic uint64_t slots_run;  /* (token, slot) rows computed, summed over runs (ktk_task_slots_run) */
    _Atomic uint64_t slots_rest; /* ... of them, the deferred part's of a split task (ktk_task_slots_rest) */
    void *out2;                /* KTK_SLOTS_SPLIT: the deferred part's output (ktk_task_split) */
    volatile uint32_t *done_top;  /* ... raised when out is complete, or NULL */
    _Atomic int top_raised;    /* this run raised *done_top */
    /* state */
    _Atomic int state;         /* IDLE is stored last when a run ends (then the pool's done event is signalled) */
    int result;                /* of the latest run */
    char msg[KTKI_MSG_LEN];
    int sticky;                /* first failed run while watched / failed ktk_submit_fn, kept for wait/unwatch */
    char sticky_msg[KTKI_MSG_LEN];
    /* watch */
    volatile uint32_t *go, *done;
    volatile uint32_t *then;   /* raised (1) after *done at the end of each watched run, or NULL */
    int watched;
    int steps;                 /* steps of the current run so far */
    volatile uint32_t *signal; /* a submitted run's end raises it (ktk_task_signal), or NULL */
    int64_t begin_ns, end_ns;  /* the latest run's start and end, CLOCK_MONOTONIC (ktk_task_times) */
    ktk_task *next;            /* pool queue link */
};
void ktki_task_init(ktk_task *task, ktk_pool *pool);
int ktki_task_bind(ktk_task *t, ktki_step_fn step, ktk_experts *ex, int T, int k, const void *hidden,
                   int hidden_dtype, const int64_t *ids, const void *weights, int weights_dtype, const uint8_t *skip,
                   void *out, int out_dtype);
int ktki_task_submit(ktk_task *task);
int ktki_task_wait(ktk_task *task);
int ktki_task_watch(ktk_task *task, volatile uint32_t *go, volatile uint32_t *done, volatile uint32_t *then);
int ktki_task_select(ktk_task *task, int slots, int d);
int ktki_task_select_share(ktk_task *task, int slots, float share);
int ktki_task_split(ktk_task *task, int d, float share, void *out2, volatile uint32_t *done_top);
void ktki_task_raise_top(ktk_task *task);   /* *done_top = 1 (release), once a run */
int ktki_task_signal(ktk_task *task, volatile uint32_t *done);
int ktki_task_unwatch(ktk_task *task);
void ktki_task_finish(ktk_task *task);                /* wait + unwatch (before destroy) */
void ktki_task_submit_fn(ktk_task *task);
void ktki_task_wait_fn(ktk_task *task);
/* A run, on whichever threads: begin (RUNNING), then steps until one returns 0, then end (done flag if watched, then
 * IDLE: the task may be freed from then on). A step returns 1 with the next parallel phase in *ph. */
void ktki_task_begin(ktk_task *task);
int ktki_task_step(ktk_task *task, ktki_phase *ph);
void ktki_task_end(ktk_task *task, int watched);
/* moe/forward.c: a forward's steps (ktki_step_fn; its state lives in the pool's KTKI_SCR_JOB slot), and a
 * synchronous forward (a task on the caller's stack, run inline on an idle pool, else queued and waited for) */
int ktki_forward_step(ktk_pool *pool, ktk_task *task, int first, ktki_phase *ph);
int ktki_forward(ktk_pool *pool, ktk_experts *ex, int T, int k, const void *hidden, int hidden_dtype,
                 const int64_t *ids, const void *weights, int weights_dtype, const uint8_t *skip, void *out,
                 int out_dtype);
/* moe/backward.c: the backward of such a forward (synchronous, as ktki_forward); dx or dweights may be NULL */
int ktki_backward(ktk_pool *pool, ktk_experts *ex, int T, int k, const void *hidden, int hidden_dtype,
                  const int64_t *ids, const void *weights, int weights_dtype, const uint8_t *skip, const void *dy,
                  int dy_dtype, void *dx, int dx_dtype, float *dweights);

/* moe/project.c: one projection of routed rows with the stored weights, forward or transposed (synchronous) */
int ktki_project(ktk_pool *pool, ktk_experts *ex, int which, int R, const int64_t *expert_of_row, const void *x,
                 int x_dtype, void *y, int y_dtype, int transpose, int precision);
/* moe/lora.c: the adapters' terms of routed rows (checked by api.c) */
int ktki_lora(ktk_pool *pool, ktk_experts *ex, int which, int R, int rank, const int64_t *expert_of_row,
              const float *z, const float *a, const float *bt, float *t, float *y);
int ktki_lora_backward(ktk_pool *pool, ktk_experts *ex, int which, int R, int rank, const int64_t *expert_of_row,
                       const float *z, const float *t, const float *dy, const float *a, const float *bt, float *dt,
                       float *dz, float *da, float *dbt);

/* ---- GGUF K-quant blocks (gguf_dequant.c) ---- */
int64_t ktki_gguf_dequant_block_bytes(int qtype);   /* bytes of one block of KTK_GGUF_* qtype; 0 for another */
void ktki_gguf_dequant(int qtype, const uint8_t *blocks, int64_t nblocks, float *out);   /* [nblocks * 256] */

#endif
