/* The arithmetic of paged_attention.c's decode on contiguous rows of one block of one KV head
 * (included by it; part of its cache key like every header beside it): scores of 16 rows at a
 * time (AVX-512 BF16 dot products, or float32 FMAs) summed by a transpose-and-add network,
 * max and exp of a score run, and P.V accumulation into float32 (bfloat16 rows widened by a
 * shift and a mask). VEC_QK, DP_BF16 and PV_BF16_SPLIT say which vector paths this build has;
 * without AVX-512 the functions are stubs the decode never calls. */
#ifndef TESSELLM_DECODE_ROWS_H
#define TESSELLM_DECODE_ROWS_H
#include <stdint.h>

#include "vec_math.h"

#ifndef INLINE
#define INLINE static inline __attribute__((always_inline))
#endif
#ifdef __AVX512F__
#include <immintrin.h>
/* Lane i of the result = the sum of the 16 lanes of v[i] (a transpose-and-add network: four
 * shuffle stages, then one permutation into order). */
INLINE __m512 hsum16(const __m512 v[16]) {
    __m512 t[8], u[4], w[2];
    for (int j = 0; j < 8; ++j)
        t[j] = _mm512_add_ps(_mm512_shuffle_f32x4(v[2 * j], v[2 * j + 1], 0x44),
                             _mm512_shuffle_f32x4(v[2 * j], v[2 * j + 1], 0xEE));
    for (int k = 0; k < 4; ++k)
        u[k] = _mm512_add_ps(_mm512_shuffle_f32x4(t[2 * k], t[2 * k + 1], 0x88),
                             _mm512_shuffle_f32x4(t[2 * k], t[2 * k + 1], 0xDD));
    for (int k = 0; k < 2; ++k)
        w[k] = _mm512_add_ps(_mm512_shuffle_ps(u[2 * k], u[2 * k + 1], 0x44),
                             _mm512_shuffle_ps(u[2 * k], u[2 * k + 1], 0xEE));
    const __m512 r = _mm512_add_ps(_mm512_shuffle_ps(w[0], w[1], 0x88),
                                   _mm512_shuffle_ps(w[0], w[1], 0xDD));
    return _mm512_permutexvar_ps(
        _mm512_setr_epi32(0, 4, 8, 12, 1, 5, 9, 13, 2, 6, 10, 14, 3, 7, 11, 15), r);
}

INLINE __m512 vload_f32(const float *p) { return _mm512_loadu_ps(p); }
INLINE __m512 vload_bf16(const uint16_t *p) {
    return _mm512_castsi512_ps(_mm512_slli_epi32(
        _mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)p)), 16));
}
/* The largest of sg[0 .. n-1] (n >= 1). */
INLINE float max_of(const float *sg, int64_t n) {
    __m512 m = _mm512_set1_ps(sg[0]);
    for (int64_t i = 0; i < n; i += 16) {
        const __mmask16 k = n - i >= 16 ? (__mmask16)0xffff : (__mmask16)((1u << (n - i)) - 1u);
        m = _mm512_mask_max_ps(m, k, m, _mm512_maskz_loadu_ps(k, sg + i));
    }
    return _mm512_reduce_max_ps(m);
}

/* sg[i] = exp(sg[i] - mx) for i < n; returns their sum. */
INLINE float exp_shift_sum(float *sg, int64_t n, float mx) {
    __m512 sum = _mm512_setzero_ps();
    const __m512 vm = _mm512_set1_ps(mx);
    for (int64_t i = 0; i < n; i += 16) {
        const __mmask16 k = n - i >= 16 ? (__mmask16)0xffff : (__mmask16)((1u << (n - i)) - 1u);
        const __m512 e = exp_nonpos16(_mm512_sub_ps(_mm512_maskz_loadu_ps(k, sg + i), vm));
        _mm512_mask_storeu_ps(sg + i, k, e);
        sum = _mm512_add_ps(sum, _mm512_maskz_mov_ps(k, e));
    }
    return _mm512_reduce_add_ps(sum);
}
#define VEC_QK 1
#else
#define VEC_QK 0
#endif

#if VEC_QK && defined(__AVX512BF16__)
#define DP_BF16 1
/* scores[g * rows + r] = scale (q_g . k_r) for `rows` contiguous rows k_r of D, with AVX-512
 * BF16 dot products (32 products of q and k, both bfloat16 as stored, per instruction, summed
 * in float32), 16 rows at a time. D % 32 == 0. */
