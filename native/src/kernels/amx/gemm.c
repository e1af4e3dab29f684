/* AMX kernels: AMX-BF16 (tdpbf16ps) and AMX-INT8 (tdpbssd, signed x signed: no +128 shift) for many rows;
 * below KTK_AMX_MIN_ROWS_* rows the AVX-512 kernels (FMA for bf16, VNNI for int8; every AMX CPU has VNNI) run.
 *
 * Tiles (palette 1, 64 bytes a row): tmm0..3 = C (2 row tiles x 2 column blocks, fp32 / int32 16 x 16),
 * tmm4..5 = A (16 rows of x, 64 bytes = 32 bf16 / 64 int8 inputs, stride Kp * elemsize),
 * tmm6..7 = B (one column block: 16 packed 64-byte rows, contiguous, stride 64; the packed layout of kernels.h
 * is exactly the AMX B-tile order).
 * Blocking: blocks of the output range in chunks of NBC (weights of a K chunk stay in L2), K in chunks of 1 KB of
 * a row (KC_BYTES), 32-row groups x block pairs inside; for bf16 with many rows the A tiles of a (row group,
 * K chunk) are first copied to a 32 KB stack buffer in tile order (pack_a: x rows are Kp * elemsize apart and alias
 * in L1), then used for every block pair, unless the caller gives x in tile order already (act.tiles, kernels.h:
 * the forward writes it once per expert; tile_rows in the table): on forward-shaped work (native/tests/probes/
 * amx_ab.sh) the given tiles are faster than the copy per call, and skipping the copy entirely (the fake-pack
 * variant: wrong results) shows what the copy still costs. The machine's own bounds (native/tests/probes/
 * amx_probe.c) are well above what these kernels reach: tiles are not renamed, so a tileloadd waits for the tdp
 * reading its register, which bounds the 2x2 scheme (docs/history/readme-performance.md has the figures).
 * Partial sums between K chunks live in y itself (fp32 for bf16; int32 bit patterns for int8, scaled to fp32 at
 * the end). Rows n % 16 are a last group with a tile config of r rows (A and C tiles), so any n works.
 * Tile config: sttilecfg is compared with ours at entry (another AMX user on this thread may have changed it),
 * then tracked locally. OS permission (arch_prctl) is the dispatcher's job.
 * Tile ops are written as inline asm with "memory" clobbers (the GCC 12 intrinsics under-declare memory).
 */
#include <stdint.h>
#include <string.h>
#include <immintrin.h>
#include "../kernels.h"

#include "amx.h"
#ifndef KC_BYTES
#define KC_BYTES 1024         /* K chunk per row, bytes */
#endif
#ifndef NBC
#define NBC 32                /* column blocks per L2 chunk (NBC * KC_BYTES * 16 = 512 KB of weights) */
#endif

#define KTK_AI static inline __attribute__((always_inline))

/* AVX-512 kernels of ../avx512/gemm.c used below the crossover (the FMA one for bf16: faster than vdpbf16ps here) */
void ktk_avx512_gemm_bf16_plain(const ktk_mat *w, int nb0, int nb1, const ktk_act *x, float *y, int64_t ldy);
void ktk_avx512_gemm_int8_vnni(const ktk_mat *w, int nb0, int nb1, const ktk_act *x, float *y, int64_t ldy);

typedef struct __attribute__((aligned(64))) {
    uint8_t palette_id, start_row, reserved[14];
    uint16_t colsb[16];
    uint8_t rows[16];
} amx_cfg;

