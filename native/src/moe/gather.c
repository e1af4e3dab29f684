/* The activations of a forward, gathered and quantized as the kernels read them (kernels/kernels.h):
 *   x: every routed row's hidden state, rows sorted by (expert, token): bf16 zero-padded to Kp (bf16 and fp8
 *      weights), or int8 per row (symmetric: scale + sum) for int8 and int4 weights, plus int4's exact bf16 copies
 *      for its dequantizing path;
 *   h: the activation of gate/up per row (written by the gate/up items; int8 / int4: quantized here per row);
 *   tiles: for the experts with at least the table's tile_rows rows (AMX), x and h also in tile order, written
 *      once here and read by every kernel call on those rows instead of a copy per call.
 */
#include <stdlib.h>
#include <string.h>

#include "forward.h"

/* KTINJECT_TILES (read at each forward; tests and A/B): 0 never gives the kernels x and h in tile order; N > 0
 * gives them from N rows on whatever table runs (the generic kernels read them too; others ignore them); unset or
 * anything else: the table's tile_rows for the quant. */
int ktki_gather_tile_rows(const ktk_kernels *k, int quant) {
    const char *v = getenv("KTINJECT_TILES");
    char *end;
    long n = v && *v ? strtol(v, &end, 10) : -1;
    return n >= 0 && n < (1L << 30) && *end == 0 ? (int)n : k->tile_rows[quant];
}

/* Tile-order copies of x and h (kernels/kernels.h) for the experts with at least the table's tile_rows rows, where the
 * kernels read them: bf16 rows for bf16 weights, int4's dequantizing path (its bf16 copies) and fp8's, int8 rows for
 * int8 weights; not on the decode path. */
static int plan_tiles(fctx *c) {
    const int min = c->tile_rows;
    c->xt = c->ht = NULL;
    int64_t groups = 0;
    const int on = min > 0 && !c->gemv && (c->quant != KTK_QUANT_INT4 || c->copies) &&
                   ((c->quant != KTK_QUANT_FP8 && c->quant != KTK_QUANT_MXFP4) ||
                    c->fp8_path != KTK_FP8_PATH_DIRECT);   /* fp8 / mxfp4 direct: float rows */
    for (int a = 0; a < c->A; a++) {
        const int n = c->off[a + 1] - c->off[a];
        c->tg[a] = on && n >= min ? (int32_t)groups : -1;
        if (c->tg[a] >= 0) groups += (n + 15) / 16;
    }
    if (groups == 0) return 1;
    c->tes = c->quant == KTK_QUANT_INT8 ? 1 : 2;
    c->xt = ktki_pool_scratch(c->pool, KTKI_SCR_XT, (size_t)groups * 16 * c->KpH * c->tes);
    c->ht = ktki_pool_scratch(c->pool, KTKI_SCR_HT, (size_t)groups * 16 * c->KpI * c->tes);
    return c->xt && c->ht;
}

/* Whether int4 gets bf16 copies, and the scratch of x and h (and their tiles) for c->R rows. 0: out of memory. */
int ktki_gather_plan(fctx *c) {
    const size_t R = (size_t)c->R, KpH = (size_t)c->KpH, KpI = (size_t)c->KpI;
    const int q8 = c->a8;
    c->copies = c->quant == KTK_QUANT_INT4 && c->int4_path != KTK_INT4_PATH_DIRECT &&
                (c->int4_path == KTK_INT4_PATH_DEQUANT || c->maxrows >= KTK_INT4_DEQUANT_MIN_ROWS_ANY);
    if (!plan_tiles(c)) return 0;
    const size_t cx = c->copies ? a64(R * KpH * 2) : 0, ch = c->copies ? a64(R * KpI * 2) : 0;
    uint8_t *x = ktki_pool_scratch(c->pool, KTKI_SCR_X, q8 ? a64(R * KpH) + 2 * a64(R * 4) + cx : a64(R * KpH * 2));
    uint8_t *h = ktki_pool_scratch(c->pool, KTKI_SCR_H, q8 ? a64(R * KpI) + 2 * a64(R * 4) + ch : a64(R * KpI * 2));
    if (!x || !h) return 0;
    if (q8) {
        c->x8 = (int8_t *)x;
        c->xs = (float *)(x + a64(R * KpH));
        c->xsum = (int32_t *)(x + a64(R * KpH) + a64(R * 4));
        c->h8 = (int8_t *)h;
        c->hs = (float *)(h + a64(R * KpI));
        c->hsum = (int32_t *)(h + a64(R * KpI) + a64(R * 4));
        c->hf = ktki_pool_scratch(c->pool, KTKI_SCR_HF, R * (size_t)c->I * 4 + 64);
        if (!c->hf) return 0;
        if (c->copies) {   /* int4: the same int8 values as bf16, for the dequantizing path */
            c->x16 = (uint16_t *)(x + a64(R * KpH) + 2 * a64(R * 4));
            c->h16 = (uint16_t *)(h + a64(R * KpI) + 2 * a64(R * 4));
        }
    } else {
        c->x16 = (uint16_t *)x;
        c->h16 = (uint16_t *)h;
    }
    return 1;
}

