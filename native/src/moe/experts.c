/* Experts of one MoE layer: packed storage (one zero-filled mapping), set/get/bias, export/import.
 *
 * Region of expert e (E regions back to back, each a multiple of 64 bytes; the whole mapping is what
 * ktk_experts_export copies):
 *   gate [I, H], up [I, H], down [H, I], each packed per kernels/kernels.h:
 *     bf16: data [Np * Kp] uint16
 *     int8: data [Np * Kp] int8, scale [Np] float, wsum [Np] int32
 *     int4: data [Np * Kp / 2] nibbles, scale [Np / 16][Kp / G][16] float (Kp = round_up(K, max(64, G)))
 *     fp8:  data [Np * Kp] e4m3 bytes, scale [Np / 16][ceil(Kp / G)] float, its bytes rounded up to 64 (Kp =
 *           round_up(K, 64); each 16-row block holds the scale of its block_rows block)
 *     mxfp4: data [Np * Kp / 2] e2m1 nibbles, scale [Np / 16][Kp / 32][16] e8m0 bytes, rounded up to 64 (Kp =
 *           round_up(K, 64))
 *   with has_bias: gate bias [Np(I)] float, up bias [Np(I)] float, down bias [Np(H)] float (zero padding).
 */
#define _GNU_SOURCE
#include <math.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>

#include "../internal.h"

static int64_t round_up(int64_t x, int64_t m) { return (x + m - 1) / m * m; }

static int64_t mat_bytes(int quant, int64_t Np, int64_t Kp, int64_t G) {
    if (quant == KTK_QUANT_INT4) return Np * Kp / 2 + Np * (Kp / G) * 4;   /* both multiples of 64 */
    if (quant == KTK_QUANT_FP8) return Np * Kp + round_up(Np / 16 * ((Kp + G - 1) / G) * 4, 64);
    if (quant == KTK_QUANT_MXFP4) return Np * Kp / 2 + round_up(Np * Kp / KTK_MXFP4_GROUP, 64);
    return quant == KTK_QUANT_BF16 ? Np * Kp * 2 : Np * Kp + Np * 4 + Np * 4;
}

/* int4 / fp8 group size of a config (0 means the default: 64, 128), and fp8's rows per scale (0: 128) */
static int32_t group_of(const ktk_experts_config *cfg) {
    if (cfg->quant == KTK_QUANT_FP8) return cfg->group_size ? cfg->group_size : 128;
    if (cfg->quant == KTK_QUANT_MXFP4) return KTK_MXFP4_GROUP;
    return cfg->quant != KTK_QUANT_INT4 ? 0 : cfg->group_size ? cfg->group_size : 64;
}
static int32_t block_rows_of(const ktk_experts_config *cfg) {
    return cfg->quant != KTK_QUANT_FP8 ? 0 : cfg->block_rows ? cfg->block_rows : 128;
}

