/* The expert-sorted (token, slot) pairs of a mixture-of-experts layer, shared by the CPU
 * plugin's MoE team kernels (moe_packed.c: float32 activations; moe_q8act.c: int8
 * activations; ops fused_moe_packed and fused_moe_packed_q8act of
 * tessellm.kernels.reference_moe): out[t] = sum_j w[t, j] * down_e(silu(gate_e(x_t)) * up_e(x_t)),
 * e = ids[t, j].
 *
 * Layouts: x float32 [T, H]; w13 the rows of E experts stacked, expert e's 2I rows (gate,
 * then up) at e * 2I, each row H weights in `qtype13` blocks; w2 expert e's H rows of I
 * weights at e * H in `qtype2` blocks; ids int64 [T, K], weights float32 [T, K]; out float32
 * [T, H]. A pair p = t * K + j is token t's slot j; its row among the sorted pairs is
 * slot_of[p], and the pairs of expert e are rows offsets[e] .. offsets[e + 1] - 1.
 * Needs packed_blocks.h and prefetch.h first.
 */
#ifndef TESSELLM_MOE_PAIRS_H
#define TESSELLM_MOE_PAIRS_H

#include <math.h>
#include <stdint.h>
#include <string.h>

#include "vec_math.h"

typedef struct {
    const float *x;
    int64_t T, H;
    const uint8_t *w13;
    int qtype13;
    const uint8_t *w2;
    int qtype2;
    int64_t E, I, K;
    const float *weights;
    const int64_t *ids;
    float *out;
    void *scratch;
} MoePackedArgs;

/* offsets[E + 1], order[P] (sorted row -> pair), slot_of[P] (pair -> sorted row), chosen[E + 1]
 * (the experts with pairs in id order; chosen[E] = how many), all int64 at the start of the
 * scratch; every thread derives the same pointers. */
typedef struct {
    int64_t *offsets, *order, *slot_of, *chosen;
} MoePairs;

static inline int64_t moe_pair_count(const MoePackedArgs *a) { return a->T * a->K; }

static inline int64_t moe_pair_bytes(const MoePackedArgs *a) {
    return (int64_t)sizeof(int64_t) * (2 * (a->E + 1) + 2 * moe_pair_count(a));
}

static inline MoePairs moe_pairs_at(const MoePackedArgs *a) {
    MoePairs s;
    s.offsets = (int64_t *)a->scratch;
    s.order = s.offsets + a->E + 1;
    s.slot_of = s.order + moe_pair_count(a);
    s.chosen = s.slot_of + moe_pair_count(a);
    return s;
}

/* The first 64-byte boundary at or after `p`. */
static inline uintptr_t moe_align64(const void *p) {
    return ((uintptr_t)p + 63) & ~(uintptr_t)63;
}

/* 0, 1 on a bad format or width, 3 when an expert id is outside [0, E). Reads only the
 * arguments and ids, so every thread returns the same code before any barrier. */
static inline int moe_check(const MoePackedArgs *a) {
    if (block_bytes(a->qtype13) == 0 || block_bytes(a->qtype2) == 0 || a->H <= 0 || a->I <= 0
        || a->H % block_weights(a->qtype13) || a->I % block_weights(a->qtype2) || a->E <= 0
        || a->K <= 0)
        return 1;
    for (int64_t p = 0; p < moe_pair_count(a); p++)
        if (a->ids[p] < 0 || a->ids[p] >= a->E) return 3;
    return 0;
}

/* The counting sort of the pairs by expert, on one thread (its implicit barrier publishes it). */
static inline void moe_sort_pairs(const MoePackedArgs *a, MoePairs s) {
#pragma omp single
    {
        const int64_t E = a->E, P = moe_pair_count(a);
        for (int64_t e = 0; e <= E; e++) s.offsets[e] = 0;
        for (int64_t p = 0; p < P; p++) s.offsets[a->ids[p] + 1]++;
        for (int64_t e = 0; e < E; e++) s.offsets[e + 1] += s.offsets[e];
        int64_t *fill = s.chosen;   /* the per-expert cursor first, then the chosen list */
        for (int64_t e = 0; e < E; e++) fill[e] = s.offsets[e];
        for (int64_t p = 0; p < P; p++) s.order[fill[a->ids[p]]++] = p;
        for (int64_t r = 0; r < P; r++) s.slot_of[s.order[r]] = r;
        int64_t n = 0;
        for (int64_t e = 0; e < E; e++)
            if (s.offsets[e + 1] > s.offsets[e]) s.chosen[n++] = e;
        s.chosen[E] = n;
    }
}

/* act[i] = silu(gate[i]) * up[i] for the I features of one pair row (gate then up in h);
 * 16 lanes at a time through vec_math.h's silu16 (|rel err| < 2e-7) where AVX-512 is built. */
static inline void moe_silu_row(const float *h, int64_t I, float *act) {
    const float *g = h, *u = h + I;
    int64_t i = 0;
#ifdef __AVX512F__
    for (; i + 16 <= I; i += 16)
        _mm512_storeu_ps(act + i, _mm512_mul_ps(silu16(_mm512_loadu_ps(g + i)),
                                                _mm512_loadu_ps(u + i)));
#endif
    for (; i < I; i++) act[i] = g[i] / (1.f + expf(-g[i])) * u[i];
}

/* out[t] = sum_j w[t, j] * y[slot_of[t * K + j]], the slots in order. Ends in a nowait loop. */
static inline void moe_weighted_sum(const MoePackedArgs *a, MoePairs s, const float *y) {
    const int64_t H = a->H, K = a->K;
#pragma omp for schedule(static) nowait
    for (int64_t t = 0; t < a->T; t++) {
        float *o = a->out + t * H;
        for (int64_t c = 0; c < H; c++) o[c] = 0.f;
        for (int64_t j = 0; j < K; j++) {
            const float w = a->weights[t * K + j];
            const float *yr = y + s.slot_of[t * K + j] * H;
            for (int64_t c = 0; c < H; c++) o[c] += w * yr[c];
        }
    }
}

/* Work group g of a layer's expert linear (the chosen experts' N rows of `row` bytes each, in
 * groups of `nr` rows, whole groups per expert): the group SPREAD_BYTES ahead in the list, in
 * whichever expert it is, spread over `steps` steps of g's work. */
static inline SpreadPrefetch moe_group_ahead(MoePairs s, int64_t E, const uint8_t *w, int64_t N,
                                             int64_t row, int64_t nr, int64_t g,
                                             int64_t steps) {
    SpreadPrefetch ahead = {0};
    const int64_t per_expert = (N + nr - 1) / nr, groups = s.chosen[E] * per_expert;
    const int64_t skip = nr * row >= SPREAD_BYTES ? 1 : SPREAD_BYTES / (nr * row);
    if (g + skip < groups && steps > 0) {
        const int64_t ge = s.chosen[(g + skip) / per_expert];
        const int64_t gn = ((g + skip) % per_expert) * nr;
        ahead.p = (const char *)(w + (ge * N + gn) * row);
        ahead.left = ((N - gn < nr ? N - gn : nr) * row + 63) / 64;
        ahead.per_step = (ahead.left + steps - 1) / steps;
    }
    return ahead;
}

#endif
