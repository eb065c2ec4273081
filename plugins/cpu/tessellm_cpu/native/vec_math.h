/* Float math shared by the CPU plugin's C kernels (included; part of every kernel's cache
 * key, see tessellm_cpu.native_build.library_key). */
#ifndef TESSELLM_VEC_MATH_H
#define TESSELLM_VEC_MATH_H
#include <stdint.h>
#include <string.h>

/* exp(x) for x <= 0 (softmax after subtracting the max, sigmoid of -|x|): 2^n * p(r),
 * |rel err| < 2e-7; inputs below -87 give 0. */
static inline float exp_nonpos(float x) {
    const float log2e = 1.44269504088896341f, ln2_hi = 0.693359375f, ln2_lo = -2.12194440e-4f;
    const float xc = x < -87.f ? -87.f : x;
    const float n = __builtin_floorf(xc * log2e + 0.5f);
    const float r = xc - n * ln2_hi - n * ln2_lo;
    float p = 1.9875691500e-4f;
    p = p * r + 1.3981999507e-3f;
    p = p * r + 8.3334519073e-3f;
    p = p * r + 4.1665795894e-2f;
    p = p * r + 1.6666665459e-1f;
    p = p * r + 5.0000001201e-1f;
    p = p * r * r + r + 1.f;
    const int32_t bits = ((int32_t)n + 127) << 23;
    float scale;
    memcpy(&scale, &bits, sizeof scale);
    return x < -87.f ? 0.f : p * scale;
}

#ifdef __AVX512F__
#include <immintrin.h>
/* exp_nonpos on 16 lanes (the same steps, vectorized). */
static inline __m512 exp_nonpos16(__m512 x) {
    const __m512 xc = _mm512_max_ps(x, _mm512_set1_ps(-87.f));
    const __m512 n = _mm512_roundscale_ps(
        _mm512_fmadd_ps(xc, _mm512_set1_ps(1.44269504088896341f), _mm512_set1_ps(0.5f)),
        _MM_FROUND_TO_NEG_INF | _MM_FROUND_NO_EXC);
    __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693359375f), xc);
    r = _mm512_fnmadd_ps(n, _mm512_set1_ps(-2.12194440e-4f), r);
    __m512 p = _mm512_set1_ps(1.9875691500e-4f);
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.3981999507e-3f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(8.3334519073e-3f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(4.1665795894e-2f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.6666665459e-1f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(5.0000001201e-1f));
    p = _mm512_fmadd_ps(_mm512_mul_ps(p, r), r, _mm512_add_ps(r, _mm512_set1_ps(1.f)));
    const __m512i bits = _mm512_slli_epi32(
        _mm512_add_epi32(_mm512_cvtps_epi32(n), _mm512_set1_epi32(127)), 23);
    const __m512 y = _mm512_mul_ps(p, _mm512_castsi512_ps(bits));
    return _mm512_maskz_mov_ps(_mm512_cmp_ps_mask(x, _mm512_set1_ps(-87.f), _CMP_GE_OQ), y);
}

/* silu(v) = v * sigmoid(v), sigmoid from exp(-|v|) (no overflow either way). */
static inline __m512 silu16(__m512 v) {
    const __m512 e = exp_nonpos16(_mm512_min_ps(v, _mm512_sub_ps(_mm512_setzero_ps(), v)));
    const __m512 one = _mm512_set1_ps(1.f), den = _mm512_add_ps(one, e);
    const __mmask16 neg = _mm512_cmp_ps_mask(v, _mm512_setzero_ps(), _CMP_LT_OQ);
    const __m512 sig = _mm512_div_ps(_mm512_mask_blend_ps(neg, one, e), den);
    return _mm512_mul_ps(v, sig);
}
#endif
#endif
