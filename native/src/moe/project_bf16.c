/* The bf16-products step of ktk_experts_project (project.c's top comment says when it runs and why): x and W rounded
 * to bf16 (nearest even), products summed in float by the ISA's gemm_bf16 (kernels.h; AMX tiles on amx).
 *   transpose 0 (y = W x): item = (expert, chunk of at most RC rows, group of bcw 16-row blocks of W): the blocks in
 *        the bf16 packed layout (bf16 experts: the stored blocks as they are; int8 / int4 / fp8 / mxfp4: bf16(stored
 *        value) in thread scratch, by the backward table's dequant_bf16 where it has one for the quant, else from
 *        its unpack's float columns (bf16_pairs), else by the generic dequantization), the rows as bf16 rows Kx = Kp
 *        apart (zero past K), one gemm_bf16 call.
 *   transpose 1 (y = W^T x): the same on W^T as a packed bf16 matrix of K outputs and N inputs (Kx = round_up(N, 64),
 *        zero past N): item = (expert, row chunk, group of bcw 16-column blocks of W, i.e. of W^T's outputs); every
 *        16-row block of W unpacked to float rows (the backward table's unpack, or ktki_pack_unpack), each pair of
 *        its rows (2p, 2p + 1) x 16 columns made one 64-byte row of W^T's layout (bf16_pairs).
 * An expert's rows split into balanced chunks (at least KTK_PRECISION_BF16_MIN_ROWS each, so that AMX's table
 * always takes its tile path); blocks per item: the most that fit (CW0; W^T: WT_BYTES of scratch), halved (not below
 * 2, W^T: 4, as every W^T item unpacks all of W) until every thread has a few items. gemm_bf16 sums each output in an
 * order of its own that depends on neither the other rows of the call nor the blocks' grouping, so neither do the
 * results (nor on the threads).
 * Legend: project.c's; RC rows per item at most, Kx the bf16 rows' stride.
 */
#include <string.h>

#include "project.h"

#define RC 256               /* rows per item at most */
#define CW0 16               /* transpose 0: W's 16-row blocks per item at most */
#define WT_BYTES (4 << 20)   /* transpose 1: W^T's blocks of one item (and its Y), bytes at most */
#define ITEMS_PER_THREAD 2


int ktki_project_bf16_takes(const pctx *c, int a) {
    return c->p->precision == KTK_PRECISION_BF16 && c->off[a + 1] - c->off[a] >= KTK_PRECISION_BF16_MIN_ROWS;
}

static int chunks_of(int rows) { return (rows + RC - 1) / RC; }
static int out_blocks(const pctx *c) { return (c->transpose ? c->Kt : c->Nt) / 16; }

int64_t ktki_project_bf16_plan(pctx *c) {
    int64_t chunks = 0;
    for (int a = 0; a < c->A; a++)
        if (ktki_project_bf16_takes(c, a)) chunks += chunks_of(c->off[a + 1] - c->off[a]);
    if (!chunks) return 0;
    const ktk_mat m = ktki_experts_mat(c->ex, c->act_e[0], c->p->which);
    c->Kx = c->transpose ? (c->N + 63) & ~63 : m.Kp;
    const int nb = out_blocks(c), low = c->transpose ? 4 : 2;
    const int y_cap = WT_BYTES / (RC * 16 * 4);   /* (Y of an item within the same bound) */
    int cw = c->transpose ? WT_BYTES / (16 * c->Kx * 2) : CW0;
    cw = cw > y_cap ? y_cap : cw;
    cw = cw < 1 ? 1 : cw > nb ? nb : cw;
    const int64_t target = (int64_t)ITEMS_PER_THREAD * (ktki_pool_threads(c->pool) + 1);
    while (cw > low && chunks * ((nb + cw - 1) / cw) < target) cw = (cw + 1) / 2 > low ? (cw + 1) / 2 : low;
    c->bcw = cw;
    static const ktk_dequant_fn generic[5] = {NULL, ktk_generic_dequant_int8, ktk_generic_dequant_int4,
                                              ktk_generic_dequant_fp8, ktk_generic_dequant_mxfp4};
    const ktk_bwd_kernels *bk = ktki_dispatch_backward();
    const int q = m.quant;   /* the backward tables unpack every quant but mxfp4 (as project.c's start) */
    c->bf = (proj_bf16_kernels){ktki_dispatch_kernels()->gemm_bf16, ktk_generic_bf16_rows, ktk_generic_bf16_pairs,
                                bk && q != KTK_QUANT_MXFP4 ? NULL : generic[q]};
    if (bk && bk->bf16_rows) c->bf.rows = bk->bf16_rows;
    if (bk && bk->bf16_pairs) c->bf.pairs = bk->bf16_pairs;
    if (bk && bk->dequant_bf16[q]) c->bf.dequant = bk->dequant_bf16[q];
    return chunks * ((nb + cw - 1) / cw);
}

