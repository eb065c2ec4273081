/* Mixture-of-experts layer over packed GGML experts for the tessellm CPU plugin (op
 * fused_moe_packed, tessellm.kernels.reference_moe): out[t] = sum_j w[t, j] *
 * down_e(silu(gate_e(x_t)) * up_e(x_t)), e = ids[t, j], in one team kernel, so a decode step's
 * MoE layer is one node of its native program.
 *
 * Layouts: x float32 [T, H]; w13 the rows of E experts stacked, expert e's 2I rows (gate,
 * then up) at e * 2I, each row H weights in `qtype13` blocks; w2 expert e's H rows of I
 * weights at e * H in `qtype2` blocks; ids int64 [T, K], weights float32 [T, K]; out float32
 * [T, H].
 * Work: one thread sorts the T * K (token, slot) pairs by expert (a counting sort) and lists
 * the chosen experts, the team gathers the pairs' rows of x, then runs gate/up of every chosen
 * expert as ONE worksharing loop over all their groups of NR output features (linear_packed's
 * tiles: each decoded block serves up to MR of the expert's rows), applies silu-and-mul,
 * runs down the same way, and sums each token's K rows weighted, in slot order. An expert
 * nobody chose is never read; a chosen one is read once for all of its rows; the team splits
 * the chosen experts' weights evenly whatever their count, prefetching across expert
 * boundaries, with a barrier per phase (not per expert). Portable C: expert by expert through
 * linear_packed's team code.
 */
#include <math.h>

#include "linear_packed.c"

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

/* Scratch: offsets[E + 1], order[P], slot_of[P], chosen[E + 1] (int64; chosen[E] = how
 * many experts are chosen), then float32 rows: xg[P, H], h[P, 2I], a[P, I], y[P, H], and
 * block sums of max(H, I) / 32 per pair row (P = T * K). Every thread derives the same
 * pointers from a->scratch; the sort's results are read only after its barrier. */
typedef struct {
    int64_t *offsets, *order, *slot_of, *chosen;
    float *xg, *h, *act, *y, *xs;
} MoeScratch;

static int64_t moe_pairs(const MoePackedArgs *a) { return a->T * a->K; }

static int64_t moe_floats(const MoePackedArgs *a) {
    const int64_t P = moe_pairs(a), wide = a->H > a->I ? a->H : a->I;
    return P * (a->H + 2 * a->I + a->I + a->H) + P * (wide / QK + 1);
}

int64_t moe_packed_scratch(const MoePackedArgs *a) {
    if (a->T <= 0 || a->K <= 0) return 0;
    const int64_t ints = 2 * (a->E + 1) + 2 * moe_pairs(a);
    return (int64_t)sizeof(int64_t) * ints + (int64_t)sizeof(float) * moe_floats(a) + 64;
}

static MoeScratch moe_layout(const MoePackedArgs *a) {
    MoeScratch s;
    const int64_t P = moe_pairs(a);
    s.offsets = (int64_t *)a->scratch;
    s.order = s.offsets + a->E + 1;
    s.slot_of = s.order + P;
    s.chosen = s.slot_of + P;
    uintptr_t f = (uintptr_t)(s.chosen + a->E + 1);
    f = (f + 63) & ~(uintptr_t)63;
    s.xg = (float *)f;
    s.h = s.xg + P * a->H;
    s.act = s.h + P * 2 * a->I;
    s.y = s.act + P * a->I;
    s.xs = s.y + P * a->H;
    return s;
}

/* out (sorted pair rows) = x rows @ W_e^T for every chosen expert e: W_e the N rows of K
 * inputs at e * N of w. Ends in a nowait loop: the caller's barrier follows. */
