/* Body of the AVX-512 int4 x int8 micro-kernel (MR rows x NB column blocks of 16 outputs, all of K). int4.c
 * includes it once per instruction variant, under that variant's target pragma, with defined:
 *   MK_INT4                        the function's name
 *   DP2(acc, lo, xl, hi, xh)       acc + the 4-wide dot products of (u8 lo, s8 xl) and of (u8 hi, s8 xh), int32
 * Per group g: acc = sum (q + 8) * x over the group (weights as u8 0..15, x as s8: exact int32), d_g = acc - 8 * sum
 * of x over the group, f = fma((float)d_g, scale[g], f); finally y = f * x_scale: the float operations of the
 * generic reference, so the result is bit-identical. No allocation, no globals.
 */
KTK_AI void MK_INT4(const ktk_mat *w, const ktk_act *x, int b0, int t0, float *y, int64_t ldy, const int MR,
                    const int NB) {
    const int Kp = w->Kp, G = w->group, ng = Kp / G, rows = G / 8;
    const int64_t bs = (int64_t)Kp * 8;                  /* bytes per column block */
    const uint8_t *wb = w->data_i4 + (int64_t)b0 * bs;
    const float *sb = w->scale + (int64_t)b0 * ng * 16;
    const int8_t *xr = x->x_i8 + (int64_t)t0 * Kp;
    const __m512i c88 = _mm512_set1_epi8((char)0x88), c0f = _mm512_set1_epi8(0x0f);
    __m512 f[4][4];
#pragma GCC unroll 4
    for (int m = 0; m < MR; m++)
#pragma GCC unroll 4
        for (int b = 0; b < NB; b++) f[m][b] = _mm512_setzero_ps();
    for (int g = 0; g < ng; g++) {
        const int k0 = g * G;
        const uint8_t *wg = wb + (int64_t)k0 * 8;        /* row k0 / 8 of each block */
        __m512i acc[4][4];
#pragma GCC unroll 4
        for (int m = 0; m < MR; m++)
#pragma GCC unroll 4
            for (int b = 0; b < NB; b++) acc[m][b] = _mm512_setzero_si512();
#pragma GCC unroll 2
        for (int r = 0; r < rows; r++) {                 /* 8 inputs: 64 bytes per block */
            __m512i lo[4], hi[4];
#pragma GCC unroll 4
            for (int b = 0; b < NB; b++) {
                const uint8_t *p = wg + b * bs + r * 64;
                const __m512i v = _mm512_loadu_si512((const void *)p);
                if (PF_BYTES) _mm_prefetch((const char *)p + PF_BYTES, PF_HINT);
                lo[b] = _mm512_ternarylogic_epi32(v, c88, c0f, 0x28);                       /* (v ^ 0x88) & 0x0f */
                hi[b] = _mm512_ternarylogic_epi32(_mm512_srli_epi16(v, 4), c88, c0f, 0x28);
            }
#pragma GCC unroll 4
            for (int m = 0; m < MR; m++) {
                int32_t a, c;
                memcpy(&a, xr + (int64_t)m * Kp + k0 + r * 8, 4);
                memcpy(&c, xr + (int64_t)m * Kp + k0 + r * 8 + 4, 4);
                const __m512i xl = _mm512_set1_epi32(a), xh = _mm512_set1_epi32(c);
#pragma GCC unroll 4
                for (int b = 0; b < NB; b++) acc[m][b] = DP2(acc[m][b], lo[b], xl, hi[b], xh);
            }
        }
#pragma GCC unroll 4
        for (int m = 0; m < MR; m++) {
            const __m512i corr = _mm512_set1_epi32(8 * ktk512_xsum(xr + (int64_t)m * Kp + k0, G));
#pragma GCC unroll 4
            for (int b = 0; b < NB; b++) {
                const float *ps = sb + ((int64_t)b * ng + g) * 16;
                if (PF_BYTES && m == 0) _mm_prefetch((const char *)(ps + 16 * PF_SCALE_GROUPS), PF_HINT);
                const __m512 sc = _mm512_loadu_ps(ps);
                const __m512 d = _mm512_cvtepi32_ps(_mm512_sub_epi32(acc[m][b], corr));
                f[m][b] = _mm512_fmadd_ps(d, sc, f[m][b]);
            }
        }
    }
#pragma GCC unroll 4
    for (int m = 0; m < MR; m++) {
        const __m512 xs = _mm512_set1_ps(x->x_scale[t0 + m]);
#pragma GCC unroll 4
        for (int b = 0; b < NB; b++) _mm512_storeu_ps(y + m * ldy + b * 16, _mm512_mul_ps(f[m][b], xs));
    }
}