/* int8 values as bf16 (exact): the int4 dequantizing path's activations */
static void bf16_copy(const int8_t *src, int n, uint16_t *dst) {
    for (int j = 0; j < n; j++) {   /* |q| <= 127: the float's upper half is exact (vectorizes, unlike rounding) */
        const float f = (float)src[j];
        uint32_t u;
        memcpy(&u, &f, 4);
        dst[j] = (uint16_t)(u >> 16);
    }
}

void ktki_gather_to_tiles(const fctx *c, int h, int a, int r, const void *row, int64_t b0, int64_t b1) {
    if (!c->xt || c->tg[a] < 0) return;
    const int64_t rb = (int64_t)(h ? c->KpI : c->KpH) * c->tes;   /* bytes of a row; a 16-row group: 16 rb */
    const int rel = r - c->off[a];
    char *d = (h ? c->ht : c->xt) + ((int64_t)c->tg[a] + rel / 16) * 16 * rb + (rel % 16) * 64;
    for (int64_t b = b0; b < b1;) {
        const int64_t e = (b / 64 + 1) * 64 < b1 ? (b / 64 + 1) * 64 : b1;
        memcpy(d + b / 64 * 1024 + b % 64, (const char *)row + b, (size_t)(e - b));
        b = e;
    }
}

/* The row the kernels read of row r (x: h = 0, h: h = 1) -> tile order, if its expert (a) has tiles. */
static void row_to_tiles(const fctx *c, int h, int a, int r) {
    const int64_t kp = h ? c->KpI : c->KpH;
    const void *row = c->tes == 1 ? (const void *)((h ? c->h8 : c->x8) + r * kp)
                                  : (const void *)((h ? c->h16 : c->x16) + r * kp);
    ktki_gather_to_tiles(c, h, a, r, row, 0, kp * c->tes);
}

/* Active expert of row r: the last a with off[a] <= r (rows of a token are not in expert order). */
static int expert_of_row(const fctx *c, int r) {
    int lo = 0, hi = c->A - 1;
    while (lo < hi) {
        const int mid = lo + (hi - lo + 1) / 2;
        if (c->off[mid] <= r) lo = mid;
        else hi = mid - 1;
    }
    return lo;
}

/* x row r from the token's hidden state src: int8 + scale + sum (+ bf16 copy), or bf16; zero-padded to Kp. */
static void gather_row(const fctx *c, int r, const char *src, float *tmp) {
    if (c->a8) {
        int8_t *dst = c->x8 + (int64_t)r * c->KpH;
        ktki_pack_to_f32(src, c->t->hidden_dtype, c->H, 1, tmp);
        c->xsum[r] = ktki_pack_quantize_row(tmp, c->H, dst, &c->xs[r]);
        memset(dst + c->H, 0, (size_t)(c->KpH - c->H));
        if (c->copies) bf16_copy(dst, c->KpH, c->x16 + (int64_t)r * c->KpH);
        return;
    }
    uint16_t *dst = c->x16 + (int64_t)r * c->KpH;
    if (c->t->hidden_dtype == KTK_DTYPE_BF16) {
        memcpy(dst, src, (size_t)c->H * 2);
    } else {
        ktki_pack_to_f32(src, c->t->hidden_dtype, c->H, 1, tmp);
        for (int j = 0; j < c->H; j++) dst[j] = ktk_f32_to_bf16(tmp[j]);
    }
    memset(dst + c->H, 0, (size_t)(c->KpH - c->H) * 2);
}

