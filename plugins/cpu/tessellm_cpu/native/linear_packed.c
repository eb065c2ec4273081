/* Linear over packed GGML weights (legacy Q8_0, Q4_0, Q4_1, Q5_0, Q5_1; K-quants Q4_K, Q5_K,
 * Q6_K) for the tessellm CPU plugin: out[M, N] = x[M, K] @ W[N, K]^T (+ bias), W read in its
 * packed form, never expanded. (embedding_packed_f32 at the end: rows of such a weight,
 * dequantized, for the embedding.)
 *
 * Layouts: x float32 [M, K] contiguous; W rows of K / 32 legacy blocks (packed_blocks.h) or
 * K / 256 super-blocks (k_quant_blocks.h), e.g.
 *   Q8_0 34 B: fp16 d, int8 q[32]              w = d * q
 *   Q4_0 18 B: fp16 d, u8 qs[16]               w = d * (q - 8)
 *   Q4_1 20 B: fp16 d, fp16 m, u8 qs[16]       w = d * q + m
 * (4-bit: weight j < 16 is the low nibble of qs[j], weight j + 16 its high nibble).
 * Every format is read as blocks of 32 weights with a scale d and an offset o per unit of x:
 * per legacy block acc += (d * levels) . x (d * level is exact in float32), per K-quant block
 * acc += d * (levels . x); plus o times the block's sum of x, precomputed once per row of x.
 * The result equals the float32 product with the dequantized weight up to summation order
 * (and, for Q6_K, the order of its two scale products).
 * Work (AVX-512): OpenMP over groups of NR output features, each thread's groups in order and
 * prefetched about 16 KiB ahead; a group runs the rows of x in the fewest tiles of at most MR
 * rows (a 5-row verify step is one pass over the weights, not 4 + 1), so each decoded block
 * serves up to MR rows and each x block NR features, and the group's weights stay in L1
 * across the tiles. The scales of 16 blocks are converted at once and a legacy 4-bit
 * nibble becomes its weight by a lookup in the block's 16 scaled levels. Portable C otherwise: OpenMP over
 * output features, tiles of MT rows, each block dequantized then dotted.
 */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "k_quant_blocks.h"
#include "packed_blocks.h"
#include "prefetch.h"
#include "team.h"

#define INLINE static inline __attribute__((always_inline))
#define MT 8   /* rows of x per tile (portable path) */

#ifdef __AVX512F__
/* Per-row sums of x over each block of 32: xs[m * nb + b]. */
static void block_sums(const float *x, int64_t M, int64_t K, float *xs) {
    int64_t nb = K / QK;
    for (int64_t m = 0; m < M; m++)
        for (int64_t b = 0; b < nb; b++) {
            const float *p = x + m * K + b * QK;
            float s = 0.f;
            for (int j = 0; j < QK; j++) s += p[j];
            xs[m * nb + b] = s;
        }
}
#endif

/* Block b (of 32 weights) of a packed row, dequantized with the reference's arithmetic (a
 * multiply then an add; C11 mode: no contraction into FMAs). */
