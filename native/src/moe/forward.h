/* Internal to one forward (forward.c: steps, items, phases; route.c: the route step; gather.c: the activations the
 * kernels read; pipeline.c: the decode pipeline). */
#ifndef KTKI_FORWARD_H
#define KTKI_FORWARD_H
#include "../internal.h"

#define RT 256                /* rows per gemm call */
#define TC 1024               /* tokens per down item */
#define CWMAX 8               /* 16-column blocks per item at most (128 columns) */
#define ITEMS_PER_THREAD 4
#define GATHER_ROWS 32        /* rows of h an item quantizes; a gather item: ceil(GATHER_ROWS / k) tokens */
#define HQ_ROWS_FEW 4         /* rows of h per item where a forward has few rows (decode steps of a batch) */
#define DECODE_ROWS 4         /* decode path: every expert at most this many rows */
#ifndef PIPE_DN_BLOCKS        /* (both: -D for A/B builds, benchmarks/ab_flags.sh) */
#define PIPE_DN_BLOCKS 2      /* decode pipeline (pipeline.c): 16-column blocks of H per down unit, */
#endif
#ifndef PIPE_DN_EXPERTS
#define PIPE_DN_EXPERTS 4     /* ... of this many experts (one gemv: 8 weight streams, as the two-phase path's) */
#endif
_Static_assert(PIPE_DN_EXPERTS >= 1 && PIPE_DN_EXPERTS <= KTK_GEMV_MAX, "PIPE_DN_EXPERTS: 1..KTK_GEMV_MAX");

typedef struct { int32_t a, r0, r1, cb0, cb1; } gu_item; /* active expert index, rows, column blocks */

typedef struct {
    ktk_task *t;                       /* (a split task's done_top is raised through it) */
    const ktk_experts *ex;
    ktk_gemm_fn gemm;
    ktk_pool *pool;
    int T, k, E, H, I, quant, act, KpH, KpI, UI, UH;
    int a8;                            /* int8 activations (int8 and int4 weights) */
    int int4_path, copies;             /* int4: KTK_INT4_PATH_*, bf16 copies of x and h + workspaces made */
    int fp8_path;                      /* fp8: KTK_FP8_PATH_* (bf16 activations, a workspace per thread always) */
    int64_t work_off, work_bytes;      /* int4 / fp8 workspace inside each thread's scratch (0 bytes: none) */
    float alpha, limit;
    int A, R, maxrows;                 /* active experts, rows, most rows of one expert */
    int nparts, pa[3];                 /* 1, or 2 for a split task (ktk_task_split): part p = actives [pa[p], pa[p+1]),
                                          immediate slots then deferred ones (their rows in the same order) */
    int dpart;                         /* off the pipeline, the part the open phases compute (-1: every part) */
    int64_t base;                      /* the unit or item the open phase's item 0 is (a split part's first) */
    int64_t gu_part1;                  /* the item path: part 1's first gate/up item */
    int hq_r0, hq_r1;                  /* the open quantization phase's rows */
    int32_t *start, *act_e, *off, *tok;  /* [E x nparts] (routing keys), [A], [A+1], [R] */
    int32_t *tg;                       /* [A]: first 16-row group of the expert in xt / ht, or -1 (no tiles) */
    int32_t *toff, *trow;              /* [T+1], [R]: the rows of token t are trow[toff[t] .. toff[t+1]) */
    int gtok, hq_rows;                 /* tokens per gather item, rows per item of h's quantization */
    char *xt, *ht;                     /* x and h in AMX tile order (kernels/kernels.h), or NULL */
    int tes;                           /* their element size: 2 (bf16; int4's bf16 copies) or 1 (int8) */
    float *wt;                          /* [R] routing weight of each row */
    uint16_t *x16, *h16;
    int8_t *x8, *h8;
    float *xs, *hs, *hf;
    int32_t *xsum, *hsum;
    gu_item *gu;
    int64_t ngu;
    int cw_gu, cw_dn, ntc;
    ktk_gemv_fn gemv;                  /* decode path (NULL: the item path) */
    int nt;                            /* pool threads */
    int tile_rows;                     /* the kernels read tiles from this many rows (0: never) */
    int step;                          /* ktki_forward_step: the next phase */
    /* decode pipeline (pipeline.c): gate/up and down of every expert in one phase */
    int pipe, UHc;                     /* on; groups of PIPE_DN_BLOCKS blocks of H */
    int pipe_phases;                   /* how a split task's parts run: SPLIT_* (forward.c: KTINJECT_DEFER_PHASES) */
    _Atomic int32_t *gu_left;          /* [A] gate/up units of the expert not yet done */
    _Atomic int32_t *h_ready;          /* [A] its h row is complete (and quantized) */
    _Atomic int32_t *dn_left;          /* [nparts][UHc] the part's expert groups whose down of that column group
                                          is not yet done */
    _Atomic int32_t top_left;          /* part 0's column groups not yet summed (a split task raises done_top at 0) */
    float *yd;                         /* [R][UH * 16] each row's down output (no routing weight, no bias) */
} fctx;

