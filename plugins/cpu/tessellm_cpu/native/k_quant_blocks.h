/* GGML K-quant super-blocks (Q4_K, Q5_K, Q6_K) as linear_packed.c reads them; see
 * tessellm.quant.k_quants for the layouts. A super-block of 256 weights is read as 8 blocks of
 * 32 (c = 0..7), each with a scale d_c and an offset o_c per unit of its x sum, so the legacy
 * blocks' arithmetic (t = levels . x, acc += t d_c + o_c sum(x)) serves it:
 *   Q4_K/Q5_K: d_c = d * sc_c, o_c = -(dmin * m_c), levels q (0..15 / 0..31);
 *   Q6_K:      d_c = d, o_c = 0, levels (q - 32) * sc (an exact integer in float32: the two
 *              16-weight halves of a block have their own scales).
 * Part of linear_packed.c's cache key. */
#ifndef TESSELLM_K_QUANT_BLOCKS_H
#define TESSELLM_K_QUANT_BLOCKS_H
#include <stdint.h>

#include "packed_blocks.h"

/* The 6-bit scale and min of sub-block j (0..7) from Q4_K/Q5_K's 12 scale bytes q. */
static inline void scale_min_k4(int j, const uint8_t *q, int *sc, int *m) {
    if (j < 4) {
        *sc = q[j] & 63;
        *m = q[j + 4] & 63;
    } else {
        *sc = (q[j + 4] & 0xF) | ((q[j - 4] >> 6) << 4);
        *m = (q[j + 4] >> 4) | ((q[j] >> 6) << 4);
    }
}

/* The 6-bit scales (sc) and mins (m) of the 8 sub-blocks of Q4_K/Q5_K's 12 scale bytes q,
 * one per byte (sub-block j in byte j), all at once on 32-bit words: q[0..3] hold sc 0-3 and
 * the top 2 bits of sc 4-7, q[4..7] the same for the mins, q[8..11] the low 4 bits of sc 4-7
 * (low nibbles) and of m 4-7 (high nibbles). */
static inline void scales_mins_k4(const uint8_t *q, uint64_t *sc, uint64_t *m) {
    uint32_t w0, w1, w2;
    memcpy(&w0, q, 4);
    memcpy(&w1, q + 4, 4);
    memcpy(&w2, q + 8, 4);
    const uint32_t sc_lo = w0 & 0x3f3f3f3fu, m_lo = w1 & 0x3f3f3f3fu;
    const uint32_t sc_hi = (w2 & 0x0f0f0f0fu) | ((w0 >> 2) & 0x30303030u);
    const uint32_t m_hi = ((w2 >> 4) & 0x0f0f0f0fu) | ((w1 >> 2) & 0x30303030u);
    *sc = (uint64_t)sc_lo | ((uint64_t)sc_hi << 32);
    *m = (uint64_t)m_lo | ((uint64_t)m_hi << 32);
}

#ifdef __AVX512F__
/* Q4_K/Q5_K: d_c and o_c of the 8 blocks of super-block `sb` in registers (what
 * k_quant_block_scales stores; kernels that combine two super-blocks into 16 lanes take them
 * this way, as a 512-bit load of two 256-bit stores would miss store forwarding). The 6-bit
 * unpacking is scales_mins_k4's, done on the 16 head bytes in one vector register (one load,
 * no scalar work: W5's Q4_K int8 linears ~1.1x on Zen 4); the same values to the bit. */