static void dequant_block(const uint8_t *wrow, int64_t b, int qtype, float *o) {
    if (is_k_quant(qtype)) {
        k_quant_dequant_block(wrow + (b >> 3) * block_bytes(qtype), (int)(b & 7), qtype, o);
        return;
    }
    const uint8_t *blk = wrow + b * block_bytes(qtype);
    const float d = f16_to_f32(blk);
    if (qtype == Q8_0) {
        for (int j = 0; j < QK; j++) o[j] = d * (float)(int8_t)blk[2 + j];
    } else if (qtype == Q4_0) {
        for (int j = 0; j < 16; j++) {
            o[j] = d * ((float)(blk[2 + j] & 0x0f) - 8.f);
            o[j + 16] = d * ((float)(blk[2 + j] >> 4) - 8.f);
        }
    } else if (qtype == Q4_1) {
        const float m = f16_to_f32(blk + 2);
        for (int j = 0; j < 16; j++) {
            const float lo = d * (float)(blk[4 + j] & 0x0f), hi = d * (float)(blk[4 + j] >> 4);
            o[j] = lo + m;
            o[j + 16] = hi + m;
        }
    } else {  /* Q5_0, Q5_1 */
        const int off = qtype == Q5_1 ? 4 : 2;
        uint32_t qh;
        memcpy(&qh, blk + off, 4);
        const uint8_t *qs = blk + off + 4;
        for (int j = 0; j < 16; j++) {
            const float lo = (float)((qs[j] & 0x0f) | (((qh >> j) & 1u) << 4));
            const float hi = (float)((qs[j] >> 4) | (((qh >> (j + 16)) & 1u) << 4));
            if (qtype == Q5_0) {
                o[j] = d * (lo - 16.f);
                o[j + 16] = d * (hi - 16.f);
            } else {
                const float m = f16_to_f32(blk + 2), a = d * lo, c = d * hi;
                o[j] = a + m;
                o[j + 16] = c + m;
            }
        }
    }
}

#ifdef __AVX512F__
/* The 32 levels of legacy block `blk` (Q8_0: q; Q4_x: the nibble, by a lookup in the 16
 * levels, as vpermps reads only an index's low 4 bits; Q5_x: plus 16 where the block's qh bit
 * is set), weights 0-15 in lo, 16-31 in hi. */
INLINE void block_levels(const uint8_t *blk, int qtype, __m512 *lo, __m512 *hi) {
    if (qtype == Q8_0) {
        *lo = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)(blk + 2))));
        *hi = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)(blk + 18))));
        return;
    }
    const __m512 levels = _mm512_setr_ps(0.f, 1.f, 2.f, 3.f, 4.f, 5.f, 6.f, 7.f, 8.f, 9.f,
                                         10.f, 11.f, 12.f, 13.f, 14.f, 15.f);
    const int qs = qtype == Q4_0 ? 2 : qtype == Q4_1 ? 4 : qtype == Q5_0 ? 6 : 8;
    const __m512i v = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)(blk + qs)));
    *lo = _mm512_permutexvar_ps(v, levels);
    *hi = _mm512_cvtepi32_ps(_mm512_srli_epi32(v, 4));   /* a conversion: spares port 5 */
    if (qtype == Q5_0 || qtype == Q5_1) {
        uint32_t qh;
        memcpy(&qh, blk + qs - 4, 4);
        const __m512 sixteen = _mm512_set1_ps(16.f);
        *lo = _mm512_mask_add_ps(*lo, (__mmask16)(qh & 0xffffu), *lo, sixteen);
        *hi = _mm512_mask_add_ps(*hi, (__mmask16)(qh >> 16), *hi, sixteen);
    }
}

/* The 32 weights d * level of legacy block `blk` whose scale is `vd` (in every lane), without
 * the offset (added per block sum of x): exact in float32, an fp16 d times a level of at most
 * 8 bits. Q4_x: a lookup in the 16 scaled levels for both nibbles. */
INLINE void block_scaled(const uint8_t *blk, int qtype, __m512 vd, __m512 *lo, __m512 *hi) {
    if (qtype == Q4_0 || qtype == Q4_1) {
        const __m512 table = _mm512_mul_ps(
            _mm512_setr_ps(0.f, 1.f, 2.f, 3.f, 4.f, 5.f, 6.f, 7.f, 8.f, 9.f, 10.f, 11.f, 12.f,
                           13.f, 14.f, 15.f), vd);
        const __m512i v = _mm512_cvtepu8_epi32(
            _mm_loadu_si128((const __m128i *)(blk + (qtype == Q4_0 ? 2 : 4))));
        *lo = _mm512_permutexvar_ps(v, table);
        *hi = _mm512_permutexvar_ps(_mm512_srli_epi32(v, 4), table);
        return;
    }
    block_levels(blk, qtype, lo, hi);
    *lo = _mm512_mul_ps(*lo, vd);
    *hi = _mm512_mul_ps(*hi, vd);
}

