/* Internal kernel interface: what one ISA file provides. Not part of the public API.
 *
 * Packed weight layout (shared by every ISA; produced once by ktk_experts_set):
 *   a matrix W with N output rows and K input columns is padded to Np = round_up(N, 16), Kp = round_up(K, 64)
 *   (padding is zero) and stored in blocks of 16 output rows ("column blocks" of the result):
 *   bf16: element (n, c) at data_bf16[((n/16) * (Kp/2) + c/2) * 32 + (n%16) * 2 + c%2]
 *         i.e. per block of 16 outputs, Kp/2 rows of 64 bytes, each row = 16 outputs x a pair of inputs
 *         (the AMX-BF16 B-tile / VNNI order, also what vdpbf16ps wants with a broadcast input pair);
 *   int8: element (n, c) at data_i8[((n/16) * (Kp/4) + c/4) * 64 + (n%16) * 4 + c%4]
 *         (AMX-INT8 B-tile / vpdpbusd order), with scale[n] (float, symmetric: w ~= q * scale[n]) and
 *         wsum[n] = sum_c q[n][c] (int32; lets u8 x s8 instructions correct for the +128 shift of activations).
 *   int4: groups of G = group inputs (32, 64 or 128) per scale; Kp = round_up(K, max(64, G)), ng = Kp / G groups.
 *         q in [-8, 7] is stored as a two's complement nibble (zero bytes = q 0): per block of 16 outputs, Kp/8 rows
 *         of 64 bytes, row r = inputs 8r..8r+7: byte (n%16) * 4 + c%4 holds input c of the first quad (c%8 < 4) in
 *         its low nibble and input c + 4 of the second quad in its high nibble, i.e. element (n, c) at
 *         data_i4[((n/16) * (Kp/8) + c/8) * 64 + (n%16) * 4 + c%4], nibble (c/4)%2 (0 = bits 0-3, 1 = bits 4-7).
 *         So one 64-byte load, (v ^ 0x88) & 0x0f (low quad) and ((v >> 4) ^ 0x88) & 0x0f (high quad; one
 *         ternary-logic op each on AVX-512) give two vpdpbusd operands in the int8 layout's quad order (16 int32
 *         lanes = outputs, 4 bytes = consecutive inputs) as unsigned q + 8.
 *         scale[((n/16) * ng + g) * 16 + n%16]: float, w ~= q * scale, 16 contiguous floats per (block, group); it
 *         may be negative (the group's value of largest magnitude maps to q = -8 exactly).
 *         No weight sums: the kernels correct u8 weights (q + 8) x s8 activations with 8 * sum of x per group (a
 *         few instructions per row and group), where int8's trick (u8 x + 128, s8 weights, - 128 * wsum) would
 *         store an int32 per (output, group): 0.5 bit per weight at G = 64, 11% more bytes to stream at decode.
 *   fp8:  one float8 e4m3 byte (OCP e4m3fn) per weight, Kp = round_up(K, 64): element (n, c) at
 *         data_f8[((n/16) * Kp + c) * 16 + n%16], i.e. per block of 16 outputs Kp rows of 16 bytes, row c = the 16
 *         outputs of input c (one vpmovsxbd of 16 bytes gives 16 int32 lanes = outputs). G = group inputs per scale
 *         (a multiple of 16 up to 512; need not divide Kp), ng = ceil(Kp / G): scale[(n/16) * ng + c/G] (float, w =
 *         e4m3 * scale; one per 16-row block and group: the checkpoint's block_rows x G blocks, block_rows a
 *         multiple of 16, each 16-row block holding its block's scale; padding groups 0).
 *         Bits to float: (vpmovsxbd(byte) << 20) & 0x87f00000 is a float of value exactly e4m3 * 2^-120 (sign to bit
 *         31, exponent and mantissa to bits 26..20; e4m3 subnormals become float subnormals, exact).
 *
 * Activation layout (produced by the forward's gather, moe/gather.c, generic code):
 *   bf16: x_bf16[t * Kp + c], t < n rows, zero for c >= K;
 *   int8: x_i8[t * Kp + c] symmetric per row: x ~= q * x_scale[t]; x_sum[t] = sum_c q[t][c].
 *   fp8 weights take bf16 activations (W8A16, x_bf16 as for bf16 weights) and a workspace (work, per calling
 *         thread): the direct path converts rows of x to float there (ktk_fp8_rows), the dequantizing path its bf16
 *         blocks (ktk_fp8_dequant_gemm).
 *   int4 weights take int8 activations (W4A8), plus optionally, for the dequantizing path of many rows, x_bf16 =
 *         the same q as bf16 (exact: |q| <= 127) and a workspace (see ktk_int4_dequant_gemm).
 *   tiles (optional, for a table with tile_rows > 0, given for the rows of an expert with at least tile_rows rows;
 *         one call may have fewer, e.g. an expert's last 256-row chunk, and a kernel may ignore them): x in AMX A-tile
 *         order, 16 rows x 64 bytes per tile: row t, byte offset o of its row (o < Kp * element size) at
 *         tiles + ((t/16) * (Kp * es / 64) + o/64) * 1024 + (t%16) * 64 + o%64, rows of a last partial group of 16
 *         allocated (their content unused). Of x_bf16 for gemm_bf16, gemm_int4 and gemm_fp8 (their dequantizing
 *         paths), of x_i8 for gemm_int8. Produced once per forward and shared by every call on those rows, it spares the kernel a
 *         copy per call (tile loads want compact 1 KB tiles: rows Kp * es apart alias in L1).
 */