#define TLOAD(t, base, stride) \
    __asm__ volatile("tileloadd (%0,%1,1), %%tmm" #t ::"r"((const void *)(base)), "r"((long)(stride)) : "memory")
#define TSTORE(t, base, stride) \
    __asm__ volatile("tilestored %%tmm" #t ", (%0,%1,1)" ::"r"((void *)(base)), "r"((long)(stride)) : "memory")
#define TZERO(t) __asm__ volatile("tilezero %%tmm" #t ::)
#define TDP_BF16(c, a, b) __asm__ volatile("tdpbf16ps %%tmm" #b ", %%tmm" #a ", %%tmm" #c ::)
#define TDP_I8(c, a, b) __asm__ volatile("tdpbssd %%tmm" #b ", %%tmm" #a ", %%tmm" #c ::)

static void cfg_make(amx_cfg *c, int rows) {
    memset(c, 0, sizeof *c);
    c->palette_id = 1;
    for (int i = 0; i < 8; i++) {
        c->colsb[i] = 64;
        c->rows[i] = (uint8_t)(i < 6 ? rows : 16);   /* C (0-3) and A (4-5): rows; B (6-7): 16 */
    }
}

/* Load the tile config for `rows` rows unless *cur says it is loaded; cur < 0: compare with the hardware's. */
static void cfg_set(int rows, int *cur) {
    if (*cur == rows) return;
    amx_cfg want;
    cfg_make(&want, rows);
    if (*cur < 0) {
        amx_cfg have;
        __asm__ volatile("sttilecfg %0" : "=m"(have)::"memory");
        if (memcmp(&have, &want, sizeof want) == 0) { *cur = rows; return; }
    }
    __asm__ volatile("ldtilecfg %0" ::"m"(want) : "memory");
    *cur = rows;
}

/* Order of tile loads and tdps in a step (tests pass with each): 0 each load just before its first tdp; 1
 * software-pipelined (each tile of step s + 1 loaded right after the last tdp of step s that reads it); 2 all loads
 * of a step first, then its tdps. A/B as above, TFLOPS / TOPS of orders 0 / 1 / 2 (two runs): bf16 rows 5.14 / 5.29 /
 * 4.55 and 4.95 / 5.17 / -, with tiles 5.87 / 6.20; int8 rows 11.6 / 13.7 / 12.5 and 11.7 / 12.3 / -, tiles 13.4 /
 * 13.4. An earlier sweep (W 2048 x 2048, one matrix per call) had 0 ahead for int8: host noise is +-15% here. */
#ifndef AMX_ORDER
#define AMX_ORDER 1
#endif

/* One (row group, block pair, K chunk) step, all in bytes. A: the group's A tiles of the chunk's first K step (tile
 * 2 at A + a_tile, step s at A + s * a_step, row stride sa); B0: the first block's packed rows of the chunk (step s
 * at B0 + s * 1024, second block at + b_blk); C: y at the group's first row and the pair's first column.
 * NA A tiles (16 rows each), NB B tiles, I8 picks tdpbssd over tdpbf16ps; first zeroes C, else C is loaded from y. */
KTK_AI void amx_step(const char *A, int64_t sa, int64_t a_step, int64_t a_tile, const char *B0, int64_t b_blk,
                     int steps, float *C, int64_t ldc, int first, const int NA, const int NB, const int I8) {
    const int64_t ldcb = ldc * 4;
    if (first) {
        TZERO(0); if (NB == 2) TZERO(1);
        if (NA == 2) { TZERO(2); if (NB == 2) TZERO(3); }
    } else {
        TLOAD(0, C, ldcb); if (NB == 2) TLOAD(1, C + 16, ldcb);
        if (NA == 2) { TLOAD(2, C + 16 * ldc, ldcb); if (NB == 2) TLOAD(3, C + 16 * ldc + 16, ldcb); }
    }
#if AMX_ORDER == 1
    /* software-pipelined: each tile of step s + 1 is loaded right after the last tdp of step s that reads it
     * (tiles are not renamed, so a load into a tile waits for those reads; this lets it overlap later tdps) */
    TLOAD(4, A, sa); TLOAD(6, B0, 64);
    if (NB == 2) TLOAD(7, B0 + b_blk, 64);
    if (NA == 2) TLOAD(5, A + a_tile, sa);
    for (int s = 0; s < steps; s++) {
        const int more = s + 1 < steps;
        const char *a = A + (s + 1) * a_step, *b = B0 + (int64_t)(s + 1) * 1024;
        if (I8) TDP_I8(0, 4, 6); else TDP_BF16(0, 4, 6);
        if (NB == 2) { if (I8) TDP_I8(1, 4, 7); else TDP_BF16(1, 4, 7); }
        if (more) TLOAD(4, a, sa);
        if (NA == 2) {
            if (I8) TDP_I8(2, 5, 6); else TDP_BF16(2, 5, 6);
            if (more) TLOAD(6, b, 64);
            if (NB == 2) { if (I8) TDP_I8(3, 5, 7); else TDP_BF16(3, 5, 7); }
            if (more) { if (NB == 2) TLOAD(7, b + b_blk, 64); TLOAD(5, a + a_tile, sa); }
        } else if (more) {
            TLOAD(6, b, 64);
            if (NB == 2) TLOAD(7, b + b_blk, 64);
        }
    }
#elif AMX_ORDER == 2
    for (int s = 0; s < steps; s++) {
        const char *a = A + s * a_step, *b = B0 + (int64_t)s * 1024;
        TLOAD(4, a, sa); if (NA == 2) TLOAD(5, a + a_tile, sa);
        TLOAD(6, b, 64); if (NB == 2) TLOAD(7, b + b_blk, 64);
        if (I8) TDP_I8(0, 4, 6); else TDP_BF16(0, 4, 6);
        if (NB == 2) { if (I8) TDP_I8(1, 4, 7); else TDP_BF16(1, 4, 7); }
        if (NA == 2) {
            if (I8) TDP_I8(2, 5, 6); else TDP_BF16(2, 5, 6);
            if (NB == 2) { if (I8) TDP_I8(3, 5, 7); else TDP_BF16(3, 5, 7); }
        }
    }
#else
    for (int s = 0; s < steps; s++) {
        const char *a = A + s * a_step, *b = B0 + (int64_t)s * 1024;
        TLOAD(4, a, sa);
        TLOAD(6, b, 64);
        if (I8) TDP_I8(0, 4, 6); else TDP_BF16(0, 4, 6);
        if (NB == 2) { TLOAD(7, b + b_blk, 64); if (I8) TDP_I8(1, 4, 7); else TDP_BF16(1, 4, 7); }
        if (NA == 2) {
            TLOAD(5, a + a_tile, sa);
            if (I8) TDP_I8(2, 5, 6); else TDP_BF16(2, 5, 6);
            if (NB == 2) { if (I8) TDP_I8(3, 5, 7); else TDP_BF16(3, 5, 7); }
        }
    }
#endif
    TSTORE(0, C, ldcb); if (NB == 2) TSTORE(1, C + 16, ldcb);
    if (NA == 2) { TSTORE(2, C + 16 * ldc, ldcb); if (NB == 2) TSTORE(3, C + 16 * ldc + 16, ldcb); }
}

#pragma GCC push_options
#pragma GCC target("avx512f")
/* Copy `rows` (<= 32) rows of a K chunk (steps x 64 bytes per row, row stride sx) into tile order: step s, tile
 * a, row r at buf + s * 2048 + a * 1024 + r * 64. Rows of x lie Kp * elemsize apart, often a multiple of 2-4 KB, so
 * loaded in place the 16-32 rows of A tiles fall in a few L1 sets and evict each other; packed they stay in L1 for
 * all the block pairs of the chunk. */
static void pack_a(char *buf, const char *x, int64_t sx, int rows, int steps) {
#if defined(KTK_TEST_BUILD) && defined(AMX_FAKE_PACK)   /* timing experiment only (amx_ab.sh): wrong results */
    (void)buf, (void)x, (void)sx, (void)rows, (void)steps;
    return;
#endif
    for (int i = 0; i < rows; i++) {
        const char *src = x + i * sx;
        char *dst = buf + (i / 16) * 1024 + (i % 16) * 64;
        for (int s = 0; s < steps; s++)
            _mm512_store_si512((void *)(dst + (int64_t)s * 2048), _mm512_loadu_si512((const void *)(src + s * 64)));
    }
}
#pragma GCC pop_options

/* Pack A (pack_a) for bf16 from this many rows: below, the copy costs more than the L1 aliasing it avoids; above,
 * packed runs faster the more rows share it. int8: within noise for many rows and worse for few, so never
 * (docs/performance.md). (-DAMX_PACK_MIN_ROWS_BF16=0 / =1000000: always / never.) */
#ifndef AMX_PACK_MIN_ROWS_BF16
#define AMX_PACK_MIN_ROWS_BF16 64
#endif

/* All rows x blocks [nb0, nb1) x K, for one element type (I8: int8 -> int32 dot products left in y as bits). */
KTK_AI void amx_tiles(const ktk_mat *w, int nb0, int nb1, const ktk_act *x, float *y, int64_t ldy, const int I8) {
    const int n = x->n, Kp = w->Kp, n16 = n & ~15, es = I8 ? 1 : 2;
    const int64_t sx = (int64_t)Kp * es, b_blk = (int64_t)Kp * 16 * es;   /* bytes: x row, packed block */
    const char *xs = I8 ? (const char *)x->x_i8 : (const char *)x->x_bf16;
    const char *ws = I8 ? (const char *)w->data_i8 : (const char *)w->data_bf16;
    char abuf[KC_BYTES / 64 * 2048] __attribute__((aligned(64)));
    const char *tl = (const char *)x->tiles;
    const int64_t a_group = sx * 16;   /* tile order: bytes of one 16-row group */
    const int pack = !I8 && n >= AMX_PACK_MIN_ROWS_BF16;
    int cur = -1;
    for (int bc = nb0; bc < nb1; bc += NBC) {
        const int bce = nb1 - bc < NBC ? nb1 : bc + NBC;
        for (int64_t kb = 0; kb < sx; kb += KC_BYTES) {                     /* K chunk, in bytes of a row */
            const int steps = (int)((sx - kb < KC_BYTES ? sx - kb : KC_BYTES) / 64), first = kb == 0;
            for (int t = 0; t < n;) {           /* groups of 32 rows, then 16, then the tail (config of r rows) */
                const int rows = n16 - t >= 32 ? 32 : n16 - t >= 16 ? 16 : n - t, na = rows > 16 ? 2 : 1;
                cfg_set(rows >= 16 ? 16 : rows, &cur);
                const char *A = xs + (int64_t)t * sx + kb;
                int64_t sa = sx, a_step = 64, a_tile = 16 * sx;
                if (tl) {   /* the caller's tile-order copy: group t / 16, step kb / 64 */
                    A = tl + (t / 16) * a_group + kb / 64 * 1024;
                    sa = 64, a_step = 1024, a_tile = a_group;
                } else if (pack) {
                    pack_a(abuf, A, sx, rows, steps);
                    A = abuf, sa = 64, a_step = 2048, a_tile = 1024;
                }
                for (int b = bc; b < bce; b += 2) {
                    float *C = y + (int64_t)t * ldy + (int64_t)(b - nb0) * 16;
                    const char *B0 = ws + b * b_blk + kb * 16;
#define STEP(NA, NB) amx_step(A, sa, a_step, a_tile, B0, b_blk, steps, C, ldy, first, NA, NB, I8)
                    if (na == 2) { if (bce - b >= 2) STEP(2, 2); else STEP(2, 1); }
                    else { if (bce - b >= 2) STEP(1, 2); else STEP(1, 1); }
#undef STEP
                }
                t += rows;
            }
        }
    }
}

static void amx_tiles_bf16(const ktk_mat *w, int nb0, int nb1, const ktk_act *x, float *y, int64_t ldy) {
    amx_tiles(w, nb0, nb1, x, y, ldy, 0);
}

static void amx_tiles_int8_raw(const ktk_mat *w, int nb0, int nb1, const ktk_act *x, float *y, int64_t ldy) {
    amx_tiles(w, nb0, nb1, x, y, ldy, 1);
}

#pragma GCC push_options
#pragma GCC target("avx512f,avx512bw,avx512vl")
/* y holds int32 dot products: y = (float)acc * x_scale[t] * scale[j], in place */
static void scale_int8(const ktk_mat *w, int nb0, int nb1, const ktk_act *x, float *y, int64_t ldy) {
    for (int t = 0; t < x->n; t++) {
        const __m512 xs = _mm512_set1_ps(x->x_scale[t]);
        float *yt = y + (int64_t)t * ldy;
        for (int b = nb0; b < nb1; b++) {
            float *p = yt + (int64_t)(b - nb0) * 16;
            const __m512 f = _mm512_cvtepi32_ps(_mm512_loadu_si512((const void *)p));
            _mm512_storeu_ps(p, _mm512_mul_ps(_mm512_mul_ps(f, xs), _mm512_loadu_ps(w->scale + b * 16)));
        }
    }
}
#pragma GCC pop_options

/* Raw AMX paths (any n >= 1), exported for the kernel tests and the crossover measurement. */
void ktk_amx_gemm_bf16_tiles(const ktk_mat *w, int nb0, int nb1, const ktk_act *x, float *y, int64_t ldy) {
    if (x->n <= 0 || nb1 <= nb0) return;
    amx_tiles_bf16(w, nb0, nb1, x, y, ldy);
}

void ktk_amx_gemm_int8_tiles(const ktk_mat *w, int nb0, int nb1, const ktk_act *x, float *y, int64_t ldy) {
    if (x->n <= 0 || nb1 <= nb0) return;
    amx_tiles_int8_raw(w, nb0, nb1, x, y, ldy);
    scale_int8(w, nb0, nb1, x, y, ldy);
}

static void gemm_bf16_amx(const ktk_mat *w, int nb0, int nb1, const ktk_act *x, float *y, int64_t ldy) {
    if (x->n < KTK_AMX_MIN_ROWS_BF16) ktk_avx512_gemm_bf16_plain(w, nb0, nb1, x, y, ldy);
    else ktk_amx_gemm_bf16_tiles(w, nb0, nb1, x, y, ldy);
}

static void gemm_int8_amx(const ktk_mat *w, int nb0, int nb1, const ktk_act *x, float *y, int64_t ldy) {
    if (x->n < KTK_AMX_MIN_ROWS_INT8) ktk_avx512_gemm_int8_vnni(w, nb0, nb1, x, y, ldy);
    else ktk_amx_gemm_int8_tiles(w, nb0, nb1, x, y, ldy);
}

void ktk_amx_gemm_int4(const ktk_mat *w, int nb0, int nb1, const ktk_act *x, float *y, int64_t ldy); /* int4.c */
void ktk_amx_gemm_fp8(const ktk_mat *w, int nb0, int nb1, const ktk_act *x, float *y, int64_t ldy);  /* fp8.c */
void ktk_avx512_gemm_mxfp4(const ktk_mat *w, int nb0, int nb1, const ktk_act *x, float *y, int64_t ldy);
void ktk_avx512_gemv_mxfp4(int M, const ktk_mat *const *w, int nb0, int nb1, const ktk_act *const *x,
                           float *const *y);   /* avx512/mxfp4.c */

/* decode kernels (one row per matrix): those of the AVX-512 kernels this table runs below its crossovers */
#include "../avx512/gemv.h"

static const ktk_kernels amx_table = {
    .name = "amx", .gemm_bf16 = gemm_bf16_amx, .gemm_int8 = gemm_int8_amx, .gemm_int4 = ktk_amx_gemm_int4,
    .gemv_bf16 = ktk_avx512_gemv_bf16_plain, .gemv_int8 = ktk_avx512_gemv_int8_vnni,
    .gemv_int4 = ktk_avx512_gemv_int4_vnni, .gemv_default = 1,
    .tile_rows = {KTK_AMX_MIN_ROWS_BF16, KTK_AMX_MIN_ROWS_INT8, KTK_AMX_INT4_DEQUANT_ROWS, KTK_AMX_FP8_DEQUANT_ROWS},
    .gemm_fp8 = ktk_amx_gemm_fp8, .gemv_fp8 = ktk_avx512_gemv_fp8,
    /* mxfp4: the AVX-512 kernels (direct FMA; from their crossover, dequantized to bf16 + the AVX-512 bf16 kernel, no
     * tiles): no AMX code for mxfp4 */
    .gemm_mxfp4 = ktk_avx512_gemm_mxfp4, .gemv_mxfp4 = ktk_avx512_gemv_mxfp4};

const ktk_kernels *ktk_kernels_amx(void) { return &amx_table; }
