/* Conversions to bf16 for the bf16 products of training's projections (moe/project_bf16.c): the reference of the
 * ISA versions (ktk_bwd_kernels.bf16_rows, bf16_pairs), which give the same bits, and int8's dequantization to the
 * bf16 packed layout (no ISA version). Round to nearest even, NaN kept NaN (ktk_f32_to_bf16).
 * Layouts: see ../kernels.h. Plain loops.
 */
#include "../kernels.h"

void ktk_generic_bf16_rows(const float *src, int n, uint16_t *dst) {
    for (int i = 0; i < n; i++) dst[i] = ktk_f32_to_bf16(src[i]);
}

void ktk_generic_bf16_pairs(const float *r0, const float *r1, int64_t ldr, int n, uint16_t *dst, int64_t ldd) {
    for (int i = 0; i < n; i++)
        for (int j = 0; j < 16; j++) {
            dst[i * ldd + 2 * j] = ktk_f32_to_bf16(r0[i * ldr + j]);
            dst[i * ldd + 2 * j + 1] = ktk_f32_to_bf16(r1[i * ldr + j]);
        }
}

/* int8 blocks [nb0, nb1) -> bf16(q * scale[n]) in the bf16 layout (block b at dst + (b - nb0) * 16 * Kp): each
 * 64-byte row of the int8 layout (16 outputs x inputs 4r..4r+3) becomes the pair rows 2r and 2r + 1 */
void ktk_generic_dequant_int8(const ktk_mat *w, int nb0, int nb1, uint16_t *dst) {
    const int64_t Kp = w->Kp;
    for (int b = nb0; b < nb1; b++) {
        const int8_t *src = w->data_i8 + (int64_t)b * 16 * Kp;
        uint16_t *out = dst + (int64_t)(b - nb0) * 16 * Kp;
        for (int64_t r = 0; r < Kp / 4; r++)
            for (int j = 0; j < 16; j++) {
                const float s = w->scale[b * 16 + j];
                for (int c = 0; c < 4; c++)
                    out[(2 * r + c / 2) * 32 + j * 2 + c % 2] = ktk_f32_to_bf16((float)src[r * 64 + j * 4 + c] * s);
            }
    }
}