INLINE void scores_dpbf16(const uint16_t *q, float scale, const uint16_t *k, int64_t rows,
                          int64_t G, int64_t D, float *scores) {
    const __m512 vs = _mm512_set1_ps(scale);
    for (int64_t r0 = 0; r0 < rows; r0 += 16) {
        const int64_t nr = rows - r0 < 16 ? rows - r0 : 16;
        for (int64_t g = 0; g < G; ++g) {
            const uint16_t *qg = q + g * D;
            __m512 part[16];
            for (int64_t r = 0; r < 16; ++r) {
                __m512 a = _mm512_setzero_ps();
                if (r < nr)
                    for (int64_t c = 0; c < D; c += 32)
                        a = _mm512_dpbf16_ps(a, (__m512bh)_mm512_loadu_si512(qg + c),
                                             (__m512bh)_mm512_loadu_si512(k + (r0 + r) * D + c));
                part[r] = a;
            }
            _mm512_mask_storeu_ps(scores + g * rows + r0, (__mmask16)((1u << nr) - 1u),
                                  _mm512_mul_ps(hsum16(part), vs));
        }
    }
}
#else
#define DP_BF16 0
INLINE void scores_dpbf16(const uint16_t *q, float scale, const uint16_t *k, int64_t rows,
                          int64_t G, int64_t D, float *scores) {
    (void)q; (void)scale; (void)k; (void)rows; (void)G; (void)D; (void)scores;
}
#endif

#if VEC_QK
/* acc[d] += sum over r of p[r] v_r[d] for `rows` contiguous bfloat16 rows v_r of D (D % 32 ==
 * 0). A 64-byte load of 32 features splits into its even features (a shift) and its odd ones
 * (a mask) as float32: two instructions for 32 features where widening loads take four. The
 * accumulators keep even and odd features apart (even and odd rows apart too, for more
 * independent sums) and are interleaved back into acc once at the end. */
INLINE void pv_bf16_split(const float *p, const uint16_t *v, int64_t rows, int64_t D,
                          float *acc) {
    const __m512i even = _mm512_setr_epi32(0, 2, 4, 6, 8, 10, 12, 14, 16, 18, 20, 22, 24, 26,
                                           28, 30);
    const __m512i odd = _mm512_add_epi32(even, _mm512_set1_epi32(1));
    const __m512i lo = _mm512_setr_epi32(0, 16, 1, 17, 2, 18, 3, 19, 4, 20, 5, 21, 6, 22, 7,
                                         23);
    const __m512i hi = _mm512_add_epi32(lo, _mm512_set1_epi32(8));
    const __m512i top = _mm512_set1_epi32((int)0xffff0000u);
#define EVEN_F32(w) _mm512_castsi512_ps(_mm512_slli_epi32((w), 16))
#define ODD_F32(w) _mm512_castsi512_ps(_mm512_and_si512((w), top))
    for (int64_t c = 0; c < D; c += 32) {
        const __m512 x0 = _mm512_loadu_ps(acc + c), x1 = _mm512_loadu_ps(acc + c + 16);
        __m512 ev = _mm512_permutex2var_ps(x0, even, x1), od = _mm512_permutex2var_ps(x0, odd, x1);
        __m512 ev2 = _mm512_setzero_ps(), od2 = _mm512_setzero_ps();
        int64_t r = 0;
        for (; r + 2 <= rows; r += 2) {
            const __m512i w0 = _mm512_loadu_si512(v + r * D + c);
            const __m512i w1 = _mm512_loadu_si512(v + (r + 1) * D + c);
            const __m512 p0 = _mm512_set1_ps(p[r]), p1 = _mm512_set1_ps(p[r + 1]);
            ev = _mm512_fmadd_ps(p0, EVEN_F32(w0), ev);
            od = _mm512_fmadd_ps(p0, ODD_F32(w0), od);
            ev2 = _mm512_fmadd_ps(p1, EVEN_F32(w1), ev2);
            od2 = _mm512_fmadd_ps(p1, ODD_F32(w1), od2);
        }
        if (r < rows) {
            const __m512i w0 = _mm512_loadu_si512(v + r * D + c);
            const __m512 p0 = _mm512_set1_ps(p[r]);
            ev = _mm512_fmadd_ps(p0, EVEN_F32(w0), ev);
            od = _mm512_fmadd_ps(p0, ODD_F32(w0), od);
        }
        ev = _mm512_add_ps(ev, ev2);
        od = _mm512_add_ps(od, od2);
        _mm512_storeu_ps(acc + c, _mm512_permutex2var_ps(ev, lo, od));
        _mm512_storeu_ps(acc + c + 16, _mm512_permutex2var_ps(ev, hi, od));
    }
#undef EVEN_F32
#undef ODD_F32
}
#define PV_BF16_SPLIT 1
#else
#define PV_BF16_SPLIT 0
INLINE void pv_bf16_split(const float *p, const uint16_t *v, int64_t rows, int64_t D,
                          float *acc) {
    (void)p; (void)v; (void)rows; (void)D; (void)acc;
}
#endif