/* x row r as a copy of row r0 of the same token (the same bits gather_row writes: it is deterministic). */
static void copy_row(const fctx *c, int r, int r0) {
    if (c->a8) {
        memcpy(c->x8 + (int64_t)r * c->KpH, c->x8 + (int64_t)r0 * c->KpH, (size_t)c->KpH);
        c->xs[r] = c->xs[r0];
        c->xsum[r] = c->xsum[r0];
        if (!c->copies) return;
    }
    memcpy(c->x16 + (int64_t)r * c->KpH, c->x16 + (int64_t)r0 * c->KpH, (size_t)c->KpH * 2);
}

/* Tokens [item * gtok, ...): each token's hidden state made into its first row once, copied into its other rows. */
void ktki_gather_item(void *ctx, int64_t item, int tid) {
    fctx *c = ctx;
    const int64_t es = ktki_dtype_size(c->t->hidden_dtype);
    float *tmp = ktki_pool_thread_scratch(c->pool, tid);
    const int t1 = (int)((item + 1) * c->gtok < c->T ? (item + 1) * c->gtok : c->T);
    for (int tk = (int)(item * c->gtok); tk < t1; tk++) {
        const int i0 = c->toff[tk], i1 = c->toff[tk + 1];
        if (i0 == i1) continue;
        const int r0 = c->trow[i0];
        gather_row(c, r0, (const char *)c->t->hidden + (int64_t)tk * c->H * es, tmp);
        for (int i = i0 + 1; i < i1; i++) copy_row(c, c->trow[i], r0);
        if (c->xt)
            for (int i = i0; i < i1; i++) row_to_tiles(c, 0, expert_of_row(c, c->trow[i]), c->trow[i]);
    }
}

/* With their tiles where the expert has them and r0 starts a 16-row group of it. */
ktk_act ktki_gather_rows(const fctx *c, int h, int a, int r0, int r1, int tid) {
    ktk_act x = {r1 - r0, h ? c->KpI : c->KpH, NULL, NULL, NULL, NULL, NULL, 0, KTK_INT4_PATH_AUTO, NULL,
                 KTK_FP8_PATH_AUTO};
    int64_t o = (int64_t)r0 * x.Kp;
    const int rel = r0 - c->off[a];
    if (c->xt && c->tg[a] >= 0 && rel % 16 == 0)
        x.tiles = (h ? c->ht : c->xt) + ((int64_t)c->tg[a] + rel / 16) * 16 * x.Kp * c->tes;
    if (!c->a8) {   /* bf16 rows; fp8 also the thread's workspace */
        x.x_bf16 = (h ? c->h16 : c->x16) + o;
        if (c->quant == KTK_QUANT_FP8 || c->quant == KTK_QUANT_MXFP4) {
            x.fp8_path = c->fp8_path;
            x.work = (char *)ktki_pool_thread_scratch(c->pool, tid) + c->work_off;
            x.work_bytes = c->work_bytes;
        }
        return x;
    }
    x.x_i8 = (h ? c->h8 : c->x8) + o;
    x.x_scale = (h ? c->hs : c->xs) + r0;
    x.x_sum = (h ? c->hsum : c->xsum) + r0;
    x.int4_path = c->int4_path;
    if (c->copies) {
        x.x_bf16 = (h ? c->h16 : c->x16) + o;
        x.work = (char *)ktki_pool_thread_scratch(c->pool, tid) + c->work_off;
        x.work_bytes = c->work_bytes;
    }
    return x;
}

void ktki_gather_quantize_h_item(void *ctx, int64_t item, int tid) {
    fctx *c = ctx;
    (void)tid;
    const int64_t r0 = c->hq_r0 + item * c->hq_rows;   /* rows [hq_r0, hq_r1): every row, or a split part's */
    ktki_gather_quantize_h_rows(c, (int)r0, (int)(r0 + c->hq_rows < c->hq_r1 ? r0 + c->hq_rows : c->hq_r1));
}

void ktki_gather_quantize_h_rows(const fctx *c, int r0, int r1) {
    for (int r = r0; r < r1; r++) {
        int8_t *dst = c->h8 + (int64_t)r * c->KpI;
        c->hsum[r] = ktki_pack_quantize_row(c->hf + (int64_t)r * c->I, c->I, dst, &c->hs[r]);
        memset(dst + c->I, 0, (size_t)(c->KpI - c->I));
        if (c->copies) bf16_copy(dst, c->KpI, c->h16 + (int64_t)r * c->KpI);
        if (c->xt) row_to_tiles(c, 1, expert_of_row(c, r), r);
    }
}
