/* ktinject native core: the one public header.
 *
 * Torch-free, CUDA-free C with a stable ABI. Opaque handles, int error codes (KTK_OK == 0), a thread-local
 * message for the last error (ktk_last_error). Every entry point checks its arguments and never crashes on bad
 * input: it returns an error code and sets the message.
 *
 * Legend: T tokens, k experts per token, E experts, H hidden size, I expert intermediate size.
 * Semantics of a forward, for every token t:
 *     out[t] = sum_{j < k, !skip[ids[t,j]]} w[t,j] * down_e( act(gate_e(x_t), up_e(x_t)) ),  e = ids[t,j]
 *   act = KTK_ACT_SILU:   silu(g) * u
 *   act = KTK_ACT_GPTOSS: g' = min(g, limit); u' = clamp(u, -limit, limit); g' * sigmoid(alpha * g') * (u' + 1)
 *   act = KTK_ACT_SWIGLU_LIMIT: g', u' as for KTK_ACT_GPTOSS; silu(g') * u'  (DeepSeek-V4's clamped SwiGLU)
 *   (with optional per-expert biases on gate, up (before act) and down (before the routing weight)).
 * Quantization: KTK_QUANT_BF16 keeps bf16 weights; KTK_QUANT_INT8 is W8A8: weights symmetric int8 per output
 * channel (quantized at load), activations symmetric int8 per token (quantized on the fly), int32 accumulation.
 * KTK_QUANT_INT4 is W4A8: weights int4 in [-8, 7] with a float scale per (output channel, group of group_size
 * inputs), rounded to nearest at load (the value of largest magnitude in a group maps to -8 exactly); activations
 * as for int8; exact int32 per group, float accumulation across groups. Many rows per expert (prefill) may instead
 * run on weights dequantized to bf16 (AMX-BF16), chosen per call by row count.
 * KTK_QUANT_FP8 is W8A16: weights float8 e4m3 (OCP e4m3fn: no infinities, 0x7F / 0xFF are NaN, largest 448) with a
 * float scale per block of block_rows output rows x group_size inputs (value = e4m3 * scale: the FP8 releases'
 * weight_scale_inv, kept bit for bit by ktk_experts_set_fp8; ktk_experts_set quantizes per block: scale = amax / 448,
 * e4m3 rounded to nearest even); activations bf16 as for KTK_QUANT_BF16, float accumulation (per group, then times
 * the group's scale). Many rows per expert (prefill) may instead run on weights dequantized to bf16(e4m3 * scale)
 * (AMX-BF16), chosen per call by row count.
 * KTK_QUANT_MXFP4 is W4A16, the OCP microscaling FP4 of the MXFP4 releases (gpt-oss, DeepSeek-V4-Flash): weights
 * e2m1 (4 bits: sign, 2 exponent bits of bias 1, 1 mantissa bit; values 0, 0.5, 1, 1.5, 2, 3, 4, 6 and their
 * negatives), two to a byte, the lower input in the low nibble (the release's bytes), with one e8m0 byte e per
 * (output row, group of 32 inputs): value = e2m1 * 2^(e - 127) (e in 0..254; 255, e8m0's NaN, is refused). group_size
 * is 32 (0 means 32), hidden and intermediate multiples of 32. 4.25 bits a weight. ktk_experts_set_mxfp4 keeps a
 * release's bits; ktk_experts_set quantizes per group of 32: e = the smallest exponent with amax / 2^(e-127) <= 6,
 * e2m1 rounded to nearest even. Activations bf16 as for KTK_QUANT_BF16, float accumulation (per group, then times
 * 2^(e - 127)). Many rows per expert (prefill) may instead run on weights dequantized to bf16 (exact: e2m1 * 2^k
 * has two significant bits), chosen per call by row count. AMX hosts run the AVX-512 mxfp4 kernels.
 */
#ifndef KTINJECT_H
#define KTINJECT_H
#include <stdint.h>
#include <stddef.h>