#ifndef KTK_KERNELS_H
#define KTK_KERNELS_H
#include <stdint.h>

typedef struct {
    int32_t N, K;        /* logical sizes */
    int32_t Np, Kp;      /* padded: Np % 16 == 0, Kp % 64 == 0 (int4: also Kp % G == 0) */
    int32_t quant;       /* KTK_QUANT_BF16, KTK_QUANT_INT8, KTK_QUANT_INT4, KTK_QUANT_FP8 or KTK_QUANT_MXFP4 */
    const uint16_t *data_bf16;  /* bf16 layout above, or NULL */
    const int8_t *data_i8;      /* int8 layout above, or NULL */
    const float *scale;         /* int8: [Np]; int4: [Np/16][ng][16]; fp8: [Np/16][ng] */
    const int32_t *wsum;        /* int8: [Np] */
    const uint8_t *data_i4;     /* int4 layout above, or NULL */
    int32_t group;              /* int4: G, inputs per scale (32, 64 or 128; divides Kp); fp8: G (a multiple of 16) */
    const uint8_t *data_f8;     /* fp8 layout above, or NULL */
    const uint8_t *data_f4;     /* mxfp4 layout below, or NULL */
    const uint8_t *scale_e8;    /* mxfp4: e8m0 bytes [Np/16][Kp/32][16] */
} ktk_mat;

typedef struct {
    int32_t n;           /* rows (tokens) */
    int32_t Kp;          /* row stride in elements, == the matrix's Kp */
    const uint16_t *x_bf16;     /* bf16: [n][Kp] */
    const int8_t *x_i8;         /* int8: [n][Kp] */
    const float *x_scale;       /* int8: [n] */
    const int32_t *x_sum;       /* int8: [n] */
    /* int4 and fp8 only (zero / NULL otherwise): */
    void *work;                 /* workspace of the dequantizing path (fp8: and of the direct path; per calling
                                   thread), or NULL */
    int64_t work_bytes;
    int32_t int4_path;          /* KTK_INT4_PATH_*: which path gemm_int4 takes */
    const void *tiles;          /* x in AMX tile order (see above), or NULL */
    int32_t fp8_path;           /* KTK_FP8_PATH_*: which path gemm_fp8 takes */
} ktk_act;

#define KTK_INT4_PATH_AUTO 0     /* the ISA's choice by row count (direct below its threshold) */
#define KTK_INT4_PATH_DIRECT 1   /* always the direct int4 x int8 kernel */
#define KTK_INT4_PATH_DEQUANT 2  /* dequantize to bf16 + gemm_bf16 whenever x_bf16 and enough work are given */
/* No ISA takes the dequantizing path by itself below this many rows: the orchestration provides x_bf16 and the
 * workspace only for experts with at least this many rows (or when the path is forced). */
