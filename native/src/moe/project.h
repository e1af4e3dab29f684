/* The state of one projection job (ktk_experts_project), shared by moe/project.c (the job, routing, items and the float
 * steps) and moe/project_bf16.c (the bf16-products step). Legend: project.c's. */
#ifndef KTKI_PROJECT_H
#define KTKI_PROJECT_H
#include "../internal.h"

typedef struct {
    ktk_task t;              /* first: the pool runs it; hidden = x, ids = the rows' experts, out = y */
    int which, transpose, precision;
} proj_task;

/* active expert, grouped rows [r0, r1), output blocks [b0, b1) (transpose 0: W's rows, 1: W's columns), step */
typedef struct { int32_t a, r0, r1, b0, b1, bf16; } proj_item;

/* the bf16 step's kernels: the ISA's, or the generic ones where the ISA has none */
typedef struct {
    ktk_gemm_fn gemm;                                   /* the ISA's gemm_bf16 */
    void (*rows)(const float *src, int n, uint16_t *dst);
    void (*pairs)(const float *r0, const float *r1, int64_t ldr, int n, uint16_t *dst, int64_t ldd);
    ktk_dequant_fn dequant;                             /* this call's quant (NULL: bf16, stored as is) */
} proj_bf16_kernels;

typedef struct {
    const proj_task *p;
    const ktk_experts *ex;
    ktk_pool *pool;
    int R, E, N, K, Nt, Kt, nin, nout, transpose, cw, A, step;
    int32_t *cnt, *act_e, *off, *row;   /* [E], [A], [A + 1], [R]: the caller's row of each grouped row */
    proj_item *items;
    int64_t nitems;
    const ktk_bwd_kernels *bk;          /* NULL: the generic step */
    /* bf16 step (project_bf16.c): x's row stride Kx (transpose 0: the stored Kp; 1: round_up(N, 64)), output blocks
     * per item, its kernels */
    int Kx, bcw;
    proj_bf16_kernels bf;
} pctx;

/* project.c: y[row][j0, j0 + jn) = v[i * ldv + (0, jn)] for the grouped rows [r0, r0 + n) */
void ktki_project_store_rows(const pctx *c, int r0, int n, int j0, int jn, const float *v, int64_t ldv);

/* project_bf16.c */
/* Whether active expert a takes the bf16 step. */
int ktki_project_bf16_takes(const pctx *c, int a);
/* Sets c->bf, c->Kx and c->bcw for the experts taking the bf16 step (any); returns their item count. */
int64_t ktki_project_bf16_plan(pctx *c);
/* Writes active expert a's bf16 items at out; returns their count. */
int64_t ktki_project_bf16_items(const pctx *c, int a, proj_item *out);
/* Thread scratch of the bf16 step, bytes. */
size_t ktki_project_bf16_scratch(const pctx *c);
void ktki_project_bf16_run(const pctx *c, const ktk_mat *m, const proj_item *it, void *scratch);
#endif
