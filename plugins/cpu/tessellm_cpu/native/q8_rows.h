/* Rows of x rounded to int8 blocks for the CPU plugin's int8-activation linears
 * (linear_q8act.c, linear_q8act_amx.c; part of their cache keys): each 32-value block of a row
 * quantized as tessellm.kernels.reference.quantize_q8_blocks does (d = max|x| / 127,
 * q = round-half-even(x / d); an all-zero block has d = 0, q = 0), with d and d * sum(q) kept
 * per block for the scaling and offset terms. Needs AVX-512 F and BW. */
#ifndef TESSELLM_Q8_ROWS_H
#define TESSELLM_Q8_ROWS_H
#include <immintrin.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "packed_blocks.h"

#define INLINE static inline __attribute__((always_inline))

/* Scratch for one row of x: xq (nb rounded up to 4, 32 bytes a block), then dx and sx
 * (dx * sum of the block's xq), nb rounded up to 16 floats each. */
typedef struct {
    int8_t *xq;
    float *dx, *sx;
} QRow;

INLINE int64_t round_up(int64_t v, int64_t m) { return (v + m - 1) / m * m; }

INLINE size_t row_bytes(int64_t nb) {
    return (size_t)round_up(nb, 4) * QK + 2 * sizeof(float) * (size_t)round_up(nb, 16);
}

/* Where the blocks of a row of x go in its xq (the order the unpacked weights come in):
 * Q8_ORDER: block b at b * 32; Q8_NIBBLE_QUADS (Q4_0, Q4_1: four blocks A-D whose 16 bytes of
 * nibbles are one vector, unpacked low then high): A0-15 B0-15 C0-15 D0-15 A16-31 B16-31
 * C16-31 D16-31; Q8_QUADS (Q4_K, Q5_K: one 64-byte load of a super-block's quad of blocks 0-3
 * unpacks blocks 0 and 2 from the low nibbles, 1 and 3 from the high ones): blocks 0, 2, 1, 3
 * of each quad. xq holds nb rounded up to 4 blocks (the padding zero). */
enum { Q8_ORDER = 0, Q8_NIBBLE_QUADS = 1, Q8_QUADS = 2 };

/* Quantize one row of x into the `layout` above. */
static inline void quantize_row(const float *x, int64_t nb, int layout, QRow r) {
    memset(r.xq, 0, (size_t)round_up(nb, 4) * QK);
    memset(r.dx, 0, sizeof(float) * (size_t)round_up(nb, 16));
    memset(r.sx, 0, sizeof(float) * (size_t)round_up(nb, 16));
    static const int quad_slot[4] = {0, 2, 1, 3};
    for (int64_t b = 0; b < nb; b++) {
        const float *p = x + b * QK;
        const __m512 lo = _mm512_loadu_ps(p), hi = _mm512_loadu_ps(p + 16);
        const float amax = _mm512_reduce_max_ps(_mm512_max_ps(_mm512_abs_ps(lo), _mm512_abs_ps(hi)));
        const float d = amax / 127.0f;
        __m512i qlo = _mm512_setzero_si512(), qhi = _mm512_setzero_si512();
        if (d > 0.f) {   /* round to nearest even (MXCSR default), as torch.round */
            const __m512 vd = _mm512_set1_ps(d);
            qlo = _mm512_cvtps_epi32(_mm512_div_ps(lo, vd));
            qhi = _mm512_cvtps_epi32(_mm512_div_ps(hi, vd));
        }
        const __m128i blo = _mm512_cvtsepi32_epi8(qlo), bhi = _mm512_cvtsepi32_epi8(qhi);
        int8_t *dst;
        if (layout == Q8_NIBBLE_QUADS) {
            dst = r.xq + (b / 4) * 128 + (b % 4) * 16;
            _mm_storeu_si128((__m128i *)dst, blo);
            _mm_storeu_si128((__m128i *)(dst + 64), bhi);
        } else {
            dst = r.xq + (layout == Q8_QUADS ? (b / 4) * 4 + quad_slot[b % 4] : b) * QK;
            _mm_storeu_si128((__m128i *)dst, blo);
            _mm_storeu_si128((__m128i *)(dst + 16), bhi);
        }
        const int32_t s = _mm512_reduce_add_epi32(_mm512_add_epi32(qlo, qhi));
        r.dx[b] = d;
        r.sx[b] = d * (float)s;
    }
}

/* The bytes between consecutive quantized rows of nb blocks (a multiple of 64). */
INLINE size_t q8_row_stride(int64_t nb) { return (size_t)round_up((int64_t)row_bytes(nb), 64); }

/* Row i of rows of nb blocks quantized q8_row_stride(nb) bytes apart from `base`: where its
 * int8 blocks, scales and offset terms go. */
INLINE QRow q8_row_at(uint8_t *base, int64_t nb, int64_t i) {
    QRow r;
    uint8_t *p = base + q8_row_stride(nb) * (size_t)i;
    r.xq = (int8_t *)p;
    r.dx = (float *)(p + round_up(nb, 4) * QK);
    r.sx = r.dx + round_up(nb, 16);
    return r;
}

/* Quantized rows of x `per_row` bytes apart from `scratch` (rows[i] points into it); rows
 * past those quantized are left zero (d = 0, q = 0) for callers that pad. */
typedef struct {
    uint8_t *scratch;
    QRow *rows;
    size_t per_row;
} Q8Rows;

#endif
