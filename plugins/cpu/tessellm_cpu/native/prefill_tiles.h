/* The arithmetic of paged_attention.c's prefill on tiles of query rows (included by it; part
 * of its cache key like every header beside it).
 *
 * A tile is up to 16 query rows of one sequence that read the same KV head: TILE_TOKENS(G)
 * consecutive query tokens times the G query heads of the group. Each row is one lane of a
 * 16-lane float32 vector, so a tile's scores for 16 keys are 16 vectors (one per key, lanes =
 * rows), computed with every key's K row broadcast against the tile's transposed queries: K
 * and V are read once per tile instead of once per row, and the causal mask, the running
 * max, the sum of exp and the rescaling are lane-wise. Every lane's arithmetic depends only
 * on its own query, position and the keys: a row's result is the same whichever tile (or
 * chunk of a prompt, after whatever prefix-cache hit) it falls in.
 *
 * Keys go 16 at a time inside one block (a block of other than 16 rows gives shorter runs,
 * padded with zero rows that the mask drops). Scores: AVX-512 BF16 dot products of the
 * stored bfloat16 q and k pairs, scaled after (as the decode does), or float32 FMAs of the
 * scaled q. P.V: float32 FMAs of the float32 probabilities against V widened to float32.
 * Needs AVX-512F (VEC_QK); without it the prefill runs each token as a decode. */
#ifndef TESSELLM_PREFILL_TILES_H
#define TESSELLM_PREFILL_TILES_H
#include <stdint.h>
#include <string.h>

#include "decode_rows.h"
#include "vec_math.h"

#define TILE_LANES 16
/* Query tokens per tile: as many as fill 16 lanes with all G heads of each (G <= 16). */
#define TILE_TOKENS(G) (TILE_LANES / (G))

/* Floats of one thread's tile scratch: transposed queries (D x 16), output accumulators
 * (D x 16), a 16-key run of K and of V as float32 rows (16 x D each), lane positions. */
static inline size_t tile_scratch_floats(int64_t D) {
    return (size_t)D * TILE_LANES * 4 + 2 * TILE_LANES + 16;
}

#if VEC_QK
/* r[i] (lanes = columns) becomes column i of the 16 x 16 matrix whose rows were r[0..15]. */
INLINE void transpose16(__m512 r[16]) {
    __m512 t[16], u[16];
    for (int i = 0; i < 8; ++i) {
        t[2 * i] = _mm512_unpacklo_ps(r[2 * i], r[2 * i + 1]);
        t[2 * i + 1] = _mm512_unpackhi_ps(r[2 * i], r[2 * i + 1]);
    }
    for (int i = 0; i < 4; ++i) {   /* u[4i + c]: columns c, c+4, c+8, c+12 of rows 4i..4i+3 */
        const __m512d a = _mm512_castps_pd(t[4 * i]), b = _mm512_castps_pd(t[4 * i + 1]);
        const __m512d c = _mm512_castps_pd(t[4 * i + 2]), d = _mm512_castps_pd(t[4 * i + 3]);
        u[4 * i] = _mm512_castpd_ps(_mm512_unpacklo_pd(a, c));
        u[4 * i + 1] = _mm512_castpd_ps(_mm512_unpackhi_pd(a, c));
        u[4 * i + 2] = _mm512_castpd_ps(_mm512_unpacklo_pd(b, d));
        u[4 * i + 3] = _mm512_castpd_ps(_mm512_unpackhi_pd(b, d));
    }
    for (int c = 0; c < 4; ++c) {
        const __m512 x0 = _mm512_shuffle_f32x4(u[c], u[4 + c], 0x44);
        const __m512 x1 = _mm512_shuffle_f32x4(u[c], u[4 + c], 0xEE);
        const __m512 y0 = _mm512_shuffle_f32x4(u[8 + c], u[12 + c], 0x44);
        const __m512 y1 = _mm512_shuffle_f32x4(u[8 + c], u[12 + c], 0xEE);
        r[c] = _mm512_shuffle_f32x4(x0, y0, 0x88);
        r[c + 4] = _mm512_shuffle_f32x4(x0, y0, 0xDD);
        r[c + 8] = _mm512_shuffle_f32x4(x1, y1, 0x88);
        r[c + 12] = _mm512_shuffle_f32x4(x1, y1, 0xDD);
    }
}

/* s[j] = sum over d of qt[d] * k_j[d] for 16 float32 rows k_j of D (qt: D x 16, lanes = rows). */
INLINE void tile_scores_f32(const float *qt, const float *k, int64_t D, __m512 s[16]) {
    for (int j = 0; j < 16; ++j) s[j] = _mm512_setzero_ps();
    for (int64_t d = 0; d < D; ++d) {
        const __m512 q = _mm512_loadu_ps(qt + d * TILE_LANES);
        for (int j = 0; j < 16; ++j) s[j] = _mm512_fmadd_ps(q, _mm512_set1_ps(k[j * D + d]), s[j]);
    }
}