int64_t ktki_project_bf16_items(const pctx *c, int a, proj_item *out) {
    const int r0 = c->off[a], n = c->off[a + 1] - r0, nch = chunks_of(n), nb = out_blocks(c);
    int64_t i = 0;
    for (int b0 = 0; b0 < nb; b0 += c->bcw)
        for (int k = 0; k < nch; k++)
            out[i++] = (proj_item){a, r0 + (int)((int64_t)n * k / nch), r0 + (int)((int64_t)n * (k + 1) / nch), b0,
                                   b0 + c->bcw < nb ? b0 + c->bcw : nb, 1};
    return i;
}

/* Thread scratch: X [RC][Kx] bf16 (the rows), W [bcw][16][Kx] bf16 (the item's blocks), Y [RC][bcw * 16] float,
 * F [round_up(nin, 16)] float (a row as float), WR [16][Kt] float (a block of W unpacked). */
typedef struct { uint16_t *X, *W; float *Y, *F, *WR; } bscr;

static size_t sizes(const pctx *c, size_t sz[5]) {
    sz[0] = a64((size_t)RC * c->Kx * 2);
    sz[1] = a64((size_t)c->bcw * 16 * c->Kx * 2);
    sz[2] = a64((size_t)RC * c->bcw * 16 * 4);
    sz[3] = a64((size_t)((c->nin + 15) & ~15) * 4);
    sz[4] = a64((size_t)16 * c->Kt * 4);
    return sz[0] + sz[1] + sz[2] + sz[3] + sz[4] + 64;
}

size_t ktki_project_bf16_scratch(const pctx *c) {
    size_t sz[5];
    return sizes(c, sz);
}

static bscr carve(const pctx *c, void *scratch) {
    size_t sz[5];
    sizes(c, sz);
    char *p = scratch;
    bscr s = {(uint16_t *)p, (uint16_t *)(p + sz[0]), (float *)(p + sz[0] + sz[1]),
              (float *)(p + sz[0] + sz[1] + sz[2]), (float *)(p + sz[0] + sz[1] + sz[2] + sz[3])};
    return s;
}

/* Grouped rows [r0, r0 + n) of x as bf16 rows Kx apart, zero from nin to Kx. */
static void load_rows(const pctx *c, int r0, int n, bscr s) {
    const ktk_task *t = &c->p->t;
    const int64_t es = ktki_dtype_size(t->hidden_dtype);
    for (int i = 0; i < n; i++) {
        const char *src = (const char *)t->hidden + (int64_t)c->row[r0 + i] * c->nin * es;
        uint16_t *xr = s.X + (int64_t)i * c->Kx;
        if (t->hidden_dtype == KTK_DTYPE_BF16) {
            memcpy(xr, src, (size_t)c->nin * 2);
        } else if (t->hidden_dtype == KTK_DTYPE_F32) {
            c->bf.rows((const float *)src, c->nin, xr);
        } else {
            ktki_pack_to_f32(src, t->hidden_dtype, c->nin, 1, s.F);
            c->bf.rows(s.F, c->nin, xr);
        }
        memset(xr + c->nin, 0, (size_t)(c->Kx - c->nin) * 2);
    }
}

/* y[rows][16 b0 + (0, outputs of the item)) from Y */
static void store(const pctx *c, const proj_item *it, const float *Y) {
    const int j0 = it->b0 * 16, w = (it->b1 - it->b0) * 16;
    ktki_project_store_rows(c, it->r0, it->r1 - it->r0, j0, c->nout - j0 < w ? c->nout - j0 : w, Y, w);
}