/* Scales d and offsets o of blocks g .. g + ng - 1 (g a multiple of 16, ng <= 16) of a packed
 * row; lanes past ng are 0. */
INLINE void group_scales(const uint8_t *wrow, int64_t g, int64_t ng, int qtype, __m512 *d,
                         __m512 *o) {
    if (is_k_quant(qtype)) {
        float ds[16] = {0}, os[16] = {0};
        for (int64_t s = 0; s * 8 < ng; s++)
            k_quant_block_scales(wrow + (g / 8 + s) * block_bytes(qtype), qtype, ds + 8 * s,
                                 os + 8 * s);
        *d = _mm512_loadu_ps(ds);
        *o = _mm512_loadu_ps(os);
        return;
    }
    const int64_t bb = block_bytes(qtype);
    const __m512i heads = block_heads(wrow + g * bb, bb, group_mask(ng));
    *d = half_lo(heads);
    *o = block_offsets(heads, *d, qtype);
}

#define NR 4   /* output features per group */
#define MR 6   /* rows of x per tile at most */
/* Rows m0 .. m0 + mr - 1 of x against weight rows n0 .. n0 + nr - 1 (mr <= MR, nr <= NR):
 * res[r * MR + i]. Each decoded weight block serves the mr rows and each x block the nr
 * features; per output the operations and their order do not depend on mr or nr (so a row's
 * result does not depend on the batch it is in): for every 16 blocks the offset terms
 * (16 lanes of o * block sum of x) are added into the accumulator, then for each block the
 * weights d * level (block_scaled) are multiplied into it by two FMAs, and the 16 lanes are
 * summed at the end (on a CPU with one 512-bit FMA a cycle, 2 FMAs a row per block instead of
 * 3: a 4-row tile costs 0.8x, a 5-row tile is one pass instead of two). */
INLINE void tile(const float *x, const float *xs, int64_t K, const uint8_t *w, int64_t row,
                 int qtype, int64_t n0, int nr, int64_t m0, int mr, float *res,
                 SpreadPrefetch *pf) {
    const int64_t nb = K / QK;
    __m512 acc[NR][MR];
    float ds[NR][16];
    for (int r = 0; r < NR; r++)
        for (int i = 0; i < MR; i++) acc[r][i] = _mm512_setzero_ps();
    for (int64_t g = 0; g < nb; g += 16) {
        const int64_t ng = nb - g < 16 ? nb - g : 16;
        const __mmask16 gm = group_mask(ng);
        __m512 sx[MR];
        for (int i = 0; i < mr; i++) sx[i] = _mm512_maskz_loadu_ps(gm, xs + (m0 + i) * nb + g);
        for (int r = 0; r < nr; r++) {
            __m512 d, o;
            group_scales(w + (n0 + r) * row, g, ng, qtype, &d, &o);
            _mm512_storeu_ps(ds[r], d);
            for (int i = 0; i < mr; i++) acc[r][i] = _mm512_fmadd_ps(o, sx[i], acc[r][i]);
        }
        for (int64_t j = 0; j < ng; j++) {
            spread_step(pf);
            for (int r = 0; r < nr; r++) {
                __m512 lo, hi;
                block_scaled(w + (n0 + r) * row + (g + j) * block_bytes(qtype), qtype,
                             _mm512_set1_ps(ds[r][j]), &lo, &hi);
                for (int i = 0; i < mr; i++) {
                    const float *xp = x + (m0 + i) * K + (g + j) * QK;
                    acc[r][i] = _mm512_fmadd_ps(lo, _mm512_loadu_ps(xp), acc[r][i]);
                    acc[r][i] = _mm512_fmadd_ps(hi, _mm512_loadu_ps(xp + 16), acc[r][i]);
                }
            }
        }
    }
    for (int r = 0; r < nr; r++)
        for (int i = 0; i < mr; i++) res[r * MR + i] = _mm512_reduce_add_ps(acc[r][i]);
}