static inline void k_quant_scales8(const uint8_t *sb, __m256 *ds, __m256 *os) {
    /* scales_mins_k4 on the 16 head bytes in one register: dwords [d dmin, w0, w1, w2] */
    const __m128i v = _mm_loadu_si128((const __m128i *)sb);
    const __m128i a = _mm_shuffle_epi32(v, _MM_SHUFFLE(3, 3, 2, 1));   /* w0 w1 w2 w2 */
    const __m128i b = _mm_shuffle_epi32(v, _MM_SHUFFLE(2, 1, 2, 1));   /* w0 w1 w0 w1 */
    const __m128i lo = _mm_and_si128(_mm_srlv_epi32(a, _mm_setr_epi32(0, 0, 0, 4)),
                                     _mm_setr_epi32(0x3f3f3f3f, 0x3f3f3f3f, 0x0f0f0f0f, 0x0f0f0f0f));
    const __m128i hi = _mm_and_si128(_mm_srli_epi32(b, 2),
                                     _mm_setr_epi32(0, 0, 0x30303030, 0x30303030));
    /* bytes sc 0-3, m 0-3, sc 4-7, m 4-7 -> sc 0-7, m 0-7 */
    const __m128i sm = _mm_shuffle_epi8(_mm_or_si128(lo, hi),
                                        _mm_setr_epi8(0, 1, 2, 3, 8, 9, 10, 11, 4, 5, 6, 7, 12, 13, 14, 15));
    const __m256 vsc = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(sm));
    const __m256 vm = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_srli_si128(sm, 8)));
    const __m128 dd = _mm_cvtph_ps(v);   /* lane 0 d, lane 1 dmin */
    *ds = _mm256_mul_ps(_mm256_broadcastss_ps(dd), vsc);
    *os = _mm256_sub_ps(_mm256_setzero_ps(),
                        _mm256_mul_ps(_mm256_broadcastss_ps(_mm_movehdup_ps(dd)), vm));
}
#endif

/* The scales of super-block `sb`: Q4_K/Q5_K: d_c (ds[0..7]) and o_c (os[0..7]) of its 8
 * blocks; Q6_K: d * sc of its 16 groups of 16 weights (ds[0..15]; os unused). */
static inline void k_quant_block_scales(const uint8_t *sb, int qtype, float *ds, float *os) {
    if (qtype == Q6_K) {
        const float d = f16_to_f32(sb + 208);
        const int8_t *sc = (const int8_t *)(sb + 192);
#ifdef __AVX512F__
        const __m512 vsc = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)sc)));
        _mm512_storeu_ps(ds, _mm512_mul_ps(_mm512_set1_ps(d), vsc));
#else
        for (int j = 0; j < 16; j++) ds[j] = d * (float)sc[j];
#endif
        (void)os;
        return;
    }
#ifdef __AVX512F__
    __m256 vd, vo;
    k_quant_scales8(sb, &vd, &vo);
    _mm256_storeu_ps(ds, vd);
    _mm256_storeu_ps(os, vo);
#else
    const float d = f16_to_f32(sb), dmin = f16_to_f32(sb + 2);
    uint64_t sc, m;
    scales_mins_k4(sb + 4, &sc, &m);
    for (int c = 0; c < 8; c++) {
        ds[c] = d * (float)((sc >> (8 * c)) & 0xff);
        os[c] = -(dmin * (float)((m >> (8 * c)) & 0xff));
    }
#endif
}

/* Weights of block c of super-block `sb`, dequantized with the reference's arithmetic:
 * (d * sc) * q - (dmin * m) for Q4_K/Q5_K, (d * sc) * (q - 32) for Q6_K. */
static inline void k_quant_dequant_block(const uint8_t *sb, int c, int qtype, float *out) {
    if (qtype == Q6_K) {
        const int h = c >> 2, i = c & 3, qs = 4 * (i >> 1), hs = 2 * i;
        const uint8_t *ql = sb + 64 * h + 32 * (i & 1), *qh = sb + 128 + 32 * h;
        const int8_t *sc = (const int8_t *)(sb + 192 + 8 * h + 2 * i);
        const float d = f16_to_f32(sb + 208);
        for (int l = 0; l < 32; l++) {
            const int q = (((ql[l] >> qs) & 15) | (((qh[l] >> hs) & 3) << 4)) - 32;
            out[l] = (d * (float)sc[l >> 4]) * (float)q;
        }
        return;
    }
    int sc, m;
    scale_min_k4(c, sb + 4, &sc, &m);
    const float d = f16_to_f32(sb) * (float)sc, dm = f16_to_f32(sb + 2) * (float)m;
    const uint8_t *qs = sb + (qtype == Q5_K ? 48 : 16) + 32 * (c >> 1);
    const int s = 4 * (c & 1);
    for (int l = 0; l < 32; l++) {
        int q = (qs[l] >> s) & 15;
        if (qtype == Q5_K) q |= ((sb[16 + l] >> c) & 1) << 4;
        out[l] = d * (float)q - dm;
    }
}