#if VEC_QK
#define DEFINE_ROWS(NAME, T, VLOAD)                                                            \
/* scores[g * rows + r] = qf_g . k_r (qf already scaled), 16 rows at a time. D % 16 == 0. */   \
INLINE void NAME##_scores16(const float *qf, const T *k, int64_t rows, int64_t G, int64_t D,  \
                            float *scores) {                                                   \
    for (int64_t r0 = 0; r0 < rows; r0 += 16) {                                                \
        const int64_t nr = rows - r0 < 16 ? rows - r0 : 16;                                    \
        for (int64_t g = 0; g < G; ++g) {                                                      \
            const float *qg = qf + g * D;                                                      \
            __m512 part[16];                                                                   \
            for (int64_t r = 0; r < 16; ++r) {                                                 \
                __m512 a = _mm512_setzero_ps();                                                \
                if (r < nr)                                                                    \
                    for (int64_t c = 0; c < D; c += 16)                                        \
                        a = _mm512_fmadd_ps(_mm512_loadu_ps(qg + c),                           \
                                            VLOAD(k + (r0 + r) * D + c), a);                   \
                part[r] = a;                                                                   \
            }                                                                                  \
            _mm512_mask_storeu_ps(scores + g * rows + r0, (__mmask16)((1u << nr) - 1u),       \
                                  hsum16(part));                                               \
        }                                                                                      \
    }                                                                                          \
}                                                                                              \
/* acc[d] += sum over r of p[r] v_r[d] for `rows` contiguous rows v_r of D (D % 16 == 0):      \
 * 64 features at a time in registers, even and odd rows in separate accumulators. */          \
INLINE void NAME##_pv(const float *p, const T *v, int64_t rows, int64_t D, float *acc) {      \
    int64_t c = 0;                                                                             \
    for (; c + 64 <= D; c += 64) {                                                             \
        __m512 a[4], e[4];                                                                     \
        for (int i = 0; i < 4; ++i) { a[i] = _mm512_loadu_ps(acc + c + 16 * i);               \
                                      e[i] = _mm512_setzero_ps(); }                            \
        int64_t r = 0;                                                                         \
        for (; r + 2 <= rows; r += 2) {                                                        \
            const __m512 p0 = _mm512_set1_ps(p[r]), p1 = _mm512_set1_ps(p[r + 1]);            \
            const T *v0 = v + r * D + c, *v1 = v0 + D;                                         \
            for (int i = 0; i < 4; ++i) {                                                      \
                a[i] = _mm512_fmadd_ps(p0, VLOAD(v0 + 16 * i), a[i]);                          \
                e[i] = _mm512_fmadd_ps(p1, VLOAD(v1 + 16 * i), e[i]);                          \
            }                                                                                  \
        }                                                                                      \
        if (r < rows) {                                                                        \
            const __m512 p0 = _mm512_set1_ps(p[r]);                                            \
            for (int i = 0; i < 4; ++i)                                                        \
                a[i] = _mm512_fmadd_ps(p0, VLOAD(v + r * D + c + 16 * i), a[i]);               \
        }                                                                                      \
        for (int i = 0; i < 4; ++i) _mm512_storeu_ps(acc + c + 16 * i, _mm512_add_ps(a[i], e[i])); \
    }                                                                                          \
    for (; c < D; c += 16) {                                                                   \
        __m512 a = _mm512_loadu_ps(acc + c);                                                   \
        for (int64_t r = 0; r < rows; ++r)                                                     \
            a = _mm512_fmadd_ps(_mm512_set1_ps(p[r]), VLOAD(v + r * D + c), a);                \
        _mm512_storeu_ps(acc + c, a);                                                          \
    }                                                                                          \
}
#else
#define DEFINE_ROWS(NAME, T, VLOAD)                                                            \
INLINE void NAME##_scores16(const float *qf, const T *k, int64_t rows, int64_t G, int64_t D,  \
                            float *scores) {                                                   \
    (void)qf; (void)k; (void)rows; (void)G; (void)D; (void)scores;                             \
}                                                                                              \
INLINE void NAME##_pv(const float *p, const T *v, int64_t rows, int64_t D, float *acc) {      \
    (void)p; (void)v; (void)rows; (void)D; (void)acc;                                          \
}
INLINE float max_of(const float *sg, int64_t n) { (void)sg; (void)n; return 0.f; }
INLINE float exp_shift_sum(float *sg, int64_t n, float mx) {
    (void)sg; (void)n; (void)mx; return 0.f;
}
#endif

#endif
