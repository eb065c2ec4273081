/* Mixture-of-experts layer over packed GGML experts with int8 activations for the tessellm
 * CPU plugin (op fused_moe_packed_q8act, tessellm.kernels.reference_moe): moe_packed.c's
 * layer with each expert linear's input rounded as linear_q8act.c rounds it (each 32-value
 * block of a row to int8 with a float32 scale) and its dot products on integers (AVX-512
 * VNNI). Arguments, layouts and the pair sort: moe_pairs.h.
 * Work: one thread sorts the pairs by expert; the team quantizes each token's row of x ONCE
 * (every pair of the token reads that row: no gather), runs gate/up of every chosen expert as
 * one worksharing loop over all their groups of NR output features (linear_q8act's tiles over
 * the expert's pair rows), then silu-and-mul and quantization per pair row, down the same
 * way, and each token's K rows summed weighted in slot order. A pair's result does not depend
 * on which other pairs share its expert (a tile's arithmetic per row is that of one row).
 */
#include "linear_q8act.c"
#include "moe_pairs.h"

/* Scratch after the pairs (moe_pairs.h), 64-byte aligned: the quantized rows of x [T] (H / 32
 * blocks each) and of the pairs' silu-and-mul rows [P] (I / 32 blocks), then QRow records for
 * the pairs' gate/up inputs [P] and down inputs [P], then float32 h [P, 2I], act [P, I],
 * y [P, H]. */
typedef struct {
    uint8_t *xq, *aq;
    QRow *in13, *in2;
    float *h, *act, *y;
} MoeQ8Rows;

static int64_t moe_q8_bytes(const MoePackedArgs *a) {
    const int64_t P = moe_pair_count(a);
    return (int64_t)(q8_row_stride(a->H / QK) * (size_t)a->T + q8_row_stride(a->I / QK) * (size_t)P)
           + (int64_t)round_up((int64_t)(2 * sizeof(QRow) * (size_t)P), 64)
           + (int64_t)sizeof(float) * P * (2 * a->I + a->I + a->H);
}

int64_t moe_q8act_scratch(const MoePackedArgs *a) {
    if (a->T <= 0 || a->K <= 0 || a->H <= 0 || a->I <= 0) return 0;
    return moe_pair_bytes(a) + moe_q8_bytes(a) + 64;
}

static MoeQ8Rows moe_q8_rows_at(const MoePackedArgs *a, MoePairs s) {
    MoeQ8Rows m;
    const int64_t P = moe_pair_count(a);
    m.xq = (uint8_t *)moe_align64(s.chosen + a->E + 1);
    m.aq = m.xq + q8_row_stride(a->H / QK) * (size_t)a->T;
    m.in13 = (QRow *)(m.aq + q8_row_stride(a->I / QK) * (size_t)P);
    m.in2 = m.in13 + P;
    m.h = (float *)moe_align64(m.in2 + P);
    m.act = m.h + P * 2 * a->I;
    m.y = m.act + P * a->I;
    return m;
}

/* out (sorted pair rows) = rows @ W_e^T for every chosen expert e: W_e the N rows of nb
 * blocks at e * N of w; rows[r] the quantized input of sorted pair row r. Ends in a nowait
 * loop: the caller's barrier follows. */
static void moe_q8_experts_linear(MoePairs s, int64_t E, const QRow *rows, int64_t nb,
                                  const uint8_t *w, int64_t N, int qtype, float *out) {
    const int64_t row = nb * QK / block_weights(qtype) * block_bytes(qtype);
    const int64_t per_expert = (N + NR - 1) / NR, groups = s.chosen[E] * per_expert;
#pragma omp for schedule(static) nowait
    for (int64_t g = 0; g < groups; g++) {
        const int64_t e = s.chosen[g / per_expert], n0 = (g % per_expert) * NR;
        const int nr = (int)(N - n0 < NR ? N - n0 : NR);
        const int64_t r0 = s.offsets[e], count = s.offsets[e + 1] - r0;
        SpreadPrefetch ahead = moe_group_ahead(s, E, w, N, row, NR, g, (nb + 1) / 2);
        feature_group(rows + r0, count, nb, w + e * N * row, row, qtype, n0, nr, NULL,
                      out + r0 * N, N, &ahead);
    }
}

/* Returns 0, 1 on a bad format or width, 3 when an expert id is outside [0, E). */
int moe_q8act_team(const MoePackedArgs *a) {
    const int rc = moe_check(a);
    if (rc) return rc;
    if (a->T == 0) return 0;
    const int64_t H = a->H, I = a->I, E = a->E, K = a->K, P = moe_pair_count(a);
    const int64_t nb13 = H / QK, nb2 = I / QK;
    const MoePairs s = moe_pairs_at(a);
    const MoeQ8Rows m = moe_q8_rows_at(a, s);
    moe_sort_pairs(a, s);
    /* nowait: the pointer loop below reads no quantized byte, and its barrier orders the
     * quantization before the linears */
#pragma omp for schedule(static) nowait
    for (int64_t t = 0; t < a->T; t++)
        quantize_row(a->x + t * H, nb13, q8_layout(a->qtype13), q8_row_at(m.xq, nb13, t));
#pragma omp for schedule(static)
    for (int64_t r = 0; r < P; r++) {
        m.in13[r] = q8_row_at(m.xq, nb13, s.order[r] / K);
        m.in2[r] = q8_row_at(m.aq, nb2, r);
    }
    moe_q8_experts_linear(s, E, m.in13, nb13, a->w13, 2 * I, a->qtype13, m.h);
#pragma omp barrier
#pragma omp for schedule(static)
    for (int64_t r = 0; r < P; r++) {
        moe_silu_row(m.h + r * 2 * I, I, m.act + r * I);
        quantize_row(m.act + r * I, nb2, q8_layout(a->qtype2), m.in2[r]);
    }
    moe_q8_experts_linear(s, E, m.in2, nb2, a->w2, H, a->qtype2, m.y);
#pragma omp barrier
    moe_weighted_sum(a, s, m.y);
    return 0;
}

/* An eager call: 0, 1 on a bad format or width, 2 when scratch cannot be had, 3 on a bad id. */
int moe_q8act_run(MoePackedArgs *a) {
    return TEAM_RUN_WITH_SCRATCH(moe_q8act_team, a, moe_q8act_scratch(a), team_threads(), 0,
                                 2);
}
