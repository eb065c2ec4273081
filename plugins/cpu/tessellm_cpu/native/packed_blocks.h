/* GGML packed blocks as the CPU plugin's packed linears read them (included by
 * linear_packed.c and linear_q8act.c; part of their cache keys). A row of K weights is K / 32
 * legacy blocks: Q8_0 34 B (fp16 d, int8 q[32]), Q4_0 18 B (fp16 d, nibbles), Q4_1 20 B
 * (fp16 d, fp16 m, nibbles), Q5_0 22 B (fp16 d, u32 qh, nibbles), Q5_1 24 B (fp16 d, fp16 m,
 * u32 qh, nibbles); or K / 256 K-quant super-blocks (k_quant_blocks.h); see
 * tessellm.quant.formats. With AVX-512: the scales of 16 blocks of a row at once (one gather,
 * one conversion), instead of one scalar fp16 conversion per block. */
#ifndef TESSELLM_PACKED_BLOCKS_H
#define TESSELLM_PACKED_BLOCKS_H
#include <stdint.h>
#include <string.h>

#define QK 32
#define QK_K 256
enum { Q4_0 = 2, Q4_1 = 3, Q5_0 = 6, Q5_1 = 7, Q8_0 = 8, Q4_K = 12, Q5_K = 13, Q6_K = 14 };

static inline int is_k_quant(int qtype) { return qtype == Q4_K || qtype == Q5_K || qtype == Q6_K; }

/* Bytes of a block (of a super-block for K-quants); 0 for a type this plugin does not read. */
static inline int64_t block_bytes(int qtype) {
    switch (qtype) {
    case Q4_0: return 18;
    case Q4_1: return 20;
    case Q5_0: return 22;
    case Q5_1: return 24;
    case Q8_0: return 34;
    case Q4_K: return 144;
    case Q5_K: return 176;
    case Q6_K: return 210;
    default: return 0;
    }
}

/* Weights per block: 256 for a K-quant super-block, else 32. */
static inline int64_t block_weights(int qtype) { return is_k_quant(qtype) ? QK_K : QK; }

#if defined(__F16C__) || defined(__AVX512F__)
#include <immintrin.h>
#endif
static inline float f16_to_f32(const uint8_t *p) {
    uint16_t h;
    memcpy(&h, p, 2);
#ifdef __F16C__
    return _cvtsh_ss(h);
#else
    uint32_t sign = (uint32_t)(h & 0x8000u) << 16, exp = (h >> 10) & 0x1fu, man = h & 0x3ffu, u;
    if (exp == 0) {
        if (man == 0) { u = sign; }
        else {  /* subnormal: normalize */
            exp = 127 - 15 + 1;
            while (!(man & 0x400u)) { man <<= 1; exp--; }
            u = sign | (exp << 23) | ((man & 0x3ffu) << 13);
        }
    } else if (exp == 31) { u = sign | 0x7f800000u | (man << 13); }
    else { u = sign | ((exp + 127 - 15) << 23) | (man << 13); }
    float f;
    memcpy(&f, &u, 4);
    return f;
#endif
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

/* The offset per unit of x sum of blocks whose heads are `heads` and scales `d`: m (Q4_1,
 * Q5_1), -8 d (Q4_0), -16 d (Q5_0), 0 (Q8_0). */
static inline __m512 block_offsets(__m512i heads, __m512 d, int qtype) {
    return qtype == Q4_1 || qtype == Q5_1 ? half_hi(heads)
         : qtype == Q4_0 ? _mm512_mul_ps(d, _mm512_set1_ps(-8.f))
         : qtype == Q5_0 ? _mm512_mul_ps(d, _mm512_set1_ps(-16.f)) : _mm512_setzero_ps();
}
#endif

#endif