#define KTK_INT4_DEQUANT_MIN_ROWS_ANY 8
#define KTK_FP8_PATH_AUTO 0      /* as KTK_INT4_PATH_*, for gemm_fp8 */
#define KTK_FP8_PATH_DIRECT 1
#define KTK_FP8_PATH_DEQUANT 2
#define KTK_FP8_DEQUANT_MIN_ROWS_ANY 8   /* as KTK_INT4_DEQUANT_MIN_ROWS_ANY, for fp8's dequantizing workspace */

/* y[t * ldy + (j - nb0 * 16)] = sum_c x[t][c] * W[j][c]   for t < x->n, j in [nb0 * 16, nb1 * 16)
 * bf16: products of bf16 values accumulated in float (order is the kernel's choice);
 * int8: exact int32 dot product, then * x_scale[t] * scale[j].
 * int4: direct path: per group g (ascending) the exact int32 dot product d_g of x and q, acc = fmaf((float)d_g,
 *       scale[j][g], acc) from acc = 0, then y = acc * x_scale[t] (bit-exact across ISAs); dequantizing path:
 *       gemm_bf16 of x_bf16 and bf16(q * scale), then * x_scale[t] (weights rounded to bf16: <= 2^-9 relative).
 * fp8:  direct path: per group g (ascending) p_g = the float sum over c in g (ascending, fmaf, from 0) of x[t][c] *
 *       e4m3(W[j][c]), acc = fmaf(p_g, scale[j/16][g], acc) from acc = 0, y = acc: the generic kernel literally; the
 *       ISA kernels compute the same operations on x * 2^a and w * 2^-120 (powers of two: exact while nothing leaves
 *       the normal range, which a per-row a keeps so for scales from about 2^-75) and scale y back by 2^(120 - a),
 *       so they match it bit for bit on such data. The vdpbf16ps kernels (avx512/fp8_bf16.c, run by the
 *       avx512+bf16 tables where the CPU has AVX512_VBMI and is not Intel's) do the same steps in the same order
 *       but through vdpbf16ps (per lane: acc + the odd pair element's product, rounded, + the even one's, rounded,
 *       as Intel documents it; subnormal inputs and results flushed): bit-identical where the instruction rounds
 *       so (Intel's cores), else within 1e-5 of sum_c |x[t][c] w[j][c]| of the generic result (what the kernel
 *       harness holds them to). Their gemv is bit-identical to their gemm with one row on every CPU.
 *       Dequantizing path: gemm_bf16 of x_bf16 and bf16(e4m3 * scale) (weights rounded to bf16: <= 2^-9
 *       relative). Needs x->work of at least ktk_fp8_rows_bytes(Kp, 1) bytes (the ISA kernels fall back to the
 *       generic one without).
 * No bias, no activation, y is overwritten. Called concurrently from pool threads on disjoint outputs. */
typedef void (*ktk_gemm_fn)(const ktk_mat *w, int nb0, int nb1, const ktk_act *x, float *y, int64_t ldy);
/* int8 / int4 / fp8 / mxfp4 blocks [nb0, nb1) -> bf16 packed layout (block b at dst + (b - nb0) * 16 * Kp), value
 * bf16(q * scale) (fp8: bf16((float)e4m3 * scale); mxfp4: e2m1 * 2^(e - 127), exact) with round to nearest even:
 * identical bits on every ISA (but int4's on AVX512_BF16 CPUs: denormal products flushed to zero, avx512/int4.c). */
typedef void (*ktk_dequant_fn)(const ktk_mat *w, int nb0, int nb1, uint16_t *dst);

/* Decode: several matrices with one row of x each, their weights streamed at once. For m < M (1 <= M <=
 * KTK_GEMV_MAX): y[m][j - nb0 * 16] = sum_c x[m]->row 0 [c] * W_m[j][c] for j in [nb0 * 16, nb1 * 16); every W_m has
 * the same quant, Kp and (int4, fp8) group; x[m]->n == 1 (only row 0 is read); fp8: x[0]->work holds the M rows as
 * float (ktk_fp8_rows_bytes(Kp, M) bytes; with less, the matrices run one at a time). Bit-identical to gemm of the same table
 * with one row (the same operations in the same order), but M x NB weight streams are in flight instead of NB: a
 * one-token forward is bound by memory requests in flight per core, not by arithmetic. NULL in a table: the forward
 * takes its item path (gemm per item) for every forward. */
