/* Mixture-of-experts layer over packed GGML experts with float32 activations for the
 * tessellm CPU plugin (op fused_moe_packed, tessellm.kernels.reference_moe), in one team
 * kernel, so a decode step's MoE layer is one node of its native program. Arguments, layouts
 * and the pair sort: moe_pairs.h.
 * Work: one thread sorts the T * K (token, slot) pairs by expert and lists the chosen experts,
 * the team gathers the pairs' rows of x, then runs gate/up of every chosen expert as ONE
 * worksharing loop over all their groups of NR output features (linear_packed's tiles: each
 * decoded block serves up to MR of the expert's rows), applies silu-and-mul, runs down the
 * same way, and sums each token's K rows weighted, in slot order. An expert nobody chose is
 * never read; a chosen one is read once for all of its rows; the team splits the chosen
 * experts' weights evenly whatever their count, prefetching across expert boundaries, with a
 * barrier per phase (not per expert). Portable C: expert by expert through linear_packed's
 * team code.
 */
#include "linear_packed.c"
#include "moe_pairs.h"

/* Scratch after the pairs (moe_pairs.h), 64-byte aligned: float32 rows xg[P, H], h[P, 2I],
 * a[P, I], y[P, H], and block sums of max(H, I) / 32 per pair row (P = T * K). */
typedef struct {
    float *xg, *h, *act, *y, *xs;
} MoeRows;

static int64_t moe_floats(const MoePackedArgs *a) {
    const int64_t P = moe_pair_count(a), wide = a->H > a->I ? a->H : a->I;
    return P * (a->H + 2 * a->I + a->I + a->H) + P * (wide / QK + 1);
}

int64_t moe_packed_scratch(const MoePackedArgs *a) {
    if (a->T <= 0 || a->K <= 0) return 0;
    return moe_pair_bytes(a) + (int64_t)sizeof(float) * moe_floats(a) + 64;
}

static MoeRows moe_rows_at(const MoePackedArgs *a, MoePairs s) {
    MoeRows m;
    const int64_t P = moe_pair_count(a);
    m.xg = (float *)moe_align64(s.chosen + a->E + 1);
    m.h = m.xg + P * a->H;
    m.act = m.h + P * 2 * a->I;
    m.y = m.act + P * a->I;
    m.xs = m.y + P * a->H;
    return m;
}

/* out (sorted pair rows) = x rows @ W_e^T for every chosen expert e: W_e the N rows of K
 * inputs at e * N of w. Ends in a nowait loop: the caller's barrier follows. */
static void moe_experts_linear(MoePairs s, int64_t E, float *xs, const float *x, int64_t K,
                               const uint8_t *w, int64_t N, int qtype, float *out) {
    const int64_t row = K / block_weights(qtype) * block_bytes(qtype);
    const int64_t n_chosen = s.chosen[E];
#ifdef __AVX512F__
    const int64_t nb = K / QK, per_expert = (N + NR - 1) / NR, groups = n_chosen * per_expert;
    const int64_t rows_all = s.offsets[E];
    const int64_t steps = is_k_quant(qtype) ? nb / 2 : nb;
#pragma omp for schedule(static)
    for (int64_t r = 0; r < rows_all; r++) block_sums(x + r * K, 1, K, xs + r * nb);
#pragma omp for schedule(static) nowait
    for (int64_t g = 0; g < groups; g++) {
        const int64_t e = s.chosen[g / per_expert], n0 = (g % per_expert) * NR;
        const int nr = (int)(N - n0 < NR ? N - n0 : NR);
        const int64_t r0 = s.offsets[e], rows = s.offsets[e + 1] - r0;
        SpreadPrefetch ahead = moe_group_ahead(s, E, w, N, row, NR, g, steps);
        group_rows(x + r0 * K, xs + r0 * nb, K, w + e * N * row, row, qtype, n0, nr, rows,
                   NULL, out + r0 * N, N, &ahead);
    }
#else
    (void)xs;
    for (int64_t c = 0; c < n_chosen; c++) {
        const int64_t e = s.chosen[c], r0 = s.offsets[e];
        LinearPackedArgs la = {x + r0 * K, s.offsets[e + 1] - r0, K, w + e * N * row, N,
                               qtype, NULL, out + r0 * N, NULL};
        linear_packed_team(&la);
    }
#endif
}

/* Returns 0, 1 on a bad format or width, 3 when an expert id is outside [0, E). */
int moe_packed_team(const MoePackedArgs *a) {
    const int rc = moe_check(a);
    if (rc) return rc;
    if (a->T == 0) return 0;
    const int64_t H = a->H, I = a->I, E = a->E, K = a->K, P = moe_pair_count(a);
    const MoePairs s = moe_pairs_at(a);
    const MoeRows m = moe_rows_at(a, s);
    moe_sort_pairs(a, s);
#pragma omp for schedule(static)
    for (int64_t r = 0; r < P; r++)
        memcpy(m.xg + r * H, a->x + (s.order[r] / K) * H, sizeof(float) * H);
    moe_experts_linear(s, E, m.xs, m.xg, H, a->w13, 2 * I, a->qtype13, m.h);
#pragma omp barrier
#pragma omp for schedule(static)
    for (int64_t r = 0; r < P; r++) moe_silu_row(m.h + r * 2 * I, I, m.act + r * I);
    moe_experts_linear(s, E, m.xs, m.act, I, a->w2, H, a->qtype2, m.y);
#pragma omp barrier
    moe_weighted_sum(a, s, m.y);
    return 0;
}

/* An eager call: 0, 1 on a bad format or width, 2 when scratch cannot be had, 3 on a bad id. */
int moe_packed_run(MoePackedArgs *a) {
    return TEAM_RUN_WITH_SCRATCH(moe_packed_team, a, moe_packed_scratch(a), team_threads(), 0,
                                 2);
}