enum { SPLIT_ONE = 1, SPLIT_CUT, SPLIT_TWO };   /* a split task's parts: one phase, one cut at their boundary, two */

/* forward.c, for pipeline.c */
/* Gate/up of expert a (active index), rows [r0, r1), blocks [cb0, cb1) -> h; gs, us: the thread's scratch. */
void ktki_forward_gate_up(const fctx *c, int a, int r0, int r1, int cb0, int cb1, float *gs, float *us, int tid);
/* acc[tok[r] - t0][0, jn) += wt[r] * (y[r - r0][0, jn) + bd) for rows [r0, r1) (y, acc: rows of bw floats) */
void ktki_forward_accumulate(const fctx *c, const float *y, int bw, int jn, const float *bd, int r0, int r1, int t0,
                         float *acc);
/* out[t][j0, +jn) = ar (part 1 of a split task: out2) */
void ktki_forward_write_out(const fctx *c, int part, int t, int j0, int jn, const float *ar);
void ktki_forward_zero_out(const fctx *c, int part);   /* the part's whole out (or out2) = 0 */

/* route.c: the first step; KTK_OK or an error (an id out of range, an expert routed to but never set) */
int ktki_route(fctx *c);

/* pipeline.c: the decode pipeline */
int ktki_pipeline_plan(fctx *c);                   /* counters and yd; 0 when out of memory */
int64_t ktki_pipeline_units(const fctx *c);        /* units of every part */
int64_t ktki_pipeline_part_units(const fctx *c, int p);   /* units of part p */
void ktki_pipeline_range(void *ctx, int64_t u0, int64_t u1, int tid);   /* items [u0, u1) of the open phase */

/* gather.c: the activations the kernels read */
int ktki_gather_tile_rows(const ktk_kernels *k, int quant);   /* rows from which x, h also go in tile order */
int ktki_gather_plan(fctx *c);                 /* scratch of x, h (and tiles); 0 when out of memory */
void ktki_gather_item(void *ctx, int64_t item, int tid);      /* x: the rows of gtok tokens per item */
void ktki_gather_quantize_h_item(void *ctx, int64_t item, int tid);  /* int8 / int4: h rows from hf */
void ktki_gather_quantize_h_rows(const fctx *c, int r0, int r1);     /* the same for rows [r0, r1) */
/* Bytes [b0, b1) of row r (of active expert a) of x (h = 0) or h (h = 1) -> its tiles, if the expert has tiles. */
void ktki_gather_to_tiles(const fctx *c, int h, int a, int r, const void *row, int64_t b0, int64_t b1);
/* Rows [r0, r1) of active expert a of x (h = 0) or h (h = 1) as the kernels take them, for thread tid. */
ktk_act ktki_gather_rows(const fctx *c, int h, int a, int r0, int r1, int tid);
#endif