#define KTK_GEMV_MAX 8
typedef void (*ktk_gemv_fn)(int M, const ktk_mat *const *w, int nb0, int nb1, const ktk_act *const *x,
                            float *const *y);

typedef struct {
    const char *name;
    ktk_gemm_fn gemm_bf16;
    ktk_gemm_fn gemm_int8;
    ktk_gemm_fn gemm_int4;   /* picks the direct or the dequantizing path (x->int4_path, row count) */
    ktk_gemv_fn gemv_bf16;   /* may be NULL (see ktk_gemv_fn) */
    ktk_gemv_fn gemv_int8;
    ktk_gemv_fn gemv_int4;   /* the direct int4 x int8 kernel's arithmetic */
    int gemv_default;        /* the forward uses the gemv kernels unless KTINJECT_GEMV says otherwise */
    int tile_rows[5];        /* by KTK_QUANT_*: > 0: gemm reads act.tiles where given; the forward gives them for
                                the experts with at least this many rows (0: never) */
    ktk_gemm_fn gemm_fp8;    /* picks the direct or the dequantizing path (x->fp8_path, row count) */
    ktk_gemv_fn gemv_fp8;    /* the direct fp8 kernel's arithmetic; may be NULL */
    ktk_gemm_fn gemm_mxfp4;  /* picks the direct or the dequantizing path (x->fp8_path, row count) */
    ktk_gemv_fn gemv_mxfp4;  /* the direct mxfp4 kernel's arithmetic; may be NULL */
} ktk_kernels;

/* mxfp4 (W4A16; the layout below): the act fields of fp8 (x_bf16, work, fp8_path) with the same meaning.
 *   layout: e2m1 nibbles, Kp = round_up(K, 64) (K % 32 == 0): per block of 16 outputs Kp/8 rows of 64 bytes, row r =
 *         inputs 8r..8r+7, byte (n%16) * 4 + i holding inputs 8r + 2i (low nibble) and 8r + 2i + 1 (high nibble) of
 *         output n, i.e. element (n, c) in data_f4[((n/16) * (Kp/8) + c/8) * 64 + (n%16) * 4 + (c%8)/2], nibble c%2:
 *         a 32-bit lane = output n's 8 consecutive inputs, nibble k (bits 4k..4k+3) input 8r + k. e8m0 exponents
 *         scale_e8[((n/16) * (Kp/32) + c/32) * 16 + n%16]: value = e2m1 * 2^(e - 127) (e 0: 2^-127, a subnormal).
 *   direct path: y[t][j] = sum_g fmaf(p_g, 2^(e_jg - 127), .) (ascending g, from 0.0f), p_g = the fmaf sum over the
 *         group's 32 inputs (ascending, from 0.0f) of float(x[t][c]) * e2m1(W[j][c]): the generic kernel literally,
 *         and every ISA kernel bit for bit (the same float operations; no scaling of the operands).
 *   dequantizing path: gemm_bf16 of x_bf16 and bf16(e2m1 * 2^(e - 127)) (exact: no rounding of the weights).
 *   x->work: float rows of x for the direct path (ktk_fp8_rows_bytes(Kp, rows)), the dequantized blocks for the
 *         other; the ISA kernels fall back to the generic one where it cannot hold one row. */