/* tile for K-quant rows, a super-block at a time: its 8 offset terms, then its blocks in
 * pairs (k_quant_pair_levels); per output the same operations in the same order whatever mr
 * and nr. */
INLINE void tile_k(const float *x, const float *xs, int64_t K, const uint8_t *w, int64_t row,
                   int qtype, int64_t n0, int nr, int64_t m0, int mr, float *res,
                   SpreadPrefetch *pf) {
    const int64_t nsb = K / QK_K, nb = K / QK, sbb = block_bytes(qtype);
    __m512 acc[NR][MR];
    float ds[NR][16], os[8];
    for (int r = 0; r < NR; r++)
        for (int i = 0; i < MR; i++) acc[r][i] = _mm512_setzero_ps();
    for (int64_t s = 0; s < nsb; s++) {
        __m512 sx[MR];
        for (int i = 0; i < mr; i++) sx[i] = _mm512_maskz_loadu_ps(0xff, xs + (m0 + i) * nb + 8 * s);
        for (int r = 0; r < nr; r++) {
            const uint8_t *sb = w + (n0 + r) * row + s * sbb;
            if (qtype == Q6_K) {
                k_quant_block_scales(sb, qtype, ds[r], os);
                continue;
            }
            __m256 vd, vo;   /* in registers: a wide load of narrower stores misses forwarding */
            k_quant_scales8(sb, &vd, &vo);
            _mm256_storeu_ps(ds[r], vd);
            const __m512 o = _mm512_zextps256_ps512(vo);
            for (int i = 0; i < mr; i++) acc[r][i] = _mm512_fmadd_ps(o, sx[i], acc[r][i]);
        }
        for (int p = 0; p < 4; p++) {
            spread_step(pf);
            for (int r = 0; r < nr; r++) {
                __m512 lv[4];
                k_quant_pair_levels(w + (n0 + r) * row + s * sbb, p, qtype, lv);
                if (qtype == Q6_K) {   /* a scale per 16 weights */
                    const float *d = ds[r] + 4 * p;
                    for (int i = 0; i < mr; i++) {
                        const float *xp = x + (m0 + i) * K + s * QK_K + 64 * p;
                        for (int q = 0; q < 4; q++)
                            acc[r][i] = _mm512_fmadd_ps(_mm512_mul_ps(lv[q], _mm512_loadu_ps(xp + 16 * q)),
                                                        _mm512_set1_ps(d[q]), acc[r][i]);
                    }
                    continue;
                }
                const __m512 d0 = _mm512_set1_ps(ds[r][2 * p]), d1 = _mm512_set1_ps(ds[r][2 * p + 1]);
                for (int i = 0; i < mr; i++) {
                    const float *xp = x + (m0 + i) * K + s * QK_K + 64 * p;
                    const __m512 t0 = _mm512_fmadd_ps(lv[1], _mm512_loadu_ps(xp + 16),
                                                      _mm512_mul_ps(lv[0], _mm512_loadu_ps(xp)));
                    const __m512 t1 = _mm512_fmadd_ps(lv[3], _mm512_loadu_ps(xp + 48),
                                                      _mm512_mul_ps(lv[2], _mm512_loadu_ps(xp + 32)));
                    acc[r][i] = _mm512_fmadd_ps(t0, d0, acc[r][i]);
                    acc[r][i] = _mm512_fmadd_ps(t1, d1, acc[r][i]);
                }
            }
        }
    }
    for (int r = 0; r < nr; r++)
        for (int i = 0; i < mr; i++) res[r * MR + i] = _mm512_reduce_add_ps(acc[r][i]);
}

/* tile with qtype, and nr and mr where whole, constants in each call (the inlined loops then
 * keep the accumulators in registers); writes the outputs (+ bias). */
