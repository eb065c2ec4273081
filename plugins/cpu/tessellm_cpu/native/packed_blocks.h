/* GGML packed blocks as the CPU plugin's packed linears read them (included by
 * linear_packed.c and linear_q8act.c; part of their cache keys). A row of K weights is K / 32
 * blocks: Q8_0 34 B (fp16 d, int8 q[32]), Q4_0 18 B (fp16 d, nibbles), Q4_1 20 B (fp16 d,
 * fp16 m, nibbles); see tessellm.quant.formats. With AVX-512: the scales of 16 blocks of a
 * row at once (one gather, one conversion), instead of one scalar fp16 conversion per block. */
#ifndef TESSELLM_PACKED_BLOCKS_H
#define TESSELLM_PACKED_BLOCKS_H
#include <stdint.h>

#define QK 32
enum { Q4_0 = 2, Q4_1 = 3, Q8_0 = 8 };

static inline int64_t block_bytes(int qtype) {
    return qtype == Q8_0 ? 34 : qtype == Q4_1 ? 20 : 18;
}

#ifdef __AVX512F__
#include <immintrin.h>
/* Lanes 0 .. n-1 of a 16-lane group (n >= 16: all). */
static inline __mmask16 group_mask(int64_t n) {
    return n >= 16 ? (__mmask16)0xffff : (__mmask16)((1u << n) - 1);
}

/* The fp16 words at the start of blocks g .. g + 15 of a row (`base` = block g), as 32-bit
 * lanes: the block's d in the low half, the next fp16 (Q4_1's m) in the high half; lanes
 * outside `gm` are 0. */
static inline __m512i block_heads(const uint8_t *base, int64_t bb, __mmask16 gm) {
    const __m512i idx = _mm512_mullo_epi32(
        _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15),
        _mm512_set1_epi32((int)bb));
    return _mm512_mask_i32gather_epi32(_mm512_setzero_si512(), gm, idx, base, 1);
}

static inline __m512 half_lo(__m512i words) {
    return _mm512_cvtph_ps(_mm512_cvtepi32_epi16(words));
}
static inline __m512 half_hi(__m512i words) {
    return _mm512_cvtph_ps(_mm512_cvtepi32_epi16(_mm512_srli_epi32(words, 16)));
}

/* The offset per unit of x sum of blocks whose heads are `heads` and scales `d`: m (Q4_1),
 * -8 d (Q4_0), 0 (Q8_0). */
static inline __m512 block_offsets(__m512i heads, __m512 d, int qtype) {
    return qtype == Q4_1 ? half_hi(heads)
         : qtype == Q4_0 ? _mm512_mul_ps(d, _mm512_set1_ps(-8.f)) : _mm512_setzero_ps();
}
#endif

#endif