#define KTK_MXFP4_GROUP 32
void ktk_generic_gemm_mxfp4_direct(const ktk_mat *w, int nb0, int nb1, const ktk_act *x, float *y, int64_t ldy);
void ktk_generic_dequant_mxfp4(const ktk_mat *w, int nb0, int nb1, uint16_t *dst);
void ktk_generic_gemm_mxfp4(const ktk_mat *w, int nb0, int nb1, const ktk_act *x, float *y, int64_t ldy);
/* x->x_bf16 rows [t0, t0 + n) as float at dst (rows Kp apart), unscaled. */
void ktk_mxfp4_rows(const ktk_act *x, int t0, int n, float *dst);
/* 2^(e - 127) as a float for an e8m0 byte e < 255 (e 0: the subnormal 2^-127). */
static inline float ktk_e8m0_to_f32(uint8_t e) {
    union { uint32_t u; float f; } v;
    v.u = e ? (uint32_t)e << 23 : 0x00400000u;
    return v.f;
}
/* e2m1 code (bit 3 the sign) -> float, exact. */
static inline float ktk_e2m1_to_f32(uint8_t q) {
    static const float lut[16] = {0.0f, 0.5f, 1.0f, 1.5f, 2.0f, 3.0f, 4.0f, 6.0f,
                                  -0.0f, -0.5f, -1.0f, -1.5f, -2.0f, -3.0f, -4.0f, -6.0f};
    return lut[q & 15];
}

/* int4 helpers of kernels/generic/int4.c, shared by the ISA files. */
/* Dequantizing path: blocks in chunks that fit x->work -> dq -> gemm_bf16 on x->x_bf16, then y *= x_scale[t]. */
void ktk_int4_dequant_gemm(const ktk_mat *w, int nb0, int nb1, const ktk_act *x, float *y, int64_t ldy,
                           ktk_dequant_fn dq, ktk_gemm_fn gemm_bf16);
void ktk_generic_dequant_int4(const ktk_mat *w, int nb0, int nb1, uint16_t *dst);
void ktk_generic_gemm_int4_direct(const ktk_mat *w, int nb0, int nb1, const ktk_act *x, float *y, int64_t ldy);
/* Workspace for the dequantizing path of `blocks` 16-row blocks at once. */
static inline int64_t ktk_int4_work_bytes(int32_t Kp, int blocks) { return (int64_t)blocks * 16 * Kp * 2; }
/* Whether gemm_int4 takes the dequantizing path: forced, or auto from min_rows rows (min_rows <= 0: never), and only
 * when x_bf16 and a workspace of at least one block are given. */
static inline int ktk_int4_dequant(const ktk_mat *w, const ktk_act *x, int min_rows) {
    if (!x->x_bf16 || !x->work || x->work_bytes < ktk_int4_work_bytes(w->Kp, 1)) return 0;
    if (x->int4_path == KTK_INT4_PATH_DEQUANT) return 1;
    return x->int4_path == KTK_INT4_PATH_AUTO && min_rows > 0 && x->n >= min_rows;
}

/* fp8 helpers of kernels/generic/fp8.c, shared by the ISA files. */
/* Float rows of the direct path: x->x_bf16 rows [t0, t0 + n) as float times 2^a_t at dst (rows Kp apart), where a_t
 * (from the row's largest |x|) puts that value near 2^64; post[t - t0] = 2^(120 - a_t), the factor that brings a
 * sum of such x times w * 2^-120 back. */
void ktk_fp8_rows(const ktk_act *x, int t0, int n, float *dst, float *post);
static inline int64_t ktk_fp8_rows_bytes(int32_t Kp, int rows) { return (int64_t)rows * Kp * 4; }
/* A direct micro-kernel: mr rows (float rows xf, Kp apart, their post factors) x nb blocks from b0, all of K. */
typedef void (*ktk_fp8_micro)(const ktk_mat *w, const float *xf, const float *post, int b0, float *y, int64_t ldy,
                              int mr, int nb);
/* The direct path around micro: rows in chunks whose float rows fit x->work (at most KTK_FP8_CHUNK_ROWS), each chunk
 * in row groups of at most mrmax x block groups of min(nbmax, accmax / mr) (as ktk_drive); the generic kernel where
 * x->work cannot hold one row. */
#define KTK_FP8_CHUNK_ROWS 64
void ktk_fp8_direct(const ktk_mat *w, int nb0, int nb1, const ktk_act *x, float *y, int64_t ldy, ktk_fp8_micro micro,
                    int mrmax, int nbmax, int accmax);
/* Dequantizing path: blocks in chunks that fit x->work -> dq -> gemm_bf16 on x->x_bf16 (and x->tiles). */
void ktk_fp8_dequant_gemm(const ktk_mat *w, int nb0, int nb1, const ktk_act *x, float *y, int64_t ldy,
                          ktk_dequant_fn dq, ktk_gemm_fn gemm_bf16);