#ifdef __AVX512F__
static inline __m512i k_bytes16(const uint8_t *p) {
    return _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)p));
}
static inline __m512i k_shift_right(__m512i v, int n) {
    return _mm512_srl_epi32(v, _mm_cvtsi32_si128(n));
}

/* The levels of block c of super-block `sb`: weights 0-15 in lo, 16-31 in hi. */
static inline void k_quant_levels(const uint8_t *sb, int c, int qtype, __m512 *lo, __m512 *hi) {
    const __m512i m4 = _mm512_set1_epi32(15);
    if (qtype == Q6_K) {
        const int h = c >> 2, i = c & 3, qs = 4 * (i >> 1), hs = 2 * i;
        const uint8_t *ql = sb + 64 * h + 32 * (i & 1), *qh = sb + 128 + 32 * h;
        const int8_t *sc = (const int8_t *)(sb + 192 + 8 * h + 2 * i);
        const __m512i m2 = _mm512_set1_epi32(3), bias = _mm512_set1_epi32(32);
        __m512i q0 = _mm512_or_si512(
            _mm512_and_si512(k_shift_right(k_bytes16(ql), qs), m4),
            _mm512_slli_epi32(_mm512_and_si512(k_shift_right(k_bytes16(qh), hs), m2), 4));
        __m512i q1 = _mm512_or_si512(
            _mm512_and_si512(k_shift_right(k_bytes16(ql + 16), qs), m4),
            _mm512_slli_epi32(_mm512_and_si512(k_shift_right(k_bytes16(qh + 16), hs), m2), 4));
        *lo = _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_sub_epi32(q0, bias)),
                            _mm512_set1_ps((float)sc[0]));
        *hi = _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_sub_epi32(q1, bias)),
                            _mm512_set1_ps((float)sc[1]));
        return;
    }
    const uint8_t *qs = sb + (qtype == Q5_K ? 48 : 16) + 32 * (c >> 1);
    const int s = 4 * (c & 1);
    *lo = _mm512_cvtepi32_ps(_mm512_and_si512(k_shift_right(k_bytes16(qs), s), m4));
    *hi = _mm512_cvtepi32_ps(_mm512_and_si512(k_shift_right(k_bytes16(qs + 16), s), m4));
    if (qtype == Q5_K) {
        const __m512i bit = _mm512_set1_epi32(1 << c);
        const __m512 sixteen = _mm512_set1_ps(16.f);
        *lo = _mm512_mask_add_ps(*lo, _mm512_test_epi32_mask(k_bytes16(sb + 16), bit), *lo, sixteen);
        *hi = _mm512_mask_add_ps(*hi, _mm512_test_epi32_mask(k_bytes16(sb + 32), bit), *hi, sixteen);
    }
}
/* The levels of blocks 2p and 2p + 1 of super-block `sb` (p = 0..3): lv[0] and lv[1] hold
 * weights 0-15 and 16-31 of block 2p, lv[2] and lv[3] those of block 2p + 1. Q4_K/Q5_K: the
 * two blocks are the low and high nibbles of the same 32 bytes, so each byte is read once (a
 * low nibble becomes its float by a lookup in the 16 levels, as vpermps reads only an index's
 * low 4 bits). Q6_K: the levels q - 32, unscaled (each 16 has its own d * sc). */