static void moe_experts_linear(const MoeScratch *s, int64_t E, const float *x, int64_t K,
                               const uint8_t *w, int64_t N, int qtype, float *out) {
    const int64_t row = K / block_weights(qtype) * block_bytes(qtype);
    const int64_t n_chosen = s->chosen[E];
#ifdef __AVX512F__
    const int64_t nb = K / QK, per_expert = (N + NR - 1) / NR, groups = n_chosen * per_expert;
    const int64_t rows_all = s->offsets[E];
    const int64_t skip = NR * row >= SPREAD_BYTES ? 1 : SPREAD_BYTES / (NR * row);
    const int64_t steps = is_k_quant(qtype) ? nb / 2 : nb;
#pragma omp for schedule(static)
    for (int64_t r = 0; r < rows_all; r++) block_sums(x + r * K, 1, K, s->xs + r * nb);
#pragma omp for schedule(static) nowait
    for (int64_t g = 0; g < groups; g++) {
        const int64_t e = s->chosen[g / per_expert], n0 = (g % per_expert) * NR;
        const int nr = (int)(N - n0 < NR ? N - n0 : NR);
        const int64_t r0 = s->offsets[e], rows = s->offsets[e + 1] - r0;
        /* ask for the group SPREAD_BYTES ahead in the list, whichever expert it is in */
        SpreadPrefetch ahead = {0};
        if (g + skip < groups && steps > 0) {
            const int64_t ge = s->chosen[(g + skip) / per_expert];
            const int64_t gn = ((g + skip) % per_expert) * NR;
            ahead.p = (const char *)(w + (ge * N + gn) * row);
            ahead.left = ((N - gn < NR ? N - gn : NR) * row + 63) / 64;
            ahead.per_step = (ahead.left + steps - 1) / steps;
        }
        group_rows(x + r0 * K, s->xs + r0 * nb, K, w + e * N * row, row, qtype, n0, nr, rows,
                   NULL, out + r0 * N, N, &ahead);
    }
#else
    for (int64_t c = 0; c < n_chosen; c++) {
        const int64_t e = s->chosen[c], r0 = s->offsets[e];
        LinearPackedArgs la = {x + r0 * K, s->offsets[e + 1] - r0, K, w + e * N * row, N,
                               qtype, NULL, out + r0 * N, NULL};
        linear_packed_team(&la);
    }
#endif
}

/* Returns 0, 1 on a bad format or width, 3 when an expert id is outside [0, E). */
int moe_packed_team(const MoePackedArgs *a) {
    const int64_t T = a->T, H = a->H, I = a->I, E = a->E, K = a->K, P = T * K;
    if (block_bytes(a->qtype13) == 0 || block_bytes(a->qtype2) == 0 || H <= 0 || I <= 0
        || H % block_weights(a->qtype13) || I % block_weights(a->qtype2) || E <= 0 || K <= 0)
        return 1;
    for (int64_t p = 0; p < P; p++)
        if (a->ids[p] < 0 || a->ids[p] >= E) return 3;
    if (T == 0) return 0;
    const MoeScratch s = moe_layout(a);
#pragma omp single
    {   /* counting sort of the pairs by expert; slot_of[pair] = its row among the sorted */
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
#pragma omp for schedule(static)
    for (int64_t r = 0; r < P; r++)
        memcpy(s.xg + r * H, a->x + (s.order[r] / K) * H, sizeof(float) * H);
    moe_experts_linear(&s, E, s.xg, H, a->w13, 2 * I, a->qtype13, s.h);
#pragma omp barrier
#pragma omp for schedule(static)
    for (int64_t r = 0; r < P; r++) {
        const float *g = s.h + r * 2 * I, *u = g + I;
        float *o = s.act + r * I;
        for (int64_t i = 0; i < I; i++) o[i] = g[i] / (1.f + expf(-g[i])) * u[i];
    }
    moe_experts_linear(&s, E, s.act, I, a->w2, H, a->qtype2, s.y);
#pragma omp barrier
#pragma omp for schedule(static) nowait
    for (int64_t t = 0; t < T; t++) {
        float *o = a->out + t * H;
        for (int64_t c = 0; c < H; c++) o[c] = 0.f;
        for (int64_t j = 0; j < K; j++) {
            const float w = a->weights[t * K + j];
            const float *y = s.y + s.slot_of[t * K + j] * H;
            for (int64_t c = 0; c < H; c++) o[c] += w * y[c];
        }
    }
    return 0;
}

/* An eager call: 0, 1 on a bad format or width, 2 when scratch cannot be had, 3 on a bad id. */
int moe_packed_run(MoePackedArgs *a) {
    return TEAM_RUN_WITH_SCRATCH(moe_packed_team, a, moe_packed_scratch(a), team_threads(), 0,
                                 2);
}