void ktk_generic_dequant_fp8(const ktk_mat *w, int nb0, int nb1, uint16_t *dst);
void ktk_generic_gemm_fp8_direct(const ktk_mat *w, int nb0, int nb1, const ktk_act *x, float *y, int64_t ldy);
static inline int ktk_fp8_groups(const ktk_mat *w) { return (w->Kp + w->group - 1) / w->group; }
/* Whether gemm_fp8 takes the dequantizing path: as ktk_int4_dequant (x->fp8_path), when a workspace of at least one
 * block is given. */
static inline int ktk_fp8_dequant(const ktk_mat *w, const ktk_act *x, int min_rows) {
    if (!x->x_bf16 || !x->work || x->work_bytes < ktk_int4_work_bytes(w->Kp, 1)) return 0;
    if (x->fp8_path == KTK_FP8_PATH_DEQUANT) return 1;
    return x->fp8_path == KTK_FP8_PATH_AUTO && min_rows > 0 && x->n >= min_rows;
}

/* Backward of the routed experts (moe/backward.c's rows step on an ISA; its generic step is their reference).
 * Float throughout; Kt = round_up(K, 16). Called concurrently from pool threads on disjoint outputs. */
typedef struct {
    const char *name;
    /* Block b of w (rows 16b + j, j < 16; zero past N, as the packing pads) dequantized as the generic code does
     * (bf16 value, q * scale, e4m3 * scale; bit for bit): wt[c * 16 + j] (c < Kt; wt may be NULL) and
     * wr[j * ldr + c] (c < Kt, ldr >= Kt) = W[16b + j][c] (wr may be NULL; not both). */
    void (*unpack)(const ktk_mat *w, int b, float *wt, float *wr, int64_t ldr);
    /* g[i * 16 + j] = sum_{c < Kt} x[i * ldx + c] wtg[c * 16 + j], u the same with wtu, for i < n */
    void (*gate_up)(const float *wtg, const float *wtu, int Kt, const float *x, int64_t ldx, int n, float *g,
                    float *u);
    /* out[i * ldo + c] += sum_{j < 16} d1[i * ldd + j] w1[j * ldw + c] (+ the same of d2, w2 unless w2 is NULL), for
     * i < n, c < K (nothing at c >= K is written) */
    void (*tprod)(const float *w1, const float *d1, const float *w2, const float *d2, int64_t ldd, int64_t ldw,
                  int K, int n, float *out, int64_t ldo);
    /* Chunks of at most few_rows rows (0: none, and the three below may be NULL; at most 4) take these instead, on
     * the stored blocks (no unpack): */
    int few_rows;
    /* gate_up's g, u of block b of g and u, x rows ldx apart (Kt of them read) */
    void (*gate_up_packed)(const ktk_mat *g, const ktk_mat *u, int b, const float *x, int64_t ldx, int n, float *G,
                           float *U);
    /* A[(i * Kt + c) * 16 + j] += d[i * ldd + j] W[16b + j][c] for i < n, c < Kt, j < 16 (per-lane partial sums) */
    void (*tacc)(const ktk_mat *w, int b, const float *d, int64_t ldd, int n, float *A);
    /* out[i * ldo + c] = sum_j A[(i * Kt + c) * 16 + j] for i < n, c < K (Kt = round_up(K, 16)) */
    void (*hsum)(const float *A, int K, int n, float *out, int64_t ldo);
    /* the expert LoRA terms' loops over rk rows of a matrix M (rows ldm apart, rk <= 1024; moe/lora.c, whose
     * generic ones are the reference): */
    /* t[j] = sum_{i < n} M[j * ldm + i] x[i], for j < rk (float, a fixed order) */
    void (*mdot)(const float *M, int64_t ldm, int rk, const float *x, int n, float *t);
    /* y[i] += sum_{j < rk} s[j] M[j * ldm + i], for i < n */
    void (*maxpy)(float *y, const float *M, int64_t ldm, int rk, const float *s, int n);
    /* M[j * ldm + i] += s[j] v[i], for j < rk, i < n */
    void (*ger)(float *M, int64_t ldm, int rk, const float *s, const float *v, int n);
    /* bf16 products of moe/project_bf16.c: conversions to bf16 by round to nearest even (ktk_f32_to_bf16, NaN kept
     * NaN), the same bits as the generic ones below (their reference), which run where these are NULL: */
    /* dst[i] = bf16(src[i]) for i < n */
    void (*bf16_rows)(const float *src, int n, uint16_t *dst);
    /* dst[i * ldd + 2j + k] = bf16(r_k[i * ldr + j]) for i < n, j < 16, k = 0, 1: per 16 values of two float rows one
     * 64-byte row of the bf16 packed layout (16 outputs x a pair of inputs) */
    void (*bf16_pairs)(const float *r0, const float *r1, int64_t ldr, int n, uint16_t *dst, int64_t ldd);
    /* by KTK_QUANT_*: the ISA's dequantization to the bf16 layout (ktk_dequant_fn), or NULL: unpack's float columns
     * through bf16_pairs (mxfp4, which unpack does not take: the generic dequantization) */
    ktk_dequant_fn dequant_bf16[5];
} ktk_bwd_kernels;
/* kernels/generic/convert.c: the reference conversions (bf16_rows, bf16_pairs) and int8's dequantization to the bf16
 * layout (bf16(q * scale[n]): the values ktki_pack_unpack gives, rounded) */
