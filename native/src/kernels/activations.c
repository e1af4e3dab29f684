/* The activation functions of gate/up on a row segment: silu(g) * u (SiLU experts), gpt-oss's clamped variant or
 * DeepSeek-V4's clamped SwiGLU (silu(min(g, limit)) * clamp(u, -limit, limit)), with the biases. Vectorized where
 * the CPU has AVX-512 (a long prefill computes tens of millions of them a layer, and scalar expf was a visible part
 * of its time): exp from a degree-6 polynomial after range reduction (Cephes' expf constants, about 1 ulp, inputs
 * clamped to +-88; past 88 the product is 0), so results may differ from the scalar expf path in the last bits; one
 * CPU always takes the same path. Elsewhere: libm's expf. The clamps of both clamped activations take a NaN gate or
 * up to the limit, as fminf / fmaxf do (the scalar path, and the same as before vectorizing). */
#include <immintrin.h>
#include <math.h>

#include "../internal.h"

static inline float act_scalar(int act, float alpha, float limit, float g, float u) {
    if (act == KTK_ACT_SILU) return g / (1.0f + expf(-g)) * u;
    g = fminf(g, limit);
    u = fminf(fmaxf(u, -limit), limit);
    if (act == KTK_ACT_SWIGLU_LIMIT) return g / (1.0f + expf(-g)) * u;
    return g / (1.0f + expf(-alpha * g)) * (u + 1.0f);
}

static void act_plain(int act, float alpha, float limit, const float *g, const float *u, const float *bg,
                      const float *bu, int n, float *out) {
    for (int j = 0; j < n; j++)
        out[j] = act_scalar(act, alpha, limit, g[j] + (bg ? bg[j] : 0.0f), u[j] + (bu ? bu[j] : 0.0f));
}

#pragma GCC push_options
#pragma GCC target("avx512f")
static inline __m512 exp512(__m512 x) {
    x = _mm512_max_ps(_mm512_min_ps(x, _mm512_set1_ps(88.0f)), _mm512_set1_ps(-88.0f));
    const __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504088896341f)),
                                          _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693359375f), x);
    r = _mm512_fnmadd_ps(n, _mm512_set1_ps(-2.12194440e-4f), r);
    __m512 p = _mm512_set1_ps(1.9875691500e-4f);
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.3981999507e-3f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(8.3334519073e-3f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(4.1665795894e-2f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.6666665459e-1f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(5.0000001201e-1f));
    p = _mm512_fmadd_ps(p, _mm512_mul_ps(r, r), _mm512_add_ps(r, _mm512_set1_ps(1.0f)));
    return _mm512_scalef_ps(p, n);
}

static void act_avx512(int act, float alpha, float limit, const float *g, const float *u, const float *bg,
                       const float *bu, int n, float *out) {
    const __m512 one = _mm512_set1_ps(1.0f), lim = _mm512_set1_ps(limit), nalpha = _mm512_set1_ps(-alpha);
    for (int j = 0; j < n; j += 16) {
        const __mmask16 m = n - j >= 16 ? (__mmask16)0xffff : (__mmask16)((1u << (n - j)) - 1);
        __m512 gv = _mm512_maskz_loadu_ps(m, g + j), uv = _mm512_maskz_loadu_ps(m, u + j);
        if (bg) gv = _mm512_add_ps(gv, _mm512_maskz_loadu_ps(m, bg + j));
        if (bu) uv = _mm512_add_ps(uv, _mm512_maskz_loadu_ps(m, bu + j));
        __m512 y, arg;
        if (act == KTK_ACT_SILU) {
            arg = _mm512_sub_ps(_mm512_setzero_ps(), gv);
            y = _mm512_mul_ps(_mm512_div_ps(gv, _mm512_add_ps(one, exp512(arg))), uv);
        } else {
            gv = _mm512_min_ps(gv, lim);
            uv = _mm512_min_ps(_mm512_max_ps(uv, _mm512_sub_ps(_mm512_setzero_ps(), lim)), lim);
            const int swiglu = act == KTK_ACT_SWIGLU_LIMIT;
            arg = swiglu ? _mm512_sub_ps(_mm512_setzero_ps(), gv) : _mm512_mul_ps(nalpha, gv);
            y = _mm512_mul_ps(_mm512_div_ps(gv, _mm512_add_ps(one, exp512(arg))), swiglu ? uv : _mm512_add_ps(uv, one));
        }
        /* exp's argument past 88 (clamped there): sigmoid is below 1e-38, the product 0 to float precision */
        y = _mm512_mask_blend_ps(_mm512_cmp_ps_mask(arg, _mm512_set1_ps(88.0f), _CMP_GT_OQ), y, _mm512_setzero_ps());
        _mm512_mask_storeu_ps(out + j, m, y);
    }
}
#pragma GCC pop_options

void ktki_activations(int act, float alpha, float limit, const float *g, const float *u, const float *bg,
                     const float *bu, int n, float *out) {
    (ktki_dispatch_isa_available(KTK_ISA_AVX512) ? act_avx512 : act_plain)(act, alpha, limit, g, u, bg, bu, n, out);
}