INLINE void tile_out(const float *x, const float *xs, int64_t K, const uint8_t *w, int64_t row,
                     int qtype, int64_t n0, int nr, int64_t m0, int mr, const float *bias,
                     float *out, int64_t N, SpreadPrefetch *pf) {
    float res[NR * MR];
#define TILE_Q(NRC, MRC)                                                                        \
    do {                                                                                        \
        switch (qtype) {                                                                        \
        case Q4_0: tile(x, xs, K, w, row, Q4_0, n0, NRC, m0, MRC, res, pf); break;                  \
        case Q4_1: tile(x, xs, K, w, row, Q4_1, n0, NRC, m0, MRC, res, pf); break;                  \
        case Q5_0: tile(x, xs, K, w, row, Q5_0, n0, NRC, m0, MRC, res, pf); break;                  \
        case Q5_1: tile(x, xs, K, w, row, Q5_1, n0, NRC, m0, MRC, res, pf); break;                  \
        case Q4_K: tile_k(x, xs, K, w, row, Q4_K, n0, NRC, m0, MRC, res, pf); break;                \
        case Q5_K: tile_k(x, xs, K, w, row, Q5_K, n0, NRC, m0, MRC, res, pf); break;                \
        case Q6_K: tile_k(x, xs, K, w, row, Q6_K, n0, NRC, m0, MRC, res, pf); break;                \
        default: tile(x, xs, K, w, row, Q8_0, n0, NRC, m0, MRC, res, pf); break;                    \
        }                                                                                       \
    } while (0)
    if (nr == NR && mr == 1) TILE_Q(NR, 1);
    else if (nr == NR && mr == 2) TILE_Q(NR, 2);
    else if (nr == NR && mr == 3) TILE_Q(NR, 3);
    else if (nr == NR && mr == 4) TILE_Q(NR, 4);
    else if (nr == NR && mr == 5) TILE_Q(NR, 5);
    else if (nr == NR && mr == 6) TILE_Q(NR, 6);
    else TILE_Q(nr, mr);
#undef TILE_Q
    for (int i = 0; i < mr; i++)
        for (int r = 0; r < nr; r++)
            out[(m0 + i) * N + n0 + r] = res[r * MR + i] + (bias ? bias[n0 + r] : 0.f);
}

/* Rows 0 .. M - 1 of x against the group of weight rows n0 .. n0 + nr - 1, in the fewest
 * tiles of at most MR rows, of near-equal sizes (each tile is one pass over the group's
 * weights, which stay in L1; the first tile steps `pf`). */
INLINE void group_rows(const float *x, const float *xs, int64_t K, const uint8_t *w, int64_t row,
                       int qtype, int64_t n0, int nr, int64_t M, const float *bias, float *out,
                       int64_t N, SpreadPrefetch *pf) {
    const int64_t tiles = (M + MR - 1) / MR;
    for (int64_t t = 0; t < tiles; t++, pf = NULL) {
        const int64_t m0 = t * M / tiles, m1 = (t + 1) * M / tiles;
        tile_out(x, xs, K, w, row, qtype, n0, nr, m0, (int)(m1 - m0), bias, out, N, pf);
    }
}
#else
/* One output feature for rows m0 .. m0 + mt - 1: each block dequantized, then dotted. */
static void row_tile(const float *x, int64_t K, const uint8_t *wrow, int qtype, int64_t m0,
                     int mt, float *res) {
    float acc[MT] = {0}, wb[QK];
    for (int64_t b = 0; b < K / QK; b++) {
        dequant_block(wrow, b, qtype, wb);
        for (int i = 0; i < mt; i++) {
            const float *xp = x + (m0 + i) * K + b * QK;
            float t = 0.f;
            for (int j = 0; j < QK; j++) t += wb[j] * xp[j];
            acc[i] += t;
        }
    }
    for (int i = 0; i < mt; i++) res[i] = acc[i];
}
#endif

/* The linear's arguments (team.h). scratch: linear_packed_scratch bytes (the AVX-512 path's
 * per-row block sums of x). */
typedef struct {
    const float *x;
    int64_t M, K;
    const uint8_t *w;
    int64_t N;
    int qtype;
    const float *bias;
    float *out;
    void *scratch;
} LinearPackedArgs;

