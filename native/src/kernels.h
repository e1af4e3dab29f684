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
 *
 * Activation layout (produced by the orchestration in experts.c, generic code):
 *   bf16: x_bf16[t * Kp + c], t < n rows, zero for c >= K;
 *   int8: x_i8[t * Kp + c] symmetric per row: x ~= q * x_scale[t]; x_sum[t] = sum_c q[t][c].
 */
#ifndef KTK_KERNELS_H
#define KTK_KERNELS_H
#include <stdint.h>

typedef struct {
    int32_t N, K;        /* logical sizes */
    int32_t Np, Kp;      /* padded: Np % 16 == 0, Kp % 64 == 0 */
    int32_t quant;       /* KTK_QUANT_BF16 or KTK_QUANT_INT8 */
    const uint16_t *data_bf16;  /* bf16 layout above, or NULL */
    const int8_t *data_i8;      /* int8 layout above, or NULL */
    const float *scale;         /* int8: [Np] */
    const int32_t *wsum;        /* int8: [Np] */
} ktk_mat;

typedef struct {
    int32_t n;           /* rows (tokens) */
    int32_t Kp;          /* row stride in elements, == the matrix's Kp */
    const uint16_t *x_bf16;     /* bf16: [n][Kp] */
    const int8_t *x_i8;         /* int8: [n][Kp] */
    const float *x_scale;       /* int8: [n] */
    const int32_t *x_sum;       /* int8: [n] */
} ktk_act;

/* y[t * ldy + (j - nb0 * 16)] = sum_c x[t][c] * W[j][c]   for t < x->n, j in [nb0 * 16, nb1 * 16)
 * bf16: products of bf16 values accumulated in float (order is the kernel's choice);
 * int8: exact int32 dot product, then * x_scale[t] * scale[j].
 * No bias, no activation, y is overwritten. Called concurrently from pool threads on disjoint outputs. */
typedef void (*ktk_gemm_fn)(const ktk_mat *w, int nb0, int nb1, const ktk_act *x, float *y, int64_t ldy);

typedef struct {
    const char *name;
    ktk_gemm_fn gemm_bf16;
    ktk_gemm_fn gemm_int8;
} ktk_kernels;

/* One per ISA file; each returns a static table. Only call the one for an ISA the CPU has. */
const ktk_kernels *ktk_kernels_generic(void);
const ktk_kernels *ktk_kernels_avx2(void);
const ktk_kernels *ktk_kernels_avx512(void);
const ktk_kernels *ktk_kernels_amx(void);   /* AMX for many rows, AVX-512 below its crossover */

/* bf16 <-> float helpers shared by the generic code (round to nearest even; NaN kept NaN). */
static inline float ktk_bf16_to_f32(uint16_t h) {
    union { uint32_t u; float f; } v; v.u = (uint32_t)h << 16; return v.f;
}
static inline uint16_t ktk_f32_to_bf16(float f) {
    union { uint32_t u; float f; } v; v.f = f;
    if ((v.u & 0x7fffffffu) > 0x7f800000u) return (uint16_t)((v.u >> 16) | 0x40u);
    v.u += 0x7fffu + ((v.u >> 16) & 1u);
    return (uint16_t)(v.u >> 16);
}
#endif
