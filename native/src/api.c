/* Public entry points: argument checks (error code + thread-local message naming the argument, expected vs got),
 * then the internal ktki_* functions, which assume valid arguments. Nothing here crashes on bad input.
 */
#define _GNU_SOURCE
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "internal.h"

#define KTK_VERSION "0.1.0"
#define MAX_EXPERTS 65536
#define MAX_DIM (1 << 20)          /* H, I */
#define MAX_TOKENS (1 << 22)       /* T per forward */
#define MAX_K 64
#define MAX_THREADS 4096
#define MAX_NBYTES (1LL << 46)     /* 64 TiB of packed weights: anything larger is a wrong size */
#define MAX_STRIDE (1LL << 40)     /* elements */
#define MAX_FP8_GROUP 512          /* fp8 inputs per scale */

/* ---- errors: the state lives in error.c; this is its public reader ---- */
const char *ktk_last_error(void) { return ktki_error_msg(); }

#define CHECK_NULL(p, fn) \
    if (!(p)) return ktki_error(KTK_ERR_NULL, "%s: argument '%s' is NULL", fn, #p)

static const char *mat_name(int which) {
    return which == KTK_MAT_GATE ? "gate" : which == KTK_MAT_UP ? "up" : "down";
}

static int check_dtype(const char *fn, const char *arg, int dtype, int allow_f16) {
    if (dtype == KTK_DTYPE_F32 || dtype == KTK_DTYPE_BF16 || (allow_f16 && dtype == KTK_DTYPE_F16)) return KTK_OK;
    return ktki_error(KTK_ERR_DTYPE, "%s: %s = %d is not supported (expected %s)", fn, arg, dtype,
                      allow_f16 ? "KTK_DTYPE_F32=0, KTK_DTYPE_BF16=1 or KTK_DTYPE_F16=2"
                                : "KTK_DTYPE_F32=0 or KTK_DTYPE_BF16=1");
}

static int check_expert(const char *fn, const ktk_experts *ex, int expert, int which) {
    if (expert < 0 || expert >= ex->cfg.num_experts)
        return ktki_error(KTK_ERR_RANGE, "%s: expert = %d is out of range (expected 0 <= expert < %d)", fn, expert,
                          ex->cfg.num_experts);
    if (which < KTK_MAT_GATE || which > KTK_MAT_DOWN)
        return ktki_error(KTK_ERR_RANGE, "%s: which = %d is not a matrix (expected KTK_MAT_GATE=0, "
                          "KTK_MAT_UP=1 or KTK_MAT_DOWN=2)", fn, which);
    return KTK_OK;
}

/* ---- library ---- */
const char *ktk_version(void) { return KTK_VERSION; }
uint32_t ktk_cpu_features(void) { return ktki_dispatch_cpu_features(); }
int ktk_isa_best(void) { return ktki_dispatch_isa_best(); }
int ktk_isa_get(void) { return ktki_dispatch_isa_get(); }
int ktk_isa_available(int isa) { return ktki_dispatch_isa_available(isa); }
int ktk_physical_cores(void) { return ktki_dispatch_physical_cores(); }

int ktk_isa_set(int isa) {
    if (isa < KTK_ISA_GENERIC || isa > KTK_ISA_AMX)
        return ktki_error(KTK_ERR_ISA, "ktk_isa_set: isa = %d is not an ISA (expected 0..3: generic, avx2, "
                          "avx512, amx)", isa);
    return ktki_dispatch_isa_set(isa);
}

const char *ktk_isa_name(int isa) { return ktki_dispatch_isa_name(isa); }

/* ---- pool ---- */
int ktk_pool_create(int nthreads, int pin, ktk_pool **out) {
    CHECK_NULL(out, "ktk_pool_create");
    *out = NULL;
    if (nthreads <= 0) nthreads = ktki_dispatch_physical_cores();
    if (nthreads > MAX_THREADS)
        return ktki_error(KTK_ERR_SHAPE, "ktk_pool_create: nthreads = %d is too large (expected <= %d)", nthreads,
                          MAX_THREADS);
    return ktki_pool_create(nthreads, pin, out);
}

int ktk_pool_threads(const ktk_pool *pool) {
    if (!pool) return -ktki_error(KTK_ERR_NULL, "ktk_pool_threads: argument 'pool' is NULL");
    return ktki_pool_threads(pool);
}

int ktk_pool_set_watch_spin_us(ktk_pool *pool, int64_t us) {
    CHECK_NULL(pool, "ktk_pool_set_watch_spin_us");
    if (us < 0 || us > 10000000)
        return ktki_error(KTK_ERR_SHAPE, "ktk_pool_set_watch_spin_us: us = %lld is out of range (0..10000000)",
                          (long long)us);
    ktki_watch_set_spin_us(pool, us);
    return KTK_OK;
}

int ktk_pool_wake(ktk_pool *pool) {
    CHECK_NULL(pool, "ktk_pool_wake");
    ktki_watch_wake(pool);
    return KTK_OK;
}

int ktk_pool_set_profile(ktk_pool *pool, int on) {
    CHECK_NULL(pool, "ktk_pool_set_profile");
    return ktki_profile_set(pool, on) ? KTK_OK
                                           : ktki_error(KTK_ERR_NOMEM, "ktk_pool_set_profile: out of memory");
}

int ktk_pool_profile(ktk_pool *pool, int64_t *out, int n) {   /* a count, or -code (as ktk_pool_threads) */
    if (!pool) return -ktki_error(KTK_ERR_NULL, "ktk_pool_profile: argument 'pool' is NULL");
    if (n > 0 && !out) return -ktki_error(KTK_ERR_NULL, "ktk_pool_profile: argument 'out' is NULL");
    return ktki_profile_read(pool, out, n < 0 ? 0 : n);
}

int64_t ktk_pool_watch_spin_us(const ktk_pool *pool) {
    if (!pool) return -ktki_error(KTK_ERR_NULL, "ktk_pool_watch_spin_us: argument 'pool' is NULL");
    return ktki_watch_spin_us(pool);
}

void ktk_pool_destroy(ktk_pool *pool) {
    if (pool) ktki_pool_destroy(pool);
}

/* ---- experts ---- */
static int check_config(const ktk_experts_config *c) {
    const char *fn = "ktk_experts_create";
    if (c->num_experts < 1 || c->num_experts > MAX_EXPERTS)
        return ktki_error(KTK_ERR_SHAPE, "%s: num_experts = %d (expected 1..%d)", fn, c->num_experts, MAX_EXPERTS);
    if (c->hidden < 1 || c->hidden > MAX_DIM)
        return ktki_error(KTK_ERR_SHAPE, "%s: hidden = %d (expected 1..%d)", fn, c->hidden, MAX_DIM);
    if (c->intermediate < 1 || c->intermediate > MAX_DIM)
        return ktki_error(KTK_ERR_SHAPE, "%s: intermediate = %d (expected 1..%d)", fn, c->intermediate, MAX_DIM);
    if (c->quant < KTK_QUANT_BF16 || c->quant > KTK_QUANT_MXFP4)
        return ktki_error(KTK_ERR_DTYPE, "%s: quant = %d (expected KTK_QUANT_BF16=0, KTK_QUANT_INT8=1, "
                          "KTK_QUANT_INT4=2, KTK_QUANT_FP8=3 or KTK_QUANT_MXFP4=4)", fn, c->quant);
    if (c->quant == KTK_QUANT_MXFP4) {
        if (c->group_size != 0 && c->group_size != 32)
            return ktki_error(KTK_ERR_SHAPE, "%s: group_size = %d for mxfp4 (its scales are per 32 inputs: expected 32 "
                              "or 0)", fn, c->group_size);
        if (c->block_rows != 0)
            return ktki_error(KTK_ERR_SHAPE, "%s: block_rows = %d (only fp8 experts have block scales; expected 0)",
                              fn, c->block_rows);
        if (c->hidden % 32 || c->intermediate % 32)
            return ktki_error(KTK_ERR_SHAPE, "%s: hidden = %d, intermediate = %d for mxfp4 (both must be multiples of "
                              "32: its scales are per 32 inputs)", fn, c->hidden, c->intermediate);
    } else if (c->quant == KTK_QUANT_FP8) {
        if (c->group_size < 0 || c->group_size > MAX_FP8_GROUP || c->group_size % 16)
            return ktki_error(KTK_ERR_SHAPE, "%s: group_size = %d for fp8 (expected inputs per scale, a multiple of "
                              "16 up to %d, or 0 for the default 128)", fn, c->group_size, MAX_FP8_GROUP);
        if (c->block_rows < 0 || c->block_rows > MAX_DIM || c->block_rows % 16)
            return ktki_error(KTK_ERR_SHAPE, "%s: block_rows = %d for fp8 (expected output rows per scale, a "
                              "multiple of 16 up to %d, or 0 for the default 128)", fn, c->block_rows, MAX_DIM);
    } else {
        if (c->group_size != 0 && c->group_size != 32 && c->group_size != 64 && c->group_size != 128)
            return ktki_error(KTK_ERR_SHAPE, "%s: group_size = %d (expected 32, 64 or 128, or 0 for the default 64)",
                              fn, c->group_size);
        if (c->block_rows != 0)
            return ktki_error(KTK_ERR_SHAPE, "%s: block_rows = %d (only fp8 experts have block scales; expected 0)",
                              fn, c->block_rows);
    }
    if (c->activation != KTK_ACT_SILU && c->activation != KTK_ACT_GPTOSS && c->activation != KTK_ACT_SWIGLU_LIMIT)
        return ktki_error(KTK_ERR_DTYPE, "%s: activation = %d (expected KTK_ACT_SILU=0, KTK_ACT_GPTOSS=1 or "
                          "KTK_ACT_SWIGLU_LIMIT=2)", fn, c->activation);
    if (c->has_bias != 0 && c->has_bias != 1)
        return ktki_error(KTK_ERR_SHAPE, "%s: has_bias = %d (expected 0 or 1)", fn, c->has_bias);
    if (c->activation == KTK_ACT_GPTOSS && (!isfinite(c->alpha) || !(c->limit > 0.0f) || !isfinite(c->limit)))
        return ktki_error(KTK_ERR_SHAPE, "%s: gptoss activation needs finite alpha and limit > 0 (got alpha = %g, "
                          "limit = %g)", fn, (double)c->alpha, (double)c->limit);
    if (c->activation == KTK_ACT_SWIGLU_LIMIT && (!(c->limit > 0.0f) || !isfinite(c->limit)))
        return ktki_error(KTK_ERR_SHAPE, "%s: swiglu_limit activation needs a finite limit > 0 (got limit = %g)", fn,
                          (double)c->limit);
    int64_t H = c->hidden, I = c->intermediate;
    int64_t per = 3 * (H + 16) * (I + 64) * 2 + 3 * (H + I + 32) * 8;   /* upper bound of one expert's bytes */
    if (per * c->num_experts > MAX_NBYTES)
        return ktki_error(KTK_ERR_SHAPE, "%s: %d experts of hidden %d x intermediate %d need more than %lld bytes",
                          fn, c->num_experts, c->hidden, c->intermediate, MAX_NBYTES);
    return KTK_OK;
}

int ktk_experts_create(const ktk_experts_config *cfg, ktk_experts **out) {
    CHECK_NULL(out, "ktk_experts_create");
    *out = NULL;
    CHECK_NULL(cfg, "ktk_experts_create");
    int rc = ktki_dispatch_isa_check();
    if (rc == KTK_OK) rc = check_config(cfg);
    return rc == KTK_OK ? ktki_experts_create(cfg, out) : rc;
}

void ktk_experts_destroy(ktk_experts *ex) {
    if (ex) ktki_experts_destroy(ex);
}

int ktk_experts_set(ktk_experts *ex, int expert, int which, const void *src, int src_dtype, int64_t stride_out,
                    int64_t stride_in) {
    const char *fn = "ktk_experts_set";
    CHECK_NULL(ex, fn);
    CHECK_NULL(src, fn);
    int rc = check_expert(fn, ex, expert, which);
    if (rc == KTK_OK) rc = check_dtype(fn, "src_dtype", src_dtype, 1);
    if (rc != KTK_OK) return rc;
    if (stride_out <= -MAX_STRIDE || stride_out >= MAX_STRIDE || stride_in <= -MAX_STRIDE || stride_in >= MAX_STRIDE)
        return ktki_error(KTK_ERR_SHAPE, "%s: strides (stride_out = %lld, stride_in = %lld) out of range (expected "
                          "|stride| < 2^40 elements)", fn, (long long)stride_out, (long long)stride_in);
    return ktki_experts_set(ex, expert, which, src, src_dtype, stride_out, stride_in);
}

static int check_strides(const char *fn, int64_t qso, int64_t qsi, int64_t sso, int64_t ssg) {
    const int64_t s[4] = {qso, qsi, sso, ssg};
    for (int i = 0; i < 4; i++)
        if (s[i] <= -MAX_STRIDE || s[i] >= MAX_STRIDE)
            return ktki_error(KTK_ERR_SHAPE, "%s: a stride (%lld) is out of range (expected |stride| < 2^40 "
                              "elements)", fn, (long long)s[i]);
    return KTK_OK;
}

int ktk_experts_set_quantized(ktk_experts *ex, int expert, int which, const int8_t *q, int64_t q_stride_out,
                              int64_t q_stride_in, const float *scale, int64_t scale_stride_out,
                              int64_t scale_stride_group) {
    const char *fn = "ktk_experts_set_quantized";
    CHECK_NULL(ex, fn);
    CHECK_NULL(q, fn);
    CHECK_NULL(scale, fn);
    int rc = check_expert(fn, ex, expert, which);
    if (rc != KTK_OK) return rc;
    if (ex->cfg.quant != KTK_QUANT_INT8 && ex->cfg.quant != KTK_QUANT_INT4)
        return ktki_error(KTK_ERR_DTYPE, "%s: experts were created with quant %d; quantized values are stored only "
                          "in int8 (%d) or int4 (%d) experts%s", fn, ex->cfg.quant, KTK_QUANT_INT8, KTK_QUANT_INT4,
                          ex->cfg.quant == KTK_QUANT_FP8     ? " (fp8 experts take ktk_experts_set_fp8)"
                          : ex->cfg.quant == KTK_QUANT_MXFP4 ? " (mxfp4 experts take ktk_experts_set_mxfp4)"
                                                             : "");
    rc = check_strides(fn, q_stride_out, q_stride_in, scale_stride_out, scale_stride_group);
    if (rc != KTK_OK) return rc;
    return ktki_experts_set_quantized(ex, expert, which, q, q_stride_out, q_stride_in, scale, scale_stride_out,
                                      scale_stride_group);
}

int ktk_experts_set_fp8(ktk_experts *ex, int expert, int which, const uint8_t *q, int64_t q_stride_out,
                        int64_t q_stride_in, const float *scale, int64_t scale_stride_out, int64_t scale_stride_group) {
    const char *fn = "ktk_experts_set_fp8";
    CHECK_NULL(ex, fn);
    CHECK_NULL(q, fn);
    CHECK_NULL(scale, fn);
    int rc = check_expert(fn, ex, expert, which);
    if (rc != KTK_OK) return rc;
    if (ex->cfg.quant != KTK_QUANT_FP8)
        return ktki_error(KTK_ERR_DTYPE, "%s: experts were created with quant %d; float8 e4m3 values are stored only "
                          "in fp8 (%d) experts", fn, ex->cfg.quant, KTK_QUANT_FP8);
    rc = check_strides(fn, q_stride_out, q_stride_in, scale_stride_out, scale_stride_group);
    if (rc != KTK_OK) return rc;
    return ktki_experts_set_fp8(ex, expert, which, q, q_stride_out, q_stride_in, scale, scale_stride_out,
                                scale_stride_group);
}

int ktk_experts_set_mxfp4(ktk_experts *ex, int expert, int which, const uint8_t *blocks, int64_t blocks_stride_out,
                          const uint8_t *scales, int64_t scales_stride_out) {
    const char *fn = "ktk_experts_set_mxfp4";
    CHECK_NULL(ex, fn);
    CHECK_NULL(blocks, fn);
    CHECK_NULL(scales, fn);
    int rc = check_expert(fn, ex, expert, which);
    if (rc != KTK_OK) return rc;
    if (ex->cfg.quant != KTK_QUANT_MXFP4)
        return ktki_error(KTK_ERR_DTYPE, "%s: experts were created with quant %d; mxfp4 blocks are stored only in "
                          "mxfp4 (%d) experts", fn, ex->cfg.quant, KTK_QUANT_MXFP4);
    rc = check_strides(fn, blocks_stride_out, 1, scales_stride_out, 1);
    if (rc != KTK_OK) return rc;
    return ktki_experts_set_mxfp4(ex, expert, which, blocks, blocks_stride_out, scales, scales_stride_out);
}

int ktk_experts_set_bias(ktk_experts *ex, int expert, int which, const void *src, int src_dtype) {
    const char *fn = "ktk_experts_set_bias";
    CHECK_NULL(ex, fn);
    CHECK_NULL(src, fn);
    int rc = check_expert(fn, ex, expert, which);
    if (rc == KTK_OK) rc = check_dtype(fn, "src_dtype", src_dtype, 1);
    if (rc != KTK_OK) return rc;
    if (!ex->cfg.has_bias)
        return ktki_error(KTK_ERR_STATE, "%s: experts were created with has_bias = 0 (no %s bias to set)", fn,
                          mat_name(which));
    return ktki_experts_set_bias(ex, expert, which, src, src_dtype);
}

int ktk_experts_get(const ktk_experts *ex, int expert, int which, float *dst) {
    const char *fn = "ktk_experts_get";
    CHECK_NULL(ex, fn);
    CHECK_NULL(dst, fn);
    int rc = check_expert(fn, ex, expert, which);
    return rc == KTK_OK ? ktki_experts_get(ex, expert, which, dst) : rc;
}

int64_t ktk_experts_nbytes(const ktk_experts *ex) {
    if (!ex) return -ktki_error(KTK_ERR_NULL, "ktk_experts_nbytes: argument 'ex' is NULL");
    return ex->nbytes;
}

static int check_size(const char *fn, const ktk_experts *ex, int64_t size) {
    if (size != ex->nbytes)
        return ktki_error(KTK_ERR_SHAPE, "%s: size = %lld bytes, expected ktk_experts_nbytes = %lld", fn,
                          (long long)size, (long long)ex->nbytes);
    return KTK_OK;
}

int ktk_experts_export(const ktk_experts *ex, void *dst, int64_t size) {
    CHECK_NULL(ex, "ktk_experts_export");
    CHECK_NULL(dst, "ktk_experts_export");
    int rc = check_size("ktk_experts_export", ex, size);
    if (rc == KTK_OK) memcpy(dst, ex->base, (size_t)size);
    return rc;
}

int ktk_experts_import(ktk_experts *ex, const void *src, int64_t size) {
    CHECK_NULL(ex, "ktk_experts_import");
    CHECK_NULL(src, "ktk_experts_import");
    int rc = check_size("ktk_experts_import", ex, size);
    return rc == KTK_OK ? ktki_experts_import(ex, src, size) : rc;
}

/* ---- zero-copy views ---- */
int ktk_experts_raw(const ktk_experts *ex, int expert, int which, ktk_raw *out) {
    const char *fn = "ktk_experts_raw";
    CHECK_NULL(ex, fn);
    CHECK_NULL(out, fn);
    int rc = check_expert(fn, ex, expert, which);
    if (rc != KTK_OK) return rc;
    return ktki_experts_raw(ex, expert, which, out);
}

int ktk_experts_region(const ktk_experts *ex, const void **base, int64_t *nbytes) {
    CHECK_NULL(ex, "ktk_experts_region");
    CHECK_NULL(base, "ktk_experts_region");
    CHECK_NULL(nbytes, "ktk_experts_region");
    *base = ex->base;
    *nbytes = ex->nbytes;
    return KTK_OK;
}

/* ---- tasks ---- */
int ktk_task_create(ktk_pool *pool, ktk_task **out) {
    CHECK_NULL(out, "ktk_task_create");
    *out = NULL;
    CHECK_NULL(pool, "ktk_task_create");
    if (ktki_pool_stopped(pool)) return ktki_error(KTK_ERR_STATE, "ktk_task_create: the pool is destroyed");
    ktk_task *t = aligned_alloc(64, (sizeof(ktk_task) + 63) & ~(size_t)63);
    if (!t) return ktki_error(KTK_ERR_NOMEM, "ktk_task_create: out of memory");
    ktki_task_init(t, pool);
    ktki_pool_retain(pool);   /* the pool's memory outlives its tasks (ktk_pool_destroy may come first) */
    *out = t;
    return KTK_OK;
}

void ktk_task_destroy(ktk_task *task) {
    if (!task) return;
    ktk_pool *pool = task->pool;
    ktki_task_finish(task);
    free(task);
    ktki_pool_release(pool);
}

static int check_forward(const char *fn, ktk_experts *ex, int T, int k, const void *hidden, int hidden_dtype,
                         const int64_t *ids, const void *weights, int weights_dtype, void *out, int out_dtype) {
    CHECK_NULL(ex, fn);
    CHECK_NULL(hidden, fn);
    CHECK_NULL(ids, fn);
    CHECK_NULL(weights, fn);
    CHECK_NULL(out, fn);
    int rc = ktki_dispatch_isa_check();
    if (rc != KTK_OK) return rc;
    if (T < 1 || T > MAX_TOKENS)
        return ktki_error(KTK_ERR_SHAPE, "%s: T = %d tokens (expected 1..%d)", fn, T, MAX_TOKENS);
    if (k < 1 || k > MAX_K || k > ex->cfg.num_experts)
        return ktki_error(KTK_ERR_SHAPE, "%s: k = %d experts per token (expected 1 <= k <= min(E = %d, %d))", fn, k,
                          ex->cfg.num_experts, MAX_K);
    rc = check_dtype(fn, "hidden_dtype", hidden_dtype, 1);
    if (rc == KTK_OK) rc = check_dtype(fn, "weights_dtype", weights_dtype, 0);
    if (rc == KTK_OK) rc = check_dtype(fn, "out_dtype", out_dtype, 0);
    return rc;
}

int ktk_task_bind(ktk_task *task, ktk_experts *ex, int T, int k, const void *hidden, int hidden_dtype,
                  const int64_t *ids, const void *weights, int weights_dtype, const uint8_t *skip, void *out,
                  int out_dtype) {
    CHECK_NULL(task, "ktk_task_bind");
    int rc = check_forward("ktk_task_bind", ex, T, k, hidden, hidden_dtype, ids, weights, weights_dtype, out,
                           out_dtype);
    return rc == KTK_OK ? ktki_task_bind(task, ktki_forward_step, ex, T, k, hidden, hidden_dtype, ids, weights,
                                         weights_dtype, skip, out, out_dtype) : rc;
}

int ktk_submit(ktk_task *task) {
    CHECK_NULL(task, "ktk_submit");
    return ktki_task_submit(task);
}

int ktk_wait(ktk_task *task) {
    CHECK_NULL(task, "ktk_wait");
    return ktki_task_wait(task);
}

void ktk_submit_fn(void *task) {
    if (task) ktki_task_submit_fn(task);
}

void ktk_wait_fn(void *task) {
    if (task) ktki_task_wait_fn(task);
}

int ktk_forward(ktk_pool *pool, ktk_experts *ex, int T, int k, const void *hidden, int hidden_dtype,
                const int64_t *ids, const void *weights, int weights_dtype, const uint8_t *skip, void *out,
                int out_dtype) {
    CHECK_NULL(pool, "ktk_forward");
    int rc = check_forward("ktk_forward", ex, T, k, hidden, hidden_dtype, ids, weights, weights_dtype, out,
                           out_dtype);
    return rc == KTK_OK ? ktki_forward(pool, ex, T, k, hidden, hidden_dtype, ids, weights, weights_dtype, skip, out,
                                       out_dtype) : rc;
}

int ktk_backward(ktk_pool *pool, ktk_experts *ex, int T, int k, const void *hidden, int hidden_dtype,
                 const int64_t *ids, const void *weights, int weights_dtype, const uint8_t *skip, const void *dy,
                 int dy_dtype, void *dx, int dx_dtype, float *dweights) {
    const char *fn = "ktk_backward";
    CHECK_NULL(pool, fn);
    CHECK_NULL(dy, fn);
    if (!dx && !dweights)
        return ktki_error(KTK_ERR_NULL, "%s: dx and dweights are both NULL (nothing to compute: pass one)", fn);
    int rc = check_dtype(fn, "dy_dtype", dy_dtype, 0);
    if (rc == KTK_OK && dx) rc = check_dtype(fn, "dx_dtype", dx_dtype, 0);
    /* the forward's own checks (dy in out's place: checked above, named there) */
    if (rc == KTK_OK)
        rc = check_forward(fn, ex, T, k, hidden, hidden_dtype, ids, weights, weights_dtype, (void *)dy, dy_dtype);
    return rc == KTK_OK ? ktki_backward(pool, ex, T, k, hidden, hidden_dtype, ids, weights, weights_dtype, skip, dy,
                                        dy_dtype, dx, dx_dtype, dweights) : rc;
}

#define MAX_ROWS (1 << 28)         /* rows of one projection (T x k) */

int ktk_experts_project(ktk_pool *pool, ktk_experts *ex, int which, int R, const int64_t *expert_of_row,
                        const void *x, int x_dtype, void *y, int y_dtype, int transpose, int precision) {
    const char *fn = "ktk_experts_project";
    CHECK_NULL(pool, fn);
    CHECK_NULL(ex, fn);
    int rc = check_expert(fn, ex, 0, which);
    if (rc != KTK_OK) return rc;
    if (transpose != 0 && transpose != 1)
        return ktki_error(KTK_ERR_SHAPE, "%s: transpose = %d (expected 0: y = W x, or 1: y = W^T x)", fn, transpose);
    if (precision != KTK_PRECISION_FLOAT && precision != KTK_PRECISION_BF16)
        return ktki_error(KTK_ERR_DTYPE, "%s: precision = %d (expected KTK_PRECISION_FLOAT = 0: float products, or "
                          "KTK_PRECISION_BF16 = 1: bf16 products)", fn, precision);
    if (R < 0 || R > MAX_ROWS)
        return ktki_error(KTK_ERR_SHAPE, "%s: R = %d rows (expected 0..%d)", fn, R, MAX_ROWS);
    rc = check_dtype(fn, "x_dtype", x_dtype, 1);
    if (rc == KTK_OK) rc = check_dtype(fn, "y_dtype", y_dtype, 0);
    if (rc == KTK_OK) rc = ktki_dispatch_isa_check();
    if (rc != KTK_OK || R == 0) return rc;
    CHECK_NULL(expert_of_row, fn);
    CHECK_NULL(x, fn);
    CHECK_NULL(y, fn);
    return ktki_project(pool, ex, which, R, expert_of_row, x, x_dtype, y, y_dtype, transpose, precision);
}

#define MAX_RANK 1024

static int check_lora(const char *fn, ktk_pool *pool, ktk_experts *ex, int which, int R, int rank) {
    CHECK_NULL(pool, fn);
    CHECK_NULL(ex, fn);
    int rc = check_expert(fn, ex, 0, which);
    if (rc != KTK_OK) return rc;
    if (R < 0 || R > MAX_ROWS)
        return ktki_error(KTK_ERR_SHAPE, "%s: R = %d rows (expected 0..%d)", fn, R, MAX_ROWS);
    if (rank < 1 || rank > MAX_RANK)
        return ktki_error(KTK_ERR_SHAPE, "%s: rank = %d (expected 1..%d)", fn, rank, MAX_RANK);
    return ktki_dispatch_isa_check();
}

int ktk_experts_lora(ktk_pool *pool, ktk_experts *ex, int which, int R, int rank, const int64_t *expert_of_row,
                     const float *z, const float *a, const float *bt, float *t, float *y) {
    const char *fn = "ktk_experts_lora";
    int rc = check_lora(fn, pool, ex, which, R, rank);
    if (rc != KTK_OK || R == 0) return rc;
    CHECK_NULL(expert_of_row, fn);
    CHECK_NULL(z, fn);
    CHECK_NULL(a, fn);
    CHECK_NULL(bt, fn);
    CHECK_NULL(t, fn);
    CHECK_NULL(y, fn);
    return ktki_lora(pool, ex, which, R, rank, expert_of_row, z, a, bt, t, y);
}

int ktk_experts_lora_backward(ktk_pool *pool, ktk_experts *ex, int which, int R, int rank,
                              const int64_t *expert_of_row, const float *z, const float *t, const float *dy,
                              const float *a, const float *bt, float *dt, float *dz, float *da, float *dbt) {
    const char *fn = "ktk_experts_lora_backward";
    int rc = check_lora(fn, pool, ex, which, R, rank);
    if (rc != KTK_OK) return rc;
    CHECK_NULL(da, fn);
    CHECK_NULL(dbt, fn);
    if (R == 0) {
        const size_t E = (size_t)ex->cfg.num_experts, r = (size_t)rank;
        memset(da, 0, E * r * (size_t)ex->in_k[which] * sizeof *da);
        memset(dbt, 0, E * r * (size_t)ex->out_n[which] * sizeof *dbt);
        return KTK_OK;
    }
    CHECK_NULL(expert_of_row, fn);
    CHECK_NULL(z, fn);
    CHECK_NULL(t, fn);
    CHECK_NULL(dy, fn);
    CHECK_NULL(a, fn);
    CHECK_NULL(bt, fn);
    CHECK_NULL(dt, fn);
    CHECK_NULL(dz, fn);
    return ktki_lora_backward(pool, ex, which, R, rank, expert_of_row, z, t, dy, a, bt, dt, dz, da, dbt);
}

int ktk_task_watch(ktk_task *task, volatile uint32_t *go, volatile uint32_t *done) {
    return ktk_task_watch_then(task, go, done, NULL);
}

int ktk_task_watch_then(ktk_task *task, volatile uint32_t *go, volatile uint32_t *done, volatile uint32_t *then) {
    CHECK_NULL(task, "ktk_task_watch");
    CHECK_NULL(go, "ktk_task_watch");
    CHECK_NULL(done, "ktk_task_watch");
    if (((uintptr_t)go & 3) || ((uintptr_t)done & 3) || ((uintptr_t)then & 3))
        return ktki_error(KTK_ERR_SHAPE, "ktk_task_watch: go, done and then must be 4-byte aligned (got %p, %p, %p)",
                          (void *)go, (void *)done, (void *)then);
    if (then && (then == go || then == done))
        return ktki_error(KTK_ERR_SHAPE, "ktk_task_watch_then: then must be another task's go word, not this task's "
                          "go or done");
    return ktki_task_watch(task, go, done, then);
}

int ktk_task_select(ktk_task *task, int slots, int d) {
    CHECK_NULL(task, "ktk_task_select");
    return ktki_task_select(task, slots, d);
}

int ktk_task_select_share(ktk_task *task, int slots, float share) {
    CHECK_NULL(task, "ktk_task_select_share");
    return ktki_task_select_share(task, slots, share);
}

int ktk_task_split(ktk_task *task, int d, float share, void *out2, volatile uint32_t *done_top) {
    CHECK_NULL(task, "ktk_task_split");
    CHECK_NULL(out2, "ktk_task_split (out2)");
    return ktki_task_split(task, d, share, out2, done_top);
}

int ktk_task_signal(ktk_task *task, volatile uint32_t *done) {
    CHECK_NULL(task, "ktk_task_signal");
    if ((uintptr_t)done & 3)
        return ktki_error(KTK_ERR_SHAPE, "ktk_task_signal: done must be 4-byte aligned (got %p)", (void *)done);
    return ktki_task_signal(task, done);
}

int ktk_task_times(ktk_task *task, int64_t *begin_ns, int64_t *end_ns) {
    CHECK_NULL(task, "ktk_task_times");
    CHECK_NULL(begin_ns, "ktk_task_times (begin_ns)");
    CHECK_NULL(end_ns, "ktk_task_times (end_ns)");
    if (task->watched)   /* a pool thread may start it (and write the times) whenever its go word is raised */
        return ktki_error(KTK_ERR_STATE, "ktk_task_times: task is watched (ktk_task_unwatch first)");
    if (atomic_load_explicit(&task->state, memory_order_acquire) != KTKI_TASK_IDLE)
        return ktki_error(KTK_ERR_STATE, "ktk_task_times: task is queued or running (ktk_wait first)");
    *begin_ns = task->begin_ns;
    *end_ns = task->end_ns;
    return KTK_OK;
}

uint64_t ktk_task_slots_rest(ktk_task *task, int reset) {
    if (!task) return 0;
    return reset ? atomic_exchange(&task->slots_rest, 0) : atomic_load(&task->slots_rest);
}

uint64_t ktk_task_slots_run(ktk_task *task, int reset) {
    if (!task) return 0;
    return reset ? atomic_exchange(&task->slots_run, 0) : atomic_load(&task->slots_run);
}

int ktk_task_unwatch(ktk_task *task) {
    CHECK_NULL(task, "ktk_task_unwatch");
    return ktki_task_unwatch(task);
}

/* ---- GGUF K-quant blocks ---- */
#define MAX_GGUF_BLOCKS (1LL << 36)

int ktk_gguf_dequantize(int qtype, const uint8_t *blocks, int64_t nblocks, float *out) {
    const char *fn = "ktk_gguf_dequantize";
    if (ktki_gguf_dequant_block_bytes(qtype) == 0)
        return ktki_error(KTK_ERR_DTYPE, "%s: qtype = %d is not a K-quant (expected KTK_GGUF_Q4_K=12, "
                          "KTK_GGUF_Q5_K=13 or KTK_GGUF_Q6_K=14)", fn, qtype);
    if (nblocks < 0 || nblocks > MAX_GGUF_BLOCKS)
        return ktki_error(KTK_ERR_SHAPE, "%s: nblocks = %lld is out of range (expected 0..2^36)", fn,
                          (long long)nblocks);
    if (nblocks == 0) return KTK_OK;
    CHECK_NULL(blocks, fn);
    CHECK_NULL(out, fn);
    ktki_gguf_dequant(qtype, blocks, nblocks, out);
    return KTK_OK;
}