#if DP_BF16
/* s[j] = sum over pairs c of qp[c] . k_j's pair c (bfloat16 dot products) for 16 bfloat16
 * rows k_j of D (D even; qp: D/2 x 16 words, lane = row, each its q's pair c as stored). */
INLINE void tile_scores_dpbf16(const uint32_t *qp, const uint16_t *k, int64_t D,
                               __m512 s[16]) {
    for (int j = 0; j < 16; ++j) s[j] = _mm512_setzero_ps();
    for (int64_t c = 0; c < D / 2; ++c) {
        const __m512bh q = (__m512bh)_mm512_loadu_si512(qp + c * TILE_LANES);
        for (int j = 0; j < 16; ++j) {
            int32_t pair;
            memcpy(&pair, k + j * D + 2 * c, sizeof pair);
            s[j] = _mm512_dpbf16_ps(s[j], q, (__m512bh)_mm512_set1_epi32(pair));
        }
    }
}
#endif

/* Gemma 2's soft-cap on 16 lanes: cap * tanh(s / cap), tanh from exp(-2|x|). */
INLINE __m512 softcap16(__m512 s, float cap) {
    const __m512 x = _mm512_mul_ps(s, _mm512_set1_ps(1.f / cap));
    const __m512 ax = _mm512_abs_ps(x);
    const __m512 e = exp_nonpos16(_mm512_mul_ps(ax, _mm512_set1_ps(-2.f)));
    const __m512 one = _mm512_set1_ps(1.f);
    const __m512 t = _mm512_div_ps(_mm512_sub_ps(one, e), _mm512_add_ps(one, e));
    const __mmask16 neg = _mm512_cmp_ps_mask(x, _mm512_setzero_ps(), _CMP_LT_OQ);
    return _mm512_mul_ps(_mm512_mask_sub_ps(t, neg, _mm512_setzero_ps(), t),
                         _mm512_set1_ps(cap));
}

/* The online-softmax state of a tile's 16 lanes: running max m and sum of exp l (the output
 * accumulators o, D x 16, live in the thread's scratch). */
typedef struct {
    __m512 m, l;
} TileState;

/* Fold one run of 16 keys (positions kpos0 .. kpos0 + 15; s[j]: their scores, already
 * scaled; vf: their V rows as float32, zero past the run) into the state: key j counts for a
 * lane when lo <= kpos0 + j <= pos (lane-wise) and j < nk. */
INLINE void tile_fold(TileState *st, __m512 s[16], const float *vf, int64_t D, int64_t nk,
                      int64_t kpos0, __m512i pos, __m512i lo, float *o) {
    const __m512 ninf = _mm512_set1_ps(-INFINITY);
    __m512 mx = st->m;
    for (int j = 0; j < 16; ++j) {
        const __m512i kp = _mm512_set1_epi32((int32_t)(kpos0 + j));
        __mmask16 ok = _mm512_cmple_epi32_mask(kp, pos) & _mm512_cmpge_epi32_mask(kp, lo);
        if (j >= nk) ok = 0;
        s[j] = _mm512_mask_blend_ps(ok, ninf, s[j]);
        mx = _mm512_max_ps(mx, s[j]);
    }
    /* lanes that have seen no key yet keep m = -inf: shift by 0 there (every exp is 0) */
    const __m512 shift = _mm512_maskz_mov_ps(_mm512_cmp_ps_mask(mx, ninf, _CMP_NEQ_OQ), mx);
    const __m512 alpha = exp_nonpos16(_mm512_sub_ps(st->m, shift));
    __m512 l = _mm512_mul_ps(st->l, alpha);
    for (int j = 0; j < 16; ++j) {
        s[j] = exp_nonpos16(_mm512_sub_ps(s[j], shift));
        l = _mm512_add_ps(l, s[j]);
    }
    st->m = mx;
    st->l = l;
    /* 8 features at a time: 8 independent sums, so the FMAs' latency is hidden */
    int64_t d = 0;
    for (; d + 8 <= D; d += 8) {
        __m512 acc[8];
        for (int i = 0; i < 8; ++i)
            acc[i] = _mm512_mul_ps(_mm512_loadu_ps(o + (d + i) * TILE_LANES), alpha);
        for (int j = 0; j < 16; ++j)
            for (int i = 0; i < 8; ++i)
                acc[i] = _mm512_fmadd_ps(s[j], _mm512_set1_ps(vf[j * D + d + i]), acc[i]);
        for (int i = 0; i < 8; ++i) _mm512_storeu_ps(o + (d + i) * TILE_LANES, acc[i]);
    }
    for (; d < D; ++d) {
        __m512 acc = _mm512_mul_ps(_mm512_loadu_ps(o + d * TILE_LANES), alpha);
        for (int j = 0; j < 16; ++j) acc = _mm512_fmadd_ps(s[j], _mm512_set1_ps(vf[j * D + d]), acc);
        _mm512_storeu_ps(o + d * TILE_LANES, acc);
    }
}