#ifdef __cplusplus
extern "C" {
#endif

/* ---- error codes ---- */
#define KTK_OK 0
#define KTK_ERR_NULL 1        /* a required pointer is NULL */
#define KTK_ERR_SHAPE 2       /* a size is out of range or inconsistent */
#define KTK_ERR_RANGE 3       /* an index (expert id, expert number) is out of range */
#define KTK_ERR_DTYPE 4       /* unsupported dtype / quant / activation code */
#define KTK_ERR_ISA 5         /* requested ISA not available on this CPU/OS */
#define KTK_ERR_NOMEM 6       /* allocation failed */
#define KTK_ERR_STATE 7       /* object in the wrong state (e.g. weights not set, task busy) */
#define KTK_ERR_THREAD 8      /* thread creation failed */

/* ---- dtypes ---- */
#define KTK_DTYPE_F32 0
#define KTK_DTYPE_BF16 1
#define KTK_DTYPE_F16 2

/* ---- quantization of stored expert weights ---- */
#define KTK_QUANT_BF16 0
#define KTK_QUANT_INT8 1
#define KTK_QUANT_INT4 2   /* needs ktk_experts_config.group_size */
#define KTK_QUANT_FP8 3    /* ktk_experts_config.group_size and block_rows: the scale blocks */
#define KTK_QUANT_MXFP4 4  /* group_size 32 (or 0); hidden and intermediate multiples of 32 */

/* ---- activations ---- */
#define KTK_ACT_SILU 0
#define KTK_ACT_GPTOSS 1
#define KTK_ACT_SWIGLU_LIMIT 2

/* ---- which matrix of an expert ---- */
#define KTK_MAT_GATE 0  /* [I, H]: out = I, in = H */
#define KTK_MAT_UP 1    /* [I, H] */
#define KTK_MAT_DOWN 2  /* [H, I]: out = H, in = I */

/* ---- ISAs (ordered: a higher value is a faster path) ---- */
#define KTK_ISA_GENERIC 0
#define KTK_ISA_AVX2 1    /* AVX2 + FMA + F16C */
#define KTK_ISA_AVX512 2  /* AVX-512 F/BW/VL (+ BF16 / VNNI used when present) */
#define KTK_ISA_AMX 3     /* AMX-TILE + AMX-BF16 + AMX-INT8 with OS permission, plus AVX512 for small T */

/* ---- CPU feature bits (ktk_cpu_features) ---- */
#define KTK_CPU_AVX2 (1u << 0)
#define KTK_CPU_FMA (1u << 1)
#define KTK_CPU_F16C (1u << 2)
#define KTK_CPU_AVX512F (1u << 3)
#define KTK_CPU_AVX512BW (1u << 4)
#define KTK_CPU_AVX512VL (1u << 5)
#define KTK_CPU_AVX512_BF16 (1u << 6)
#define KTK_CPU_AVX512_VNNI (1u << 7)
#define KTK_CPU_AMX_TILE (1u << 8)
#define KTK_CPU_AMX_BF16 (1u << 9)
#define KTK_CPU_AMX_INT8 (1u << 10)
#define KTK_CPU_AMX_OS (1u << 11)   /* the OS granted AMX tile state (arch_prctl ARCH_REQ_XCOMP_PERM) */
#define KTK_CPU_AVX512_FP16 (1u << 12)
#define KTK_CPU_AVX_VNNI (1u << 13)

/* ---- library ---- */
const char *ktk_version(void);        /* "MAJOR.MINOR.PATCH" */
uint32_t ktk_cpu_features(void);      /* KTK_CPU_* bits; asks the OS for AMX permission once */
int ktk_isa_best(void);               /* best ISA this CPU/OS supports */
int ktk_isa_available(int isa);       /* 1 if this CPU/OS and this build have the ISA, else 0 */
/* ISA in use: the last ktk_isa_set, else the KTINJECT_ISA env var (generic|avx2|avx512|amx), else best.
 * A KTINJECT_ISA that is unknown or unavailable is an error, not a silent fallback: until ktk_isa_set picks an ISA,
 * ktk_isa_get returns -KTK_ERR_ISA and ktk_experts_create, ktk_task_bind and ktk_forward fail with KTK_ERR_ISA,
 * the message (ktk_last_error) naming the variable and its value. */
int ktk_isa_get(void);
int ktk_isa_set(int isa);             /* force an ISA (KTK_ERR_ISA if unavailable); affects later forwards */
const char *ktk_isa_name(int isa);    /* "generic", "avx2", "avx512", "amx"; NULL if out of range */
const char *ktk_last_error(void);     /* message of the last error on this thread ("" if none) */
int ktk_physical_cores(void);         /* physical cores (not hyper-threads) available to this process */

/* ---- thread pool ---- */
typedef struct ktk_pool ktk_pool;
/* nthreads <= 0: physical cores. Threads start at once, pinned to cores when pin != 0 (env KTINJECT_PIN=0/1
 * overrides), and stay. A forward's work is claimed in small chunks by whichever threads are there: a thread that
 * loses its core to another process holds up at most its chunk. */
int ktk_pool_create(int nthreads, int pin, ktk_pool **out);
int ktk_pool_threads(const ktk_pool *pool);
/* Watch spin window, in microseconds: while tasks are watched (ktk_task_watch), the pool's threads keep spinning
 * (instead of sleeping on a futex) while a watched run started or ended, or ktk_pool_wake was called, within this
 * window, so a raised go flag starts them at once, with no futex wake-up. 0: they sleep after the ordinary short spin
 * (KTINJECT_SPIN_US, 50 us). Default: env KTINJECT_WATCH_SPIN_US, else 1000. Range 0..10000000 (else
 * KTK_ERR_SHAPE). */
int ktk_pool_set_watch_spin_us(ktk_pool *pool, int64_t us);
int64_t ktk_pool_watch_spin_us(const ktk_pool *pool);   /* -KTK_ERR_NULL for NULL */
/* While tasks are watched: open the watch spin window now and wake sleeping threads (they spin, ready for a go
 * flag). Call shortly before a CUDA graph that raises go flags is replayed. A no-op when nothing is watched. */
int ktk_pool_wake(ktk_pool *pool);
/* Profile of the pool's jobs (forwards), for measurements: with on != 0 the pool times every job, each of its
 * parallel phases (from its publication to its last chunk's end) and the chunks each thread runs, summed from
 * the next job on (a toggle takes effect at the next job); off stops (the sums stay). ktk_pool_profile copies
 * min(n, KTK_PROFILE_LEN) sums into out and zeroes all of them: [0] jobs, [1] their ns (from a job's start to its
 * end), then for the i-th parallel phase of a job (i < KTK_PROFILE_PHASES; later phases count as the last) at
 * 2 + 4 i: phases, wall ns, ns the threads spent in its chunks, chunks; then at KTK_PROFILE_DECODE the forwards of
 * at most KTK_PROFILE_DECODE_T tokens (decode steps, not prompts), their active experts (the distinct experts they
 * read) and their tokens; then at KTK_PROFILE_TOP the split tasks' (expert deferral) immediate parts: how many
 * raised their done word during their job and the ns from its start to it (the part the GPU waits for; a run that
 * fails, or has nothing to compute, raises it at its end, not counted); then at KTK_PROFILE_HEAD the ns from the
 * jobs' starts to their first parallel phase (routing, gather, planning: the serial head of a job). Serial steps
 * (routing, one-item phases) are a job's time outside its phases. Returns the count copied, or -KTK_ERR_NULL for a
 * NULL pool (or a NULL out with n > 0). */
#define KTK_PROFILE_PHASES 8
#define KTK_PROFILE_DECODE (2 + 4 * KTK_PROFILE_PHASES)
#define KTK_PROFILE_TOP (KTK_PROFILE_DECODE + 3)
#define KTK_PROFILE_HEAD (KTK_PROFILE_TOP + 2)
#define KTK_PROFILE_LEN (KTK_PROFILE_HEAD + 1)
#define KTK_PROFILE_DECODE_T 16
int ktk_pool_set_profile(ktk_pool *pool, int on);
int ktk_pool_profile(ktk_pool *pool, int64_t *out, int n);
/* Runs queued work, stops the threads (tasks still watched stop being watched); NULL is a no-op. Its tasks may be
 * destroyed before or after it (the memory is freed with the last); other calls on them fail with KTK_ERR_STATE. */
void ktk_pool_destroy(ktk_pool *pool);

/* ---- experts of one MoE layer ---- */
typedef struct ktk_experts ktk_experts;
typedef struct {
    int32_t num_experts;   /* E >= 1 */
    int32_t hidden;        /* H >= 1 */
    int32_t intermediate;  /* I >= 1 */
    int32_t quant;         /* KTK_QUANT_* */
    int32_t activation;    /* KTK_ACT_* */
    int32_t has_bias;      /* gpt-oss: per-expert biases on gate, up and down */
    float alpha;           /* KTK_ACT_GPTOSS */
    float limit;           /* KTK_ACT_GPTOSS, KTK_ACT_SWIGLU_LIMIT: > 0 */
    int32_t group_size;    /* KTK_QUANT_INT4: inputs per scale, 32, 64 or 128 (0: 64); KTK_QUANT_FP8: inputs per
                              scale, a multiple of 16 up to 512 (0: 128); KTK_QUANT_MXFP4: 32 (0: 32); else 0 (or
                              one of 32, 64, 128) */
    int32_t block_rows;    /* KTK_QUANT_FP8: output rows per scale, a multiple of 16 up to 2^20 (0: 128); else 0 */
} ktk_experts_config;

/* Allocates the packed storage (weights zero until set; a forward routing a token to an expert, not skipped, whose
 * gate, up or down was never set fails with KTK_ERR_STATE; biases default to zero). */
int ktk_experts_create(const ktk_experts_config *cfg, ktk_experts **out);
void ktk_experts_destroy(ktk_experts *ex);
/* Copy + repack (and quantize) one matrix of one expert from any strided source:
 * element (n, c) (n = output row, c = input column) is at src[n * stride_out + c * stride_in] (in elements).
 * E.g. HF gate_up_proj [E, 2I, H]: gate of expert e = gate_up + e*2I*H, stride_out = H, stride_in = 1;
 * gpt-oss gate_up_proj [E, H, 2I] interleaved: gate = base + e*H*2I + 0, up = ... + 1, stride_out = 2, stride_in = 2I.
 * fp8 experts quantize per block of block_rows x group_size: scale = amax / 448 (1 for an all-zero block; NaN, with
 * every q 0, for a block holding an inf or NaN), q = e4m3 of w / scale rounded to nearest even (subnormals down to
 * 2^-9), saturating at +-448.
 * mxfp4 experts quantize per (row, group of 32): e = the smallest e8m0 exponent (>= 0) with amax <= 6 * 2^(e - 127)
 * (e 127 for an all-zero group), q = e2m1 of w / 2^(e - 127) rounded to nearest even, saturating at +-6;
 * KTK_ERR_RANGE (naming the element; nothing stored) for an inf or NaN.
 * The caller may free the source afterwards. Thread-safe for different (expert, which). */
int ktk_experts_set(ktk_experts *ex, int expert, int which, const void *src, int src_dtype,
                    int64_t stride_out, int64_t stride_in);
/* One int8 or int4 matrix of one expert from values already quantized (a checkpoint that ships them: GGUF Q4_0,
 * compressed-tensors int4), stored as given, without rounding again: q (n, c) = q[n * q_stride_out + c * q_stride_in]
 * (int8: -127..127; int4: -8..7), its scale at scale[n * scale_stride_out + g * scale_stride_group] (int8: g = 0, one
 * per output row; int4: g = c / group_size, g < ceil(K / group_size)), value = q * scale. KTK_ERR_DTYPE for bf16
 * and fp8 experts (fp8: ktk_experts_set_fp8), KTK_ERR_RANGE (naming the element) for a q out of range or a
 * non-finite scale (nothing is set then). Thread-safe for different (expert, which). */
int ktk_experts_set_quantized(ktk_experts *ex, int expert, int which, const int8_t *q, int64_t q_stride_out,
                              int64_t q_stride_in, const float *scale, int64_t scale_stride_out,
                              int64_t scale_stride_group);
/* One fp8 matrix of one expert from float8 e4m3 values and their block scales (an FP8 release: weight and
 * weight_scale_inv), stored as given, bit for bit: the e4m3 bits of (n, c) are q[n * q_stride_out + c * q_stride_in],
 * its scale scale[(n / block_rows) * scale_stride_out + (c / group_size) * scale_stride_group] (block_rows, group_size
 * of the config; n / block_rows < ceil(out / block_rows), c / group_size < ceil(in / group_size)), value = e4m3 *
 * scale (a scale may be negative or zero). KTK_ERR_DTYPE for experts of another quant, KTK_ERR_RANGE (naming the
 * element or block, the expert and the matrix) for a NaN code (0x7F, 0xFF) or a non-finite scale: everything is
 * checked before a byte is stored. Thread-safe for different (expert, which). */
int ktk_experts_set_fp8(ktk_experts *ex, int expert, int which, const uint8_t *q, int64_t q_stride_out,
                        int64_t q_stride_in, const float *scale, int64_t scale_stride_out, int64_t scale_stride_group);
/* One mxfp4 matrix of one expert as an MXFP4 release ships it (*_blocks, *_scales), bit for bit: row n's K / 2 bytes
 * of e2m1 pairs (input 2i in the low nibble of byte i, 2i + 1 in the high one) at blocks + n * blocks_stride_out, its
 * K / 32 e8m0 bytes at scales + n * scales_stride_out (in bytes). KTK_ERR_DTYPE for experts of another quant,
 * KTK_ERR_RANGE (naming the row, group, expert and matrix) for a scale byte 255 (e8m0's NaN): everything is checked
 * before a byte is stored. Thread-safe for different (expert, which). */
int ktk_experts_set_mxfp4(ktk_experts *ex, int expert, int which, const uint8_t *blocks, int64_t blocks_stride_out,
                          const uint8_t *scales, int64_t scales_stride_out);
/* Bias of one matrix of one expert (has_bias only): [out] contiguous, src_dtype F32/BF16/F16. */
int ktk_experts_set_bias(ktk_experts *ex, int expert, int which, const void *src, int src_dtype);
/* Read back one matrix, dequantized, as float32 [out, in] row-major (tests, GPU upload of hot experts). */
int ktk_experts_get(const ktk_experts *ex, int expert, int which, float *dst);
/* Bytes of packed weights (and scales, biases) held. */
int64_t ktk_experts_nbytes(const ktk_experts *ex);
/* Copy the packed bytes out / in (cache of packed weights): size == ktk_experts_nbytes. */
int ktk_experts_export(const ktk_experts *ex, void *dst, int64_t size);
int ktk_experts_import(ktk_experts *ex, const void *src, int64_t size);

/* ---- zero-copy views of the packed weights (GPU upload of hot experts: copy the bytes, unpack on the device) ----
 * Pointers into the experts' packed storage: valid while the experts live, read-only for the caller, and the bytes
 * change only through ktk_experts_set / set_bias / import. Layouts are the ones of native/src/kernels/kernels.h:
 *   bf16: data = uint16 (bf16 bits) [Np/16][Kp/2][16][2]: element (n, c) at ((n/16)*(Kp/2) + c/2)*32 + (n%16)*2 + c%2
 *   int8: data = int8 [Np/16][Kp/4][16][4]: element (n, c) at ((n/16)*(Kp/4) + c/4)*64 + (n%16)*4 + c%4,
 *         dequantized value = (float)q * scale[n] (what ktk_experts_get returns)
 *   int4: data = nibbles [Np/16][Kp/8][16][4]: element (n, c) in byte ((n/16)*(Kp/8) + c/8)*64 + (n%16)*4 + c%4,
 *         bits 0-3 when (c/4)%2 == 0 else bits 4-7, a two's complement q in [-8, 7]; scale = float
 *         [Np/16][Kp/G][16] (G = the config's group_size): value = (float)q * scale[((n/16)*(Kp/G) + c/G)*16 + n%16]
 *   fp8:  data = e4m3 bytes [Np/16][Kp][16]: element (n, c) at ((n/16)*Kp + c)*16 + n%16 (16 outputs of one input are
 *         16 consecutive bytes); scale = float [Np/16][ng], ng = ceil(Kp/G) (G = the config's group_size; each 16-row
 *         block holds its block_rows block's scale): value = (float)e4m3 * scale[(n/16)*ng + c/G]
 *   mxfp4: data = e2m1 nibbles [Np/16][Kp/8][16][4]: element (n, c) in byte ((n/16)*(Kp/8) + c/8)*64 + (n%16)*4 +
 *         (c%8)/2, the low nibble for even c (each 4-byte word: 4 consecutive bytes of the release's row); scale =
 *         e8m0 bytes (read it as uint8_t, not float) [Np/16][Kp/32][16]: value = e2m1 * 2^(e - 127), e =
 *         scale[((n/16)*(Kp/32) + c/32)*16 + n%16] (padding: code 0, e 0)
 * Padding rows/columns (n >= N, c >= K) are zero. All of one expert's matrices, scales and biases lie inside
 * [expert, expert + expert_bytes), so one copy of that range carries the whole expert. */
typedef struct {
    int32_t quant;           /* KTK_QUANT_* of data */
    int32_t N, K;            /* logical [out, in] */
    int32_t Np, Kp;          /* padded: Np = round_up(N, 16), Kp = round_up(K, 64) (int4: K, max(64, G)) */
    const void *data;        /* the packed matrix */
    int64_t data_bytes;      /* bf16: Np * Kp * 2; int8, fp8: Np * Kp; int4, mxfp4: Np * Kp / 2 */
    const float *scale;      /* int8: [Np] per output row; int4: [Np/16][Kp/G][16]; fp8: [Np/16][ceil(Kp/G)]; mxfp4:
                                the e8m0 bytes [Np/16][Kp/32][16] (uint8_t); NULL for bf16 */
    const float *bias;       /* has_bias: float [Np] (zero padded); NULL without bias */
    const void *expert;      /* this expert's whole packed region */
    int64_t expert_bytes;    /* its size (the same for every expert, a multiple of 64) */
} ktk_raw;
/* View of one matrix (KTK_MAT_*) of one expert (every quant); KTK_ERR_RANGE for a bad expert or which. */
int ktk_experts_raw(const ktk_experts *ex, int expert, int which, ktk_raw *out);
/* The whole packed storage: one page-aligned mapping of *nbytes (== ktk_experts_nbytes) bytes at *base (e.g. to pin
 * it once with cudaHostRegister; expert e's region starts at *base + e * expert_bytes). */
int ktk_experts_region(const ktk_experts *ex, const void **base, int64_t *nbytes);

/* ---- tasks: one forward's arguments at a fixed address ---- */
typedef struct ktk_task ktk_task;
int ktk_task_create(ktk_pool *pool, ktk_task **out);
void ktk_task_destroy(ktk_task *task); /* waits if running */
/* Bind a forward. Pointers are read when the task runs (so a CUDA graph can refill the buffers between runs):
 *   hidden [T, H] (hidden_dtype), ids [T, k] int64, weights [T, k] (weights_dtype F32/BF16),
 *   skip [E] uint8 or NULL (nonzero: expert not computed here, its contribution is left out),
 *   out [T, H] (out_dtype F32/BF16), written (not accumulated).
 * Validates sizes and dtypes now; expert ids are validated when the task runs (error reported by wait). */
int ktk_task_bind(ktk_task *task, ktk_experts *ex, int T, int k,
                  const void *hidden, int hidden_dtype, const int64_t *ids,
                  const void *weights, int weights_dtype, const uint8_t *skip,
                  void *out, int out_dtype);
int ktk_submit(ktk_task *task);     /* returns at once; the task runs on its pool (KTK_ERR_STATE if queued/running) */
/* Blocks until the task is not running; returns the result of its latest run, or first an error kept from a
 * ktk_submit_fn / ktk_wait_fn / watched run (then clears it). KTK_OK for a task never submitted. */
int ktk_wait(ktk_task *task);
void ktk_submit_fn(void *task);     /* void(*)(void*) forms for cuLaunchHostFunc; errors kept for ktk_wait */
void ktk_wait_fn(void *task);
/* Convenience: bind + submit + wait on a temporary task (runs inline on the caller, with the pool's other threads,
 * when the pool is idle). Tasks run one after another on a pool. */
int ktk_forward(ktk_pool *pool, ktk_experts *ex, int T, int k,
                const void *hidden, int hidden_dtype, const int64_t *ids,
                const void *weights, int weights_dtype, const uint8_t *skip,
                void *out, int out_dtype);

/* Backward of ktk_forward with the same hidden, ids, weights and skip (training): given dy = d loss / d out [T, H]
 * (dy_dtype F32/BF16), writes dx = d loss / d hidden [T, H] (dx_dtype F32/BF16; NULL: not computed) and dweights =
 * d loss / d weights [T, k] float32 (NULL: not computed; 0 for a slot skip masks). The expert weights are constants
 * (no gradient for them). Computed in float with the stored weights dequantized (the values ktk_experts_get gives)
 * and hidden, dy as given (not rounded as the forward's activations are); gate and up are recomputed from hidden.
 * Runs on the pool as a forward does (inline when it is idle); results do not depend on its thread count. Checks as
 * ktk_forward's; KTK_ERR_NULL for dy NULL or dx and dweights both NULL. */
int ktk_backward(ktk_pool *pool, ktk_experts *ex, int T, int k,
                 const void *hidden, int hidden_dtype, const int64_t *ids,
                 const void *weights, int weights_dtype, const uint8_t *skip,
                 const void *dy, int dy_dtype, void *dx, int dx_dtype, float *dweights);

/* One projection of routed rows with the stored (frozen) weights of each row's expert (training's base products,
 * e.g. LoRA on the experts): which = KTK_MAT_GATE / UP / DOWN (W [N, K]: out N, in K), row r's expert
 * expert_of_row[r] (R int64; any order: grouped by expert inside, stable),
 *   transpose 0: y[r] = W_{e_r} x[r]      x [R, K] (x_dtype F32/BF16/F16), y [R, N] (y_dtype F32/BF16)
 *   transpose 1: y[r] = W_{e_r}^T x[r]    x [R, N], y [R, K]
 * written, not accumulated; no bias, no activation. precision KTK_PRECISION_FLOAT: float arithmetic with the stored
 * weights dequantized (the values ktk_experts_get gives) and x as given (not rounded as the forward's activations
 * are), for every quant; KTK_PRECISION_BF16: for the rows of experts with at least KTK_PRECISION_BF16_MIN_ROWS rows in
 * the call, x and those values rounded to bf16 (nearest even) and their products summed in float (AMX tiles on the
 * amx ISA), error per output about 2^-8 of sum |x_c w_c|; the other experts' rows as with KTK_PRECISION_FLOAT. Runs
 * on the pool as a forward does (inline when it is idle); a row's result depends on neither the other rows (but,
 * with KTK_PRECISION_BF16, on its expert's row count reaching the threshold) nor the threads. R = 0 does nothing
 * (expert_of_row, x and y are not read). KTK_ERR_RANGE for an id outside [0, E) or a bad which, KTK_ERR_DTYPE for
 * a bad precision, KTK_ERR_STATE for an expert with rows whose matrix was never set. */
#define KTK_PRECISION_FLOAT 0
#define KTK_PRECISION_BF16 1
#define KTK_PRECISION_BF16_MIN_ROWS 16
int ktk_experts_project(ktk_pool *pool, ktk_experts *ex, int which, int R, const int64_t *expert_of_row,
                        const void *x, int x_dtype, void *y, int y_dtype, int transpose, int precision);

/* LoRA adapters of routed rows on one matrix of the experts (training's expert LoRA, beside ktk_experts_project's
 * base products): which = KTK_MAT_GATE / UP / DOWN (W [N, K]), row r's expert expert_of_row[r] (R int64, any order),
 * adapters a [E, rank, K] and B [E, N, rank] given transposed, bt [E, rank, N] (float32, contiguous; B already
 * scaled), float32 rows:
 *   ktk_experts_lora:           t[r] = A_e z[r] (t [R, rank], written); y[r] += B_e t[r] (y [R, N], accumulated)
 *   ktk_experts_lora_backward:  dt[r] = B_e^T dy[r] (dt [R, rank]); dz[r] = A_e^T dt[r] (dz [R, K]); da[e] = the sum
 *                               over e's rows of dt[r] z[r]^T (da [E, rank, K]), dbt[e] = of t[r] dy[r]^T (B's
 *                               gradient transposed, dbt [E, rank, N]): all written, zero for experts without rows.
 * z [R, K], t [R, rank] (the forward's), dy [R, N]. Runs on the pool (inline when it is idle); no result depends on
 * the threads. R = 0: the forward does nothing, the backward zeroes da and dbt. KTK_ERR_RANGE for an id outside
 * [0, E) or a bad which, KTK_ERR_SHAPE for rank outside 1..1024 or R outside 0..2^28. */
int ktk_experts_lora(ktk_pool *pool, ktk_experts *ex, int which, int R, int rank, const int64_t *expert_of_row,
                     const float *z, const float *a, const float *bt, float *t, float *y);
int ktk_experts_lora_backward(ktk_pool *pool, ktk_experts *ex, int which, int R, int rank,
                              const int64_t *expert_of_row, const float *z, const float *t, const float *dy,
                              const float *a, const float *bt, float *dt, float *dz, float *da, float *dbt);

/* A 32-bit word (pinned host memory, 4-byte aligned) that every submitted run stores 1 to (release) at its end,
 * once out is complete, also when the run fails (its error is then ktk_wait's), before the task is idle: a CUDA
 * stream can wait for the run (a kernel polling the word) while the host goes on, and call ktk_wait later (streamed
 * prefill's split layers). The waiter resets it to 0 before the next submit. NULL: none (the default). Kept across
 * binds; not used by watched runs (their done word is the watch's). KTK_ERR_STATE while queued, running or watched;
 * KTK_ERR_SHAPE if misaligned. */
int ktk_task_signal(ktk_task *task, volatile uint32_t *done);
/* The latest run's start (a pool thread took it up) and end (before its signal word), CLOCK_MONOTONIC ns (the clock
 * of Python's time.perf_counter on Linux); 0, 0 before any run. KTK_ERR_STATE while queued, running or watched. */
int ktk_task_times(ktk_task *task, int64_t *begin_ns, int64_t *end_ns);

/* ---- stream-signalled tasks (CUDA graphs; the library itself never calls CUDA) ----
 * go and done are 32-bit words in pinned host memory (GPU-writable). While a task is watched, a pool thread
 * polls *go; when it reads 1 it stores 0 to *go, runs the task, and stores 1 to *done (release). The GPU side
 * waits for *done == 1 and then resets it to 0. *done is raised even when the run fails; the first failure is kept
 * and returned by ktk_task_unwatch (or ktk_wait). A watched task cannot be submitted or re-bound. */
int ktk_task_watch(ktk_task *task, volatile uint32_t *go, volatile uint32_t *done);
/* The same, and after each run's *done = 1 the pool stores 1 to *then (unless NULL): the go word of another watched
 * task, which then runs next with no stream operation in between (expert deferral: a layer's deferred experts start
 * on the CPU as soon as its immediate ones are done, while the GPU goes on to the next layer). */
int ktk_task_watch_then(ktk_task *task, volatile uint32_t *go, volatile uint32_t *done, volatile uint32_t *then);
int ktk_task_unwatch(ktk_task *task);   /* returns when the pool no longer touches go/done/then */

/* ---- expert deferral: which of each token's k slots a task computes ----
 * A token's slots are ranked by routing weight, largest first: a slot's rank is the number of the token's slots with
 * a larger weight, or an equal weight and a lower slot index (rank 0: the top slot). Two tasks bound to the same
 * buffers, one of each part, split every token's k slots exactly. ktk_task_bind resets the selection to
 * KTK_SLOTS_ALL. KTK_ERR_STATE while the task is queued, running or watched.
 * By count (ktk_task_select): with d deferred slots (1 <= d < k) the k - d highest-ranked are the token's immediate
 * slots and the d others its deferred ones. KTK_ERR_SHAPE for an unknown part or d outside 1..k-1.
 * By weight share (ktk_task_select_share, 0 < share < 1): a slot of rank r is deferred iff r > 0 and
 * cum(r) = (sum of the weights of the token's slots of rank >= r) / (sum of its k weights) <= share, both sums in
 * double in slot order; a token whose total weight is not finite or <= 0 defers nothing. So a token defers 0..k-1
 * slots, never its top one, and a part may have no slot at all (its output is then zeros). KTK_ERR_SHAPE for a part
 * other than TOP / REST or a share not finite or outside (0, 1). */
#define KTK_SLOTS_ALL 0    /* every slot */
#define KTK_SLOTS_TOP 1    /* each token's immediate slots */
#define KTK_SLOTS_REST 2   /* each token's deferred slots */
int ktk_task_select(ktk_task *task, int slots, int d);
int ktk_task_select_share(ktk_task *task, int slots, float share);
/* Both parts in one run (expert deferral in graph decode: one native job a layer instead of two): the task computes
 * each token's immediate slots into its bound out and its deferred slots into out2 (same shape and dtype), by count
 * (d, share 0) or by weight share (d 0, share > 0) as above, and stores 1 to *done_top (release; NULL: none) as soon
 * as out is complete, before the deferred part's gate/up and down products (every path runs part 0's first); the
 * run's end (its done word when watched; ktk_wait) follows out2. A run that fails before out is complete raises
 * *done_top at its end. ktk_task_bind undoes it. KTK_ERR_STATE as ktk_task_select; KTK_ERR_SHAPE for d / share as
 * above (exactly one given) or out2 the bound out or hidden (a rejected call changes nothing); KTK_ERR_NULL for
 * out2 NULL. The pool's decode profile counts a split forward's experts once per part. */
#define KTK_SLOTS_SPLIT 3
int ktk_task_split(ktk_task *task, int d, float share, void *out2, volatile uint32_t *done_top);
/* (token, slot) rows of the deferred part a split task computed (as ktk_task_slots_run, which counts both parts) */
uint64_t ktk_task_slots_rest(ktk_task *task, int reset);
/* (token, slot) rows the task computed (selected, not skipped), summed over its runs since it was made or last
 * reset (reset != 0: returns the sum and sets it to 0; ktk_task_bind keeps it). Read it when the task is not running
 * (a run adds its rows when it starts). 0 for NULL. */
uint64_t ktk_task_slots_run(ktk_task *task, int reset);

/* ---- GGUF K-quant blocks (the loader's dequantization of llama.cpp checkpoints) ----
 * qtype is the ggml type number: KTK_GGUF_Q4_K (144-byte blocks), KTK_GGUF_Q5_K (176), KTK_GGUF_Q6_K (210), each
 * block 256 values. Writes nblocks * 256 float32 values to out, bit for bit the values of gguf.quants' numpy
 * dequantizers (float32 operations in their order, none fused; NaN payloads aside). KTK_ERR_DTYPE for another qtype, KTK_ERR_SHAPE for
 * nblocks < 0 or above 2^36, KTK_ERR_NULL for NULL blocks or out (with nblocks > 0). Single-threaded. */
#define KTK_GGUF_Q4_K 12
#define KTK_GGUF_Q5_K 13
#define KTK_GGUF_Q6_K 14
int ktk_gguf_dequantize(int qtype, const uint8_t *blocks, int64_t nblocks, float *out);

#ifdef __cplusplus
}
#endif
#endif