static inline void k_quant_pair_levels(const uint8_t *sb, int p, int qtype, __m512 *lv) {
    if (qtype == Q6_K) {   /* q - 32, unscaled: the caller multiplies by d * sc */
        const int h = p >> 1, s4 = 4 * (p & 1), hs = 4 * (p & 1);
        const uint8_t *ql = sb + 64 * h, *qh = sb + 128 + 32 * h;
#ifdef __AVX512BW__
        /* the pair's 64 weights as bytes: nibbles of ql[64h ..] (low for p even), and bits
         * hs, hs + 1 (block 2p) and hs + 2, hs + 3 (block 2p + 1) of qh[32h ..] */
        const __m512i nib = _mm512_and_si512(
            _mm512_srl_epi16(_mm512_loadu_si512((const void *)ql), _mm_cvtsi32_si128(s4)),
            _mm512_set1_epi8(0x0f));
        const __m256i hv = _mm256_loadu_si256((const __m256i *)qh);
        const __m512i hh = _mm512_inserti64x4(
            _mm512_castsi256_si512(_mm256_srl_epi16(hv, _mm_cvtsi32_si128(hs))),
            _mm256_srl_epi16(hv, _mm_cvtsi32_si128(hs + 2)), 1);
        const __m512i q = _mm512_sub_epi8(
            _mm512_or_si512(nib, _mm512_and_si512(_mm512_slli_epi16(hh, 4), _mm512_set1_epi8(0x30))),
            _mm512_set1_epi8(32));
        lv[0] = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm512_castsi512_si128(q)));
        lv[1] = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm512_extracti32x4_epi32(q, 1)));
        lv[2] = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm512_extracti32x4_epi32(q, 2)));
        lv[3] = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm512_extracti32x4_epi32(q, 3)));
#else
        const __m512i m4 = _mm512_set1_epi32(15), m30 = _mm512_set1_epi32(0x30);
        const __m512i bias = _mm512_set1_epi32(32);
        const __m512i h0 = k_bytes16(qh), h1 = k_bytes16(qh + 16);
        for (int b = 0; b < 2; b++) {          /* blocks 2p + b: ql + 32 b, qh bits hs + 2 b */
            const int hb = hs + 2 * b;
            const __m512i hb0 = _mm512_and_si512(_mm512_slli_epi32(k_shift_right(h0, hb), 4), m30);
            const __m512i hb1 = _mm512_and_si512(_mm512_slli_epi32(k_shift_right(h1, hb), 4), m30);
            const __m512i q0 = _mm512_or_si512(_mm512_and_si512(k_shift_right(k_bytes16(ql + 32 * b), s4), m4), hb0);
            const __m512i q1 = _mm512_or_si512(_mm512_and_si512(k_shift_right(k_bytes16(ql + 32 * b + 16), s4), m4), hb1);
            lv[2 * b] = _mm512_cvtepi32_ps(_mm512_sub_epi32(q0, bias));
            lv[2 * b + 1] = _mm512_cvtepi32_ps(_mm512_sub_epi32(q1, bias));
        }
#endif
        return;
    }
    const __m512 levels = _mm512_setr_ps(0.f, 1.f, 2.f, 3.f, 4.f, 5.f, 6.f, 7.f, 8.f, 9.f,
                                         10.f, 11.f, 12.f, 13.f, 14.f, 15.f);
    const uint8_t *qs = sb + (qtype == Q5_K ? 48 : 16) + 32 * p;
    const __m512i v0 = k_bytes16(qs), v1 = k_bytes16(qs + 16);
    lv[0] = _mm512_permutexvar_ps(v0, levels);
    lv[1] = _mm512_permutexvar_ps(v1, levels);
    lv[2] = _mm512_cvtepi32_ps(_mm512_srli_epi32(v0, 4));
    lv[3] = _mm512_cvtepi32_ps(_mm512_srli_epi32(v1, 4));
    if (qtype == Q5_K) {
        const __m512i h0 = k_bytes16(sb + 16), h1 = k_bytes16(sb + 32);
        const __m512i b0 = _mm512_set1_epi32(1 << (2 * p)), b1 = _mm512_set1_epi32(2 << (2 * p));
        const __m512 sixteen = _mm512_set1_ps(16.f);
        lv[0] = _mm512_mask_add_ps(lv[0], _mm512_test_epi32_mask(h0, b0), lv[0], sixteen);
        lv[1] = _mm512_mask_add_ps(lv[1], _mm512_test_epi32_mask(h1, b0), lv[1], sixteen);
        lv[2] = _mm512_mask_add_ps(lv[2], _mm512_test_epi32_mask(h0, b1), lv[2], sixteen);
        lv[3] = _mm512_mask_add_ps(lv[3], _mm512_test_epi32_mask(h1, b1), lv[3], sixteen);
    }
}
#endif

#endif
