/* The AVX-512 fp8 kernels of fp8.c (FMA, every variant) and fp8_bf16.c (vdpbf16ps, the avx512+bf16 variants), for
 * the tables of avx512/gemm.c and amx/gemm.c and for the kernel harness. ktk_gemm_fn / ktk_gemv_fn: ../kernels.h.
 */
#ifndef KTK_AVX512_FP8_H
#define KTK_AVX512_FP8_H
#include "../kernels.h"

/* Table entries: the dequantizing path from their crossover rows (fp8.c), else the direct kernel below. */
void ktk_avx512_gemm_fp8(const ktk_mat *w, int nb0, int nb1, const ktk_act *x, float *y, int64_t ldy);
void ktk_avx512_gemm_fp8_dp(const ktk_mat *w, int nb0, int nb1, const ktk_act *x, float *y, int64_t ldy);

/* Direct kernel and gemv (fp8.c, FMA); the dp gemv (fp8_bf16.c: vdpbf16ps, or the FMA one, as the dp entries). */
void ktk_avx512_gemm_fp8_direct(const ktk_mat *w, int nb0, int nb1, const ktk_act *x, float *y, int64_t ldy);
void ktk_avx512_gemv_fp8(int M, const ktk_mat *const *w, int nb0, int nb1, const ktk_act *const *x,
                         float *const *y);
void ktk_avx512_gemv_fp8_dp(int M, const ktk_mat *const *w, int nb0, int nb1, const ktk_act *const *x,
                            float *const *y);

/* The direct kernel and gemv the dp entries run: use_dp 1, fp8_bf16.c's vdpbf16ps ones (the CPU must have AVX512_BF16
 * and AVX512_VBMI); 0, fp8.c's FMA ones. The entries pass whether the CPU has VBMI and is not Intel's. */
typedef struct { ktk_gemm_fn direct; ktk_gemv_fn gemv; } ktk_fp8_kernels;
ktk_fp8_kernels ktk_avx512_fp8_dp_kernels(int use_dp);
/* Whether the dp entries run fp8_bf16.c's kernels on this CPU (AVX512_VBMI and not Intel's; read once). */
int ktk_avx512_fp8_dp_used(void);

void ktk_avx512_dequant_fp8(const ktk_mat *w, int nb0, int nb1, uint16_t *dst);
#endif