/* dst[c * 16 + l] = word (or value) c of row l, for the 16 rows at row[l] (lanes with
 * row[l] NULL are zero) and c < n: rows read 16 words at a time and transposed. LOAD16(p, k)
 * reads the first k-masked of 16 words or values at p as a vector. */
#define TILE_TRANSPOSE_ROWS(dst, row, n, LOAD16)                                              \
    do {                                                                                       \
        for (int64_t c0_ = 0; c0_ < (n); c0_ += 16) {                                          \
            const int64_t m_ = (n) - c0_ < 16 ? (n) - c0_ : 16;                                \
            const __mmask16 k_ = (__mmask16)((1u << m_) - 1u);                                 \
            __m512 r_[16];                                                                     \
            for (int l_ = 0; l_ < 16; ++l_)                                                    \
                r_[l_] = (row)[l_] ? LOAD16((row)[l_] + c0_, k_) : _mm512_setzero_ps();        \
            transpose16(r_);                                                                   \
            for (int64_t i_ = 0; i_ < m_; ++i_) _mm512_storeu_ps((dst) + (c0_ + i_) * TILE_LANES, r_[i_]); \
        }                                                                                      \
    } while (0)

/* Store the first k-masked of 16 float32 values at p: as they are, or rounded to bfloat16
 * as f32_to_bf16 does (nearest even, NaN kept quiet). */
INLINE void store16_f32(float *p, __mmask16 k, __m512 v) { _mm512_mask_storeu_ps(p, k, v); }
INLINE void store16_bf16(uint16_t *p, __mmask16 k, __m512 v) {
    const __m512i u = _mm512_castps_si512(v);
    const __mmask16 nan = _mm512_cmpgt_epu32_mask(
        _mm512_and_si512(u, _mm512_set1_epi32(0x7fffffff)), _mm512_set1_epi32(0x7f800000));
    const __m512i odd = _mm512_and_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(1));
    __m512i r = _mm512_srli_epi32(
        _mm512_add_epi32(u, _mm512_add_epi32(_mm512_set1_epi32(0x7fff), odd)), 16);
    r = _mm512_mask_or_epi32(r, nan, _mm512_srli_epi32(u, 16), _mm512_set1_epi32(0x40));
    _mm256_mask_storeu_epi16(p, k, _mm512_cvtepi32_epi16(r));
}

/* buf = the nk rows of row_bytes at src, then zero rows up to 16 (a run shorter than 16 keys
 * read as a whole one); returns buf. */
INLINE void *pad_rows16(const void *src, int64_t nk, size_t row_bytes, void *buf) {
    memcpy(buf, src, row_bytes * (size_t)nk);
    memset((char *)buf + row_bytes * (size_t)nk, 0, row_bytes * (size_t)(16 - nk));
    return buf;
}

INLINE __m512 load16_words(const uint32_t *p, __mmask16 k) {
    return _mm512_castsi512_ps(_mm512_maskz_loadu_epi32(k, p));
}
INLINE __m512 load16_f32(const float *p, __mmask16 k) { return _mm512_maskz_loadu_ps(k, p); }
INLINE __m512 load16_bf16(const uint16_t *p, __mmask16 k) {
    return _mm512_castsi512_ps(_mm512_slli_epi32(
        _mm512_cvtepu16_epi32(_mm256_maskz_loadu_epi16(k, p)), 16));
}

/* rows[l * D + d] = o[d * 16 + l] / l_l (0 where l_l is 0) for every lane l and d < D: o's
 * columns as float32 rows, transposed 16 features at a time (the rest one at a time). */
INLINE void tile_normalize(const float *o, __m512 l, int64_t D, float *rows) {
    const __mmask16 pos = _mm512_cmp_ps_mask(l, _mm512_setzero_ps(), _CMP_GT_OQ);
    const __m512 inv = _mm512_maskz_div_ps(pos, _mm512_set1_ps(1.f), l);
    int64_t d0 = 0;
    for (; d0 + 16 <= D; d0 += 16) {
        __m512 r[16];
        for (int i = 0; i < 16; ++i) r[i] = _mm512_mul_ps(_mm512_loadu_ps(o + (d0 + i) * TILE_LANES), inv);
        transpose16(r);   /* r[lane]: features d0 .. d0 + 15 of that lane's row */
        for (int i = 0; i < 16; ++i) _mm512_storeu_ps(rows + i * D + d0, r[i]);
    }
    for (; d0 < D; ++d0) {
        float v[16];
        _mm512_storeu_ps(v, _mm512_mul_ps(_mm512_loadu_ps(o + d0 * TILE_LANES), inv));
        for (int i = 0; i < 16; ++i) rows[i * D + d0] = v[i];
    }
}
#endif
#endif