/* transpose 0: Y = X W^T on blocks [b0, b1) of W: stored bf16, or in s.W dequantized by the table's dequant_bf16,
 * else unpacked as columns (the backward table's unpack: wt[c][16]) whose pairs c = 2i, 2i + 1 make the layout's
 * row i, else by the generic dequantization */
static void forward_bf16(const pctx *c, const ktk_mat *m, const proj_item *it, bscr s) {
    const int n = it->r1 - it->r0, nb = it->b1 - it->b0;
    load_rows(c, it->r0, n, s);
    const ktk_act x = {.n = n, .Kp = c->Kx, .x_bf16 = s.X};
    if (m->quant != KTK_QUANT_BF16) {
        if (c->bf.dequant) c->bf.dequant(m, it->b0, it->b1, s.W);
        for (int b = it->b0; b < it->b1 && !c->bf.dequant; b++) {
            uint16_t *dst = s.W + (int64_t)(b - it->b0) * 16 * c->Kx;
            c->bk->unpack(m, b, s.WR, NULL, c->Kt);
            c->bf.pairs(s.WR, s.WR + 16, 32, c->Kt / 2, dst, 32);
            memset(dst + (int64_t)c->Kt * 16, 0, (size_t)(c->Kx - c->Kt) * 16 * 2);   /* inputs [Kt, Kx) */
        }
        const ktk_mat w = {.N = nb * 16, .K = c->K, .Np = nb * 16, .Kp = c->Kx, .quant = KTK_QUANT_BF16,
                           .data_bf16 = s.W};
        c->bf.gemm(&w, 0, nb, &x, s.Y, nb * 16);
    } else {
        c->bf.gemm(m, it->b0, it->b1, &x, s.Y, nb * 16);
    }
    store(c, it, s.Y);
}

/* Block b of W as float rows [16][Kt] at wr, zero past N and K. */
static void unpack_rows(const pctx *c, const ktk_mat *m, int b, float *wr) {
    if (c->bk) {
        c->bk->unpack(m, b, NULL, wr, c->Kt);
        return;
    }
    for (int j = 0; j < 16; j++) {
        float *r = wr + (int64_t)j * c->Kt;
        const int real = b * 16 + j < c->N;
        if (real) ktki_pack_unpack(m, b * 16 + j, r);
        memset(r + (real ? c->K : 0), 0, (size_t)(real ? c->Kt - c->K : c->Kt) * sizeof *r);
    }
}

/* transpose 1: W^T's blocks [b0, b1) (W's columns 16 b0 ..) built in s.W from every block of W, then Y = X W */
static void transposed_bf16(const pctx *c, const ktk_mat *m, const proj_item *it, bscr s) {
    const int n = it->r1 - it->r0, nb = it->b1 - it->b0, Kt = c->Kt, c0 = it->b0 * 16;
    const int64_t blk = (int64_t)16 * c->Kx;   /* elements of one block of W^T */
    for (int b = 0; b < c->Nt / 16; b++) {
        unpack_rows(c, m, b, s.WR);
        for (int p = 0; p < 8; p++)   /* W's rows 16b + 2p, + 1: W^T's pair row 8b + p of each block */
            c->bf.pairs(s.WR + (int64_t)2 * p * Kt + c0, s.WR + (int64_t)(2 * p + 1) * Kt + c0, 16, nb,
                        s.W + (int64_t)(8 * b + p) * 32, blk);
    }
    for (int i = 0; i < nb; i++)   /* W^T's inputs [Nt, Kx): zero */
        memset(s.W + i * blk + (int64_t)c->Nt * 16, 0, (size_t)(c->Kx - c->Nt) * 16 * 2);
    load_rows(c, it->r0, n, s);
    const ktk_act x = {.n = n, .Kp = c->Kx, .x_bf16 = s.X};
    const ktk_mat w = {.N = nb * 16, .K = c->N, .Np = nb * 16, .Kp = c->Kx, .quant = KTK_QUANT_BF16, .data_bf16 = s.W};
    c->bf.gemm(&w, 0, nb, &x, s.Y, nb * 16);
    store(c, it, s.Y);
}

void ktki_project_bf16_run(const pctx *c, const ktk_mat *m, const proj_item *it, void *scratch) {
    (c->transpose ? transposed_bf16 : forward_bf16)(c, m, it, carve(c, scratch));
}
