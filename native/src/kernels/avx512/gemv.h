/* The AVX-512 decode kernels of gemv.c (fp8: fp8.c) (ktk_gemv_fn, ../kernels.h), for the tables of avx512/gemm.c and
 * amx/gemm.c. */
#ifndef KTK_AVX512_GEMV_H
#define KTK_AVX512_GEMV_H
#include "../kernels.h"

void ktk_avx512_gemv_bf16_dp(int M, const ktk_mat *const *w, int nb0, int nb1, const ktk_act *const *x,
                             float *const *y);
void ktk_avx512_gemv_bf16_plain(int M, const ktk_mat *const *w, int nb0, int nb1, const ktk_act *const *x,
                                float *const *y);
void ktk_avx512_gemv_int8_vnni(int M, const ktk_mat *const *w, int nb0, int nb1, const ktk_act *const *x,
                               float *const *y);
void ktk_avx512_gemv_fp8(int M, const ktk_mat *const *w, int nb0, int nb1, const ktk_act *const *x,
                         float *const *y);   /* fp8.c */
void ktk_avx512_gemv_int4_vnni(int M, const ktk_mat *const *w, int nb0, int nb1, const ktk_act *const *x,
                               float *const *y);
#endif