int64_t linear_packed_scratch(const LinearPackedArgs *a) {
#ifdef __AVX512F__
    return a->M > 0 && a->K > 0 ? (int64_t)sizeof(float) * a->M * (a->K / QK) : 0;
#else
    (void)a;
    return 0;
#endif
}

/* Returns 0, or 1 on a bad format or K. */
int linear_packed_team(const LinearPackedArgs *a) {
    const int qtype = a->qtype;
    const int64_t M = a->M, K = a->K, N = a->N;
    if (block_bytes(qtype) == 0 || K < 0 || K % block_weights(qtype) != 0 || M < 0 || N < 0)
        return 1;
    const int64_t row = K / block_weights(qtype) * block_bytes(qtype);
    const float *x = a->x, *bias = a->bias;
    const uint8_t *w = a->w;
    float *out = a->out;
#ifdef __AVX512F__
    const int64_t nb = K / QK;
    float *xs = a->scratch;
#pragma omp for schedule(static)
    for (int64_t m = 0; m < M; m++) block_sums(x + m * K, 1, K, xs + m * nb);
    const int64_t groups = (N + NR - 1) / NR;
#pragma omp for schedule(static) nowait
    for (int64_t grp = 0; grp < groups; grp++) {
        const int64_t n0 = grp * NR;
        const int nr = (int)(N - n0 < NR ? N - n0 : NR);
        /* each thread reads its groups in order; the first tile of a group asks for a later one */
        SpreadPrefetch ahead = spread_ahead(w, grp, groups, NR * row, N * row,
                                            is_k_quant(qtype) ? nb / 2 : nb);
        group_rows(x, xs, K, w, row, qtype, n0, nr, M, bias, out, N, &ahead);
    }
#else
#pragma omp for schedule(static) nowait
    for (int64_t n = 0; n < N; n++) {
        float res[MT];
        const float bn = bias ? bias[n] : 0.f;
        for (int64_t m0 = 0; m0 < M; m0 += MT) {
            const int mt = (int)(M - m0 < MT ? M - m0 : MT);
            row_tile(x, K, w + n * row, qtype, m0, mt, res);
            for (int i = 0; i < mt; i++) out[(m0 + i) * N + n] = res[i] + bn;
        }
    }
#endif
    return 0;
}

/* An eager call: 0, 1 on a bad format or K, 2 when scratch memory cannot be allocated. */
int linear_packed_run(LinearPackedArgs *a) {
    return TEAM_RUN_WITH_SCRATCH(linear_packed_team, a, linear_packed_scratch(a), team_threads(),
                                 0, 2);
}

/* Embedding rows: out[t, :] = row ids[t] of W [N, K], each block dequantized as the reference
 * does (dequant_block). Returns 0, 1 on a bad format or K, 3 when an id is outside [0, N)
 * (nothing is written then). */
typedef struct {
    const int64_t *ids;
    int64_t T;
    const uint8_t *w;
    int64_t N, K;
    int qtype;
    float *out;
} EmbeddingPackedArgs;

int embedding_packed_team(const EmbeddingPackedArgs *a) {
    const int qtype = a->qtype;
    const int64_t K = a->K;
    if (block_bytes(qtype) == 0 || K < 0 || K % block_weights(qtype) != 0) return 1;
    for (int64_t t = 0; t < a->T; t++)
        if (a->ids[t] < 0 || a->ids[t] >= a->N) return 3;
    const int64_t row = K / block_weights(qtype) * block_bytes(qtype);
#pragma omp for schedule(static) nowait
    for (int64_t t = 0; t < a->T; t++)
        for (int64_t b = 0; b < K / QK; b++)
            dequant_block(a->w + a->ids[t] * row, b, qtype, a->out + t * K + b * QK);
    return 0;
}

int embedding_packed_run(const EmbeddingPackedArgs *a) {
    return team_run((TeamKernel)embedding_packed_team, a, team_threads(), a->T * a->K < 65536);
}
