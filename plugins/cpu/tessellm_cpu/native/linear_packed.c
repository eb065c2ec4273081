/* Linear over packed GGML weights (Q8_0, Q4_0, Q4_1) for the tessellm CPU plugin:
 * out[M, N] = x[M, K] @ W[N, K]^T (+ bias), W read in its packed form, never expanded.
 * (embedding_packed_f32 at the end: rows of such a weight, dequantized, for the embedding.)
 *
 * Layouts: x float32 [M, K] contiguous; W rows of K / 32 blocks (packed_blocks.h):
 *   Q8_0 34 B: fp16 d, int8 q[32]              w = d * q
 *   Q4_0 18 B: fp16 d, u8 qs[16]               w = d * (q - 8)
 *   Q4_1 20 B: fp16 d, fp16 m, u8 qs[16]       w = d * q + m
 * (4-bit: weight j < 16 is the low nibble of qs[j], weight j + 16 its high nibble).
 * Math in float32: per block t = q . x_block, then acc += d * t, plus the offset term
 * (-8 d or m) times the block's sum of x, precomputed once per row of x. The result equals the
 * float32 product with the dequantized weight up to summation order.
 * Work (AVX-512): OpenMP over groups of NR output features, each thread's groups in order and
 * prefetched about 4 KiB ahead; a group runs the rows of x in tiles of MR (then one at a
 * time), so each decoded block serves MR rows and each x block NR features, and the group's
 * weights stay in L1 across the tiles. The scales of 16 blocks are converted at once and a
 * nibble becomes its float by a 16-entry table lookup. Portable C otherwise: OpenMP over
 * output features, tiles of MT rows.
 */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "packed_blocks.h"
#include "prefetch.h"

#define INLINE static inline __attribute__((always_inline))
#define MT 8   /* rows of x per tile (portable path) */

INLINE float f16_to_f32(const uint8_t *p) {
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

#ifdef __AVX512F__
/* The 32 weights of a block over its scale d: q (Q8_0; Q4_x: the nibble, by a lookup in the
 * 16 levels, as vpermps reads only an index's low 4 bits), weights 0-15 in lo, 16-31 in hi. */
INLINE void block_levels(const uint8_t *blk, int qtype, __m512 *lo, __m512 *hi) {
    if (qtype == Q8_0) {
        *lo = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)(blk + 2))));
        *hi = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)(blk + 18))));
    } else {
        const __m512 levels = _mm512_setr_ps(0.f, 1.f, 2.f, 3.f, 4.f, 5.f, 6.f, 7.f, 8.f, 9.f,
                                             10.f, 11.f, 12.f, 13.f, 14.f, 15.f);
        const __m512i v = _mm512_cvtepu8_epi32(
            _mm_loadu_si128((const __m128i *)(blk + (qtype == Q4_1 ? 4 : 2))));
        *lo = _mm512_permutexvar_ps(v, levels);
        *hi = _mm512_cvtepi32_ps(_mm512_srli_epi32(v, 4));   /* a conversion: spares port 5 */
    }
}

#define NR 4   /* output features per group */
#define MR 4   /* rows of x per tile */
/* Rows m0 .. m0 + mr - 1 of x against weight rows n0 .. n0 + nr - 1 (mr <= MR, nr <= NR):
 * res[r * MR + i]. Each decoded weight block serves the mr rows and each x block the nr
 * features; per output the operations and their order do not depend on mr or nr (so a row's
 * result does not depend on the batch it is in): for every 16 blocks the offset terms
 * (16 lanes of o * block sum of x) are added into the accumulator, then for each block
 * t = q . x (a multiply and an FMA) is added as t * d, and the 16 lanes are summed at the end. */