int ktki_experts_create(const ktk_experts_config *cfg, ktk_experts **out) {
    ktk_experts *ex = calloc(1, sizeof *ex);
    if (!ex) return ktki_error(KTK_ERR_NOMEM, "ktk_experts_create: out of memory");
    ex->cfg = *cfg;
    ex->cfg.group_size = group_of(cfg);   /* the effective int4 / fp8 group size; 0 for other quants */
    ex->cfg.block_rows = block_rows_of(cfg);
    const int32_t H = cfg->hidden, I = cfg->intermediate;
    const int32_t N[3] = {I, I, H}, K[3] = {H, H, I}, G = group_of(cfg);
    int64_t off = 0;
    for (int w = 0; w < 3; w++) {
        ex->out_n[w] = N[w];
        ex->in_k[w] = K[w];
        ex->Np[w] = (int32_t)round_up(N[w], 16);
        ex->Kp[w] = (int32_t)round_up(K[w], cfg->quant == KTK_QUANT_INT4 && G > 64 ? G : 64);
        ex->mat_off[w] = off;
        off += mat_bytes(cfg->quant, ex->Np[w], ex->Kp[w], G);
    }
    for (int w = 0; w < 3; w++) {
        ex->bias_off[w] = cfg->has_bias ? off : -1;
        if (cfg->has_bias) off += (int64_t)ex->Np[w] * 4;
    }
    ex->expert_bytes = round_up(off, 64);
    ex->nbytes = ex->expert_bytes * cfg->num_experts;
    ex->ready = calloc((size_t)cfg->num_experts * 3, 1);
    void *base = mmap(NULL, (size_t)ex->nbytes, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
    if (!ex->ready || base == MAP_FAILED) {
        long long nbytes = (long long)ex->nbytes;
        if (base != MAP_FAILED) munmap(base, (size_t)ex->nbytes);
        free(ex->ready);
        free(ex);
        return ktki_error(KTK_ERR_NOMEM, "ktk_experts_create: cannot allocate %lld bytes of packed weights", nbytes);
    }
#ifdef MADV_HUGEPAGE
    if (ex->nbytes >= (1 << 21)) (void)madvise(base, (size_t)ex->nbytes, MADV_HUGEPAGE);
#endif
    ex->base = base;
    *out = ex;
    return KTK_OK;
}

void ktki_experts_destroy(ktk_experts *ex) {
    munmap(ex->base, (size_t)ex->nbytes);
    free(ex->ready);
    free(ex);
}

ktk_mat ktki_experts_mat(const ktk_experts *ex, int e, int which) {
    uint8_t *p = ex->base + ex->expert_bytes * e + ex->mat_off[which];
    int64_t Np = ex->Np[which], Kp = ex->Kp[which];
    ktk_mat m = {ex->out_n[which], ex->in_k[which], (int32_t)Np, (int32_t)Kp, ex->cfg.quant, NULL, NULL, NULL, NULL,
                 NULL, 0, NULL, NULL, NULL};
    if (ex->cfg.quant == KTK_QUANT_BF16) {
        m.data_bf16 = (const uint16_t *)p;
    } else if (ex->cfg.quant == KTK_QUANT_MXFP4) {
        m.data_f4 = p;
        m.scale_e8 = p + Np * Kp / 2;
        m.group = KTK_MXFP4_GROUP;
    } else if (ex->cfg.quant == KTK_QUANT_FP8) {
        m.data_f8 = p;
        m.scale = (const float *)(p + Np * Kp);
        m.group = ex->cfg.group_size;
    } else if (ex->cfg.quant == KTK_QUANT_INT4) {
        m.data_i4 = p;
        m.scale = (const float *)(p + Np * Kp / 2);
        m.group = ex->cfg.group_size;
    } else {
        m.data_i8 = (const int8_t *)p;
        m.scale = (const float *)(p + Np * Kp);
        m.wsum = (const int32_t *)(p + Np * Kp + Np * 4);
    }
    return m;
}

const float *ktki_experts_bias(const ktk_experts *ex, int e, int which) {
    if (ex->bias_off[which] < 0) return NULL;
    return (const float *)(ex->base + ex->expert_bytes * e + ex->bias_off[which]);
}

/* fp8: one block_rows band of rows at a time (a scale is the amax of its whole block) */
static int set_fp8_bands(ktk_experts *ex, int e, int which, const char *src, int dtype, int64_t so, int64_t si) {
    ktk_mat m = ktki_experts_mat(ex, e, which);
    const int br = ex->cfg.block_rows, band = br < m.N ? br : m.N;
    float *rows = malloc((size_t)band * m.K * sizeof(float));
    if (!rows) return ktki_error(KTK_ERR_NOMEM, "ktk_experts_set: out of memory (%d rows of %d)", band, m.K);
    const int64_t es = ktki_dtype_size(dtype);
    for (int n0 = 0; n0 < m.N; n0 += br) {
        const int n1 = n0 + br < m.N ? n0 + br : m.N;
        for (int n = n0; n < n1; n++)
            ktki_pack_to_f32(src + (int64_t)n * so * es, dtype, m.K, si, rows + (int64_t)(n - n0) * m.K);
        ktki_pack_fp8(&m, (uint8_t *)m.data_f8, (float *)m.scale, n0, n1, rows);
    }
    free(rows);
    ex->ready[(int64_t)e * 3 + which] = 1;
    return KTK_OK;
}

/* mxfp4: every row checked (finite: every finite float fits under e8m0's largest scale) before a byte is stored */
static int set_mxfp4_rows(ktk_experts *ex, int e, int which, const char *src, int dtype, int64_t so, int64_t si) {
    ktk_mat m = ktki_experts_mat(ex, e, which);
    float *rows = malloc((size_t)m.N * m.K * sizeof(float));
    if (!rows) return ktki_error(KTK_ERR_NOMEM, "ktk_experts_set: out of memory (%d rows of %d)", m.N, m.K);
    const int64_t es = ktki_dtype_size(dtype);
    for (int n = 0; n < m.N; n++) {
        float *row = rows + (int64_t)n * m.K;
        ktki_pack_to_f32(src + (int64_t)n * so * es, dtype, m.K, si, row);
        for (int c = 0; c < m.K; c++)
            if (!isfinite(row[c])) {
                free(rows);
                return ktki_error(KTK_ERR_RANGE, "ktk_experts_set: element [%d][%d] = %g cannot be mxfp4 (finite "
                                  "values expected; expert %d, matrix %d)", n, c, (double)row[c], e, which);
            }
    }
    for (int n = 0; n < m.N; n++)
        ktki_pack_mxfp4(&m, (uint8_t *)m.data_f4, (uint8_t *)m.scale_e8, n, rows + (int64_t)n * m.K);
    free(rows);
    ex->ready[(int64_t)e * 3 + which] = 1;
    return KTK_OK;
}

int ktki_experts_set(ktk_experts *ex, int e, int which, const void *src, int dtype, int64_t so, int64_t si) {
    if (ex->cfg.quant == KTK_QUANT_FP8) return set_fp8_bands(ex, e, which, src, dtype, so, si);
    if (ex->cfg.quant == KTK_QUANT_MXFP4) return set_mxfp4_rows(ex, e, which, src, dtype, so, si);
    ktk_mat m = ktki_experts_mat(ex, e, which);
    float *row = malloc((size_t)m.K * sizeof(float));
    int8_t *q = m.quant == KTK_QUANT_INT8 ? malloc((size_t)m.K) : NULL;
    if (!row || (m.quant == KTK_QUANT_INT8 && !q)) {
        free(row);
        free(q);
        return ktki_error(KTK_ERR_NOMEM, "ktk_experts_set: out of memory");
    }
    const char *base = src;
    const int64_t es = ktki_dtype_size(dtype);
    for (int n = 0; n < m.N; n++) {
        ktki_pack_to_f32(base + (int64_t)n * so * es, dtype, m.K, si, row);
        if (m.quant == KTK_QUANT_BF16)
            ktki_pack_bf16(&m, (uint16_t *)m.data_bf16, n, row);
        else if (m.quant == KTK_QUANT_INT4)
            ktki_pack_int4(&m, (uint8_t *)m.data_i4, (float *)m.scale, n, row);
        else
            ktki_pack_int8(&m, (int8_t *)m.data_i8, (float *)m.scale, (int32_t *)m.wsum, n, row, q);
    }
    free(row);
    free(q);
    ex->ready[(int64_t)e * 3 + which] = 1;
    return KTK_OK;
}

int ktki_experts_set_quantized(ktk_experts *ex, int e, int which, const int8_t *q, int64_t qso, int64_t qsi,
                               const float *scale, int64_t sso, int64_t ssg) {
    ktk_mat m = ktki_experts_mat(ex, e, which);
    const int lo = m.quant == KTK_QUANT_INT4 ? -8 : -127, hi = m.quant == KTK_QUANT_INT4 ? 7 : 127;
    const int groups = m.quant == KTK_QUANT_INT4 ? (m.K + m.group - 1) / m.group : 1;
    for (int n = 0; n < m.N; n++) {   /* everything checked before a byte is stored */
        for (int c = 0; c < m.K; c++) {
            const int v = q[n * qso + c * qsi];
            if (v < lo || v > hi)
                return ktki_error(KTK_ERR_RANGE, "ktk_experts_set_quantized: q[%d][%d] = %d is outside %d..%d "
                                  "(expert %d, matrix %d)", n, c, v, lo, hi, e, which);
        }
        for (int g = 0; g < groups; g++) {
            const float s = scale[n * sso + g * ssg];
            if (!isfinite(s))
                return ktki_error(KTK_ERR_RANGE, "ktk_experts_set_quantized: scale of row %d, group %d is %g "
                                  "(expert %d, matrix %d)", n, g, (double)s, e, which);
        }
    }
    for (int n = 0; n < m.N; n++) {
        if (m.quant == KTK_QUANT_INT4)
            ktki_pack_int4_q(&m, (uint8_t *)m.data_i4, (float *)m.scale, n, q + n * qso, qsi, scale + n * sso, ssg);
        else
            ktki_pack_int8_q(&m, (int8_t *)m.data_i8, (float *)m.scale, (int32_t *)m.wsum, n, q + n * qso, qsi,
                             scale[n * sso]);
    }
    ex->ready[(int64_t)e * 3 + which] = 1;
    return KTK_OK;
}

int ktki_experts_set_fp8(ktk_experts *ex, int e, int which, const uint8_t *q, int64_t qso, int64_t qsi,
                         const float *scale, int64_t sso, int64_t ssg) {
    ktk_mat m = ktki_experts_mat(ex, e, which);
    const int br = ex->cfg.block_rows, G = m.group, bands = (m.N + br - 1) / br, groups = (m.K + G - 1) / G;
    for (int n = 0; n < m.N; n++)   /* everything checked before a byte is stored */
        for (int c = 0; c < m.K; c++) {
            const uint8_t v = q[n * qso + c * qsi];
            if ((v & 0x7f) == 0x7f)
                return ktki_error(KTK_ERR_RANGE, "ktk_experts_set_fp8: q[%d][%d] = 0x%02x is a NaN code of float8 "
                                  "e4m3 (expert %d, matrix %d)", n, c, v, e, which);
        }
    for (int b = 0; b < bands; b++)
        for (int g = 0; g < groups; g++) {
            const float s = scale[b * sso + g * ssg];
            if (!isfinite(s))
                return ktki_error(KTK_ERR_RANGE, "ktk_experts_set_fp8: scale of block (%d, %d) (rows %d.., inputs "
                                  "%d..) is %g (expert %d, matrix %d)", b, g, b * br, g * G, (double)s, e, which);
        }
    for (int n = 0; n < m.N; n++)
        ktki_pack_fp8_q(&m, (uint8_t *)m.data_f8, (float *)m.scale, n, q + n * qso, qsi, scale + (n / br) * sso, ssg);
    ex->ready[(int64_t)e * 3 + which] = 1;
    return KTK_OK;
}

int ktki_experts_set_mxfp4(ktk_experts *ex, int e, int which, const uint8_t *blocks, int64_t bso,
                           const uint8_t *scales, int64_t sso) {
    ktk_mat m = ktki_experts_mat(ex, e, which);
    const int groups = m.K / KTK_MXFP4_GROUP;
    for (int n = 0; n < m.N; n++)   /* everything checked before a byte is stored */
        for (int g = 0; g < groups; g++)
            if (scales[n * sso + g] == 0xff)
                return ktki_error(KTK_ERR_RANGE, "ktk_experts_set_mxfp4: scale of row %d, group %d (inputs %d..%d) is "
                                  "0xff, the NaN code of e8m0 (expert %d, matrix %d)", n, g, g * KTK_MXFP4_GROUP,
                                  g * KTK_MXFP4_GROUP + KTK_MXFP4_GROUP - 1, e, which);
    for (int n = 0; n < m.N; n++)
        ktki_pack_mxfp4_q(&m, (uint8_t *)m.data_f4, (uint8_t *)m.scale_e8, n, blocks + n * bso, scales + n * sso);
    ex->ready[(int64_t)e * 3 + which] = 1;
    return KTK_OK;
}

int ktki_experts_set_bias(ktk_experts *ex, int e, int which, const void *src, int dtype) {
    float *b = (float *)ktki_experts_bias(ex, e, which);
    ktki_pack_to_f32(src, dtype, ex->out_n[which], 1, b);
    return KTK_OK;
}

int ktki_experts_get(const ktk_experts *ex, int e, int which, float *dst) {
    ktk_mat m = ktki_experts_mat(ex, e, which);
    for (int n = 0; n < m.N; n++) ktki_pack_unpack(&m, n, dst + (int64_t)n * m.K);
    return KTK_OK;
}

int ktki_experts_import(ktk_experts *ex, const void *src, int64_t size) {
    memcpy(ex->base, src, (size_t)size);
    memset(ex->ready, 1, (size_t)ex->cfg.num_experts * 3);
    return KTK_OK;
}

/* Zero-copy view of one matrix (ktk_experts_raw): pointers into the mapping, layout of kernels/kernels.h. */
int ktki_experts_raw(const ktk_experts *ex, int e, int which, ktk_raw *out) {
    ktk_mat m = ktki_experts_mat(ex, e, which);
    memset(out, 0, sizeof *out);
    out->quant = m.quant;
    out->N = m.N;
    out->K = m.K;
    out->Np = m.Np;
    out->Kp = m.Kp;
    if (m.quant == KTK_QUANT_INT4) {
        out->data = m.data_i4;
        out->data_bytes = (int64_t)m.Np * m.Kp / 2;
    } else if (m.quant == KTK_QUANT_FP8) {
        out->data = m.data_f8;
        out->data_bytes = (int64_t)m.Np * m.Kp;
    } else if (m.quant == KTK_QUANT_MXFP4) {
        out->data = m.data_f4;
        out->data_bytes = (int64_t)m.Np * m.Kp / 2;
    } else {
        out->data = m.quant == KTK_QUANT_BF16 ? (const void *)m.data_bf16 : (const void *)m.data_i8;
        out->data_bytes = (int64_t)m.Np * m.Kp * (m.quant == KTK_QUANT_BF16 ? 2 : 1);
    }
    out->scale = m.quant == KTK_QUANT_BF16 ? NULL : m.quant == KTK_QUANT_MXFP4 ? (const float *)m.scale_e8 : m.scale;
    out->bias = ktki_experts_bias(ex, e, which);
    out->expert = ex->base + ex->expert_bytes * e;
    out->expert_bytes = ex->expert_bytes;
    return KTK_OK;
}