void ktk_generic_bf16_rows(const float *src, int n, uint16_t *dst);
void ktk_generic_bf16_pairs(const float *r0, const float *r1, int64_t ldr, int n, uint16_t *dst, int64_t ldd);
void ktk_generic_dequant_int8(const ktk_mat *w, int nb0, int nb1, uint16_t *dst);
/* kernels/avx2/convert.c: the same on AVX2 (the avx2 and avx512 backward tables: every AVX-512 CPU has AVX2) */
void ktk_avx2_bf16_rows(const float *src, int n, uint16_t *dst);
void ktk_avx2_bf16_pairs(const float *r0, const float *r1, int64_t ldr, int n, uint16_t *dst, int64_t ldd);
const ktk_bwd_kernels *ktk_bwd_kernels_avx512(void);   /* kernels/avx512/backward.c */
const ktk_bwd_kernels *ktk_bwd_kernels_avx2(void);     /* kernels/avx2/backward.c (no few-rows path) */
/* kernels/dispatch.c: those of the ISA in use, or NULL where the generic step runs (generic) */
const ktk_bwd_kernels *ktki_dispatch_backward(void);

/* One per ISA file; each returns a static table. Only call the one for an ISA the CPU has. */
const ktk_kernels *ktk_kernels_generic(void);
const ktk_kernels *ktk_kernels_avx2(void);
const ktk_kernels *ktk_kernels_avx512(void);
const ktk_kernels *ktk_kernels_amx(void);   /* AMX for many rows, AVX-512 below its crossover */

/* bf16 <-> float and e4m3 -> float helpers shared by the generic code (round to nearest even; NaN kept NaN). */
static inline float ktk_bf16_to_f32(uint16_t h) {
    union { uint32_t u; float f; } v; v.u = (uint32_t)h << 16; return v.f;
}
/* float8 e4m3 (OCP e4m3fn) bits -> float, exact; 0x7f / 0xff -> NaN. */
static inline float ktk_e4m3_to_f32(uint8_t b) {
    const uint32_t e = (b >> 3) & 15u, m = b & 7u;
    union { uint32_t u; float f; } v;
    if (e == 15 && m == 7) v.u = 0x7fc00000u;
    else if (e == 0) v.f = (float)m * (1.0f / 512.0f);             /* subnormal: m * 2^-9 */
    else v.u = ((e + 120) << 23) | (m << 20);                       /* 2^(e - 7) * (1 + m / 8) */
    v.u |= (uint32_t)(b & 0x80) << 24;
    return v.f;
}
static inline uint16_t ktk_f32_to_bf16(float f) {
    union { uint32_t u; float f; } v; v.f = f;
    if ((v.u & 0x7fffffffu) > 0x7f800000u) return (uint16_t)((v.u >> 16) | 0x40u);
    v.u += 0x7fffu + ((v.u >> 16) & 1u);
    return (uint16_t)(v.u >> 16);
}
#endif