INLINE void tile(const float *x, const float *xs, int64_t K, const uint8_t *w, int64_t row,
                 int qtype, int64_t n0, int nr, int64_t m0, int mr, float *res) {
    const int64_t nb = K / QK, bb = block_bytes(qtype);
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
            const __m512i heads = block_heads(w + (n0 + r) * row + g * bb, bb, gm);
            const __m512 d = half_lo(heads), o = block_offsets(heads, d, qtype);
            _mm512_storeu_ps(ds[r], d);
            for (int i = 0; i < mr; i++) acc[r][i] = _mm512_fmadd_ps(o, sx[i], acc[r][i]);
        }
        for (int64_t j = 0; j < ng; j++) {
            for (int r = 0; r < nr; r++) {
                __m512 lo, hi;
                block_levels(w + (n0 + r) * row + (g + j) * bb, qtype, &lo, &hi);
                const __m512 vd = _mm512_set1_ps(ds[r][j]);
                for (int i = 0; i < mr; i++) {
                    const float *xp = x + (m0 + i) * K + (g + j) * QK;
                    const __m512 t = _mm512_fmadd_ps(hi, _mm512_loadu_ps(xp + 16),
                                                     _mm512_mul_ps(lo, _mm512_loadu_ps(xp)));
                    acc[r][i] = _mm512_fmadd_ps(t, vd, acc[r][i]);
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
                     float *out, int64_t N) {
    float res[NR * MR];
#define TILE_Q(NRC, MRC)                                                                        \
    do {                                                                                        \
        if (qtype == Q4_1) tile(x, xs, K, w, row, Q4_1, n0, NRC, m0, MRC, res);                \
        else if (qtype == Q4_0) tile(x, xs, K, w, row, Q4_0, n0, NRC, m0, MRC, res);           \
        else tile(x, xs, K, w, row, Q8_0, n0, NRC, m0, MRC, res);                              \
    } while (0)
    if (nr == NR && mr == MR) TILE_Q(NR, MR);
    else if (nr == NR && mr == 1) TILE_Q(NR, 1);
    else TILE_Q(nr, mr);
#undef TILE_Q
    for (int i = 0; i < mr; i++)
        for (int r = 0; r < nr; r++)
            out[(m0 + i) * N + n0 + r] = res[r * MR + i] + (bias ? bias[n0 + r] : 0.f);
}
#else
/* One output feature n for rows m0 .. m0 + mt - 1. */
INLINE void row_tile(const float *x, const float *xs, int64_t K, const uint8_t *wrow,
                     int qtype, int64_t m0, int mt, float *res) {
    const int64_t nb = K / QK, bb = block_bytes(qtype);
    float acc[MT] = {0}, off[MT] = {0};
    float q[QK];
    for (int64_t b = 0; b < nb; b++) {
        const uint8_t *blk = wrow + b * bb;
        const float d = f16_to_f32(blk);
        float o;
        if (qtype == Q8_0) {
            for (int j = 0; j < QK; j++) q[j] = (float)(int8_t)blk[2 + j];
            o = 0.f;
        } else {
            const uint8_t *qs = blk + (qtype == Q4_1 ? 4 : 2);
            for (int j = 0; j < 16; j++) { q[j] = (float)(qs[j] & 0x0f); q[j + 16] = (float)(qs[j] >> 4); }
            o = qtype == Q4_1 ? f16_to_f32(blk + 2) : -8.f * d;
        }
        for (int i = 0; i < mt; i++) {
            const float *xp = x + (m0 + i) * K + b * QK;
            float t = 0.f;
            for (int j = 0; j < QK; j++) t += q[j] * xp[j];
            acc[i] += d * t;
            off[i] += o * xs[(m0 + i) * nb + b];
        }
    }
    for (int i = 0; i < mt; i++) res[i] = acc[i] + off[i];
}
#endif

/* Returns 0, 1 on a bad format or K, 2 when scratch memory cannot be allocated. */
int linear_packed_f32(const float *x, int64_t M, int64_t K, const uint8_t *w, int64_t N,
                      int qtype, const float *bias, float *out) {
    if ((qtype != Q4_0 && qtype != Q4_1 && qtype != Q8_0) || K % QK != 0) return 1;
    const int64_t nb = K / QK, row = nb * block_bytes(qtype);
    float *xs = (float *)malloc(sizeof(float) * (size_t)(M * nb > 0 ? M * nb : 1));
    if (!xs) return 2;
    block_sums(x, M, K, xs);
#ifdef __AVX512F__
    const int64_t groups = (N + NR - 1) / NR;
#pragma omp parallel for schedule(static)
    for (int64_t grp = 0; grp < groups; grp++) {
        const int64_t n0 = grp * NR;
        const int nr = (int)(N - n0 < NR ? N - n0 : NR);
        prefetch_group_ahead(w, grp, groups, NR * row, N * row);  /* each thread in order */
        int64_t m0 = 0;
        for (; m0 + MR <= M; m0 += MR) tile_out(x, xs, K, w, row, qtype, n0, nr, m0, MR, bias, out, N);
        for (; m0 < M; m0++) tile_out(x, xs, K, w, row, qtype, n0, nr, m0, 1, bias, out, N);
    }
#else
#pragma omp parallel for schedule(static)
    for (int64_t n = 0; n < N; n++) {
        float res[MT];
        const float bn = bias ? bias[n] : 0.f;
        for (int64_t m0 = 0; m0 < M; m0 += MT) {
            const int mt = (int)(M - m0 < MT ? M - m0 : MT);
            row_tile(x, xs, K, w + n * row, qtype, m0, mt, res);
            for (int i = 0; i < mt; i++) out[(m0 + i) * N + n] = res[i] + bn;
        }
    }
#endif
    free(xs);
    return 0;
}

/* Embedding rows: out[t, :] = row ids[t] of W [N, K] dequantized in float32, each weight
 * d * q (Q8_0), d * (q - 8) (Q4_0) or d * q + m (Q4_1), a multiply then an add as the
 * reference rounds them (C11 mode: no contraction into FMAs). Returns 0, 1 on a bad format or
 * K, 3 when an id is outside [0, N) (nothing is written then). */
int embedding_packed_f32(const int64_t *ids, int64_t T, const uint8_t *w, int64_t N, int64_t K,
                         int qtype, float *out) {
    if ((qtype != Q4_0 && qtype != Q4_1 && qtype != Q8_0) || K % QK != 0) return 1;
    for (int64_t t = 0; t < T; t++)
        if (ids[t] < 0 || ids[t] >= N) return 3;
    const int64_t nb = K / QK, bb = block_bytes(qtype);
    for (int64_t t = 0; t < T; t++) {
        const uint8_t *row = w + ids[t] * nb * bb;
        float *o = out + t * K;
        for (int64_t b = 0; b < nb; b++, o += QK) {
            const uint8_t *blk = row + b * bb;
            const float d = f16_to_f32(blk);
            if (qtype == Q8_0) {
                for (int j = 0; j < QK; j++) o[j] = d * (float)(int8_t)blk[2 + j];
            } else if (qtype == Q4_0) {
                for (int j = 0; j < 16; j++) {
                    o[j] = d * ((float)(blk[2 + j] & 0x0f) - 8.f);
                    o[j + 16] = d * ((float)(blk[2 + j] >> 4) - 8.f);
                }
            } else {
                const float m = f16_to_f32(blk + 2);
                for (int j = 0; j < 16; j++) {
                    const float lo = d * (float)(blk[4 + j] & 0x0f), hi = d * (float)(blk[4 + j] >> 4);
                    o[j] = lo + m;
                    o[j + 16] = hi + m;
                }
            }
        }
    }
    return 0;
}
