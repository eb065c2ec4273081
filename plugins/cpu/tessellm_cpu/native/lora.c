/* lora_add for the tessellm CPU plugin (op lora_add, tessellm.kernels.reference_lora): for
 * token row t with slot s = slots[t] >= 0, out[t] = y[t] + (x[t] . A[s]^T) . B[s]; a row
 * with slot -1 is copied from y. One team kernel, so a decode step's LoRA terms are nodes of
 * its native program (no Python node, no torch call per site).
 *
 * Layouts: x [T, K] (row stride ldx), y and out [T, N] (row strides ldy, ldo), A [S, R, K],
 * B [S, R, N] (both contiguous), slots int64 [T]; x, y, out, A and B all float32 (dtype 0)
 * or all bfloat16 (dtype 1). Sums in float32; the shrunk row (R values) stays float32 and
 * the result is rounded to the activation dtype once (round to nearest even).
 * The rows are grouped by slot (a counting pass into the scratch), up to RB rows of one slot
 * per group, so every weight vector loaded serves RB rows. Two phases: (1) worksharing over
 * groups: each row's R dot products of length K into the scratch (T * R floats); the loop's
 * barrier; (2) worksharing over blocks of NB output features: for each group, y's block
 * plus R scaled rows of B's block (an axpy per rank over contiguous features), so a block of
 * B (R x NB values) stays in L1 across the groups.
 * Returns 0, or 1 for a slot outside [-1, S). */
#include <stdint.h>
#include <string.h>

#include "team.h"

#define NB 128

typedef struct {
    const void *x, *y, *a, *b;
    const int64_t *slots;
    void *out;
    int64_t T, K, N, S, R, ldx, ldy, ldo;
    int dtype;
    float *scratch;
} LoraAddArgs;

static inline float bf16_to_f32(uint16_t v) {
    const uint32_t bits = (uint32_t)v << 16;
    float f;
    memcpy(&f, &bits, sizeof f);
    return f;
}

static inline uint16_t f32_to_bf16(float f) {   /* round to nearest even, NaN kept quiet */
    uint32_t bits;
    memcpy(&bits, &f, sizeof bits);
    if ((bits & 0x7fffffffu) > 0x7f800000u) return (uint16_t)((bits >> 16) | 0x40);
    return (uint16_t)((bits + 0x7fffu + ((bits >> 16) & 1u)) >> 16);
}

#ifdef __AVX512F__
#include <immintrin.h>
/* n (<= 16) values at p as float32 lanes (the rest zero). */
static inline __m512 load16(const void *p, int64_t i, int bf, int n) {
    const __mmask16 m = n >= 16 ? (__mmask16)0xffff : (__mmask16)((1u << n) - 1);
    if (bf) {
        const __m256i h = _mm256_maskz_loadu_epi16(m, (const uint16_t *)p + i);
        return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
    }
    return _mm512_maskz_loadu_ps(m, (const float *)p + i);
}

static inline void store16(void *p, int64_t i, __m512 v, int bf, int n) {
    const __mmask16 m = n >= 16 ? (__mmask16)0xffff : (__mmask16)((1u << n) - 1);
    if (!bf) {
        _mm512_mask_storeu_ps((float *)p + i, m, v);
        return;
    }
    /* round to nearest even: bits + 0x7fff + lsb of the kept half; NaN made quiet */
    const __m512i bits = _mm512_castps_si512(v);
    const __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(bits, 16), _mm512_set1_epi32(1));
    __m512i r = _mm512_srli_epi32(
        _mm512_add_epi32(_mm512_add_epi32(bits, _mm512_set1_epi32(0x7fff)), lsb), 16);
    const __mmask16 nan = _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q);
    r = _mm512_mask_or_epi32(r, nan, _mm512_srli_epi32(bits, 16), _mm512_set1_epi32(0x40));
    _mm256_mask_storeu_epi16((uint16_t *)p + i, m, _mm512_cvtepi32_epi16(r));
}
#endif

#define RB 4   /* rows of one slot computed together: each weight vector loaded once */

/* shr[j][r] = x[rows[j]] . A[s, r] for the nr (<= RB) rows of one slot. */
static inline __attribute__((always_inline)) void shrink_n(
    const LoraAddArgs *a, const int64_t *rows, const int nr, int64_t s, float *shr, int bf) {
    const int64_t K = a->K, R = a->R;
    for (int64_t r = 0; r < R; r++) {
        const int64_t ai = (s * R + r) * K;
#ifdef __AVX512F__
        __m512 acc[RB];
        for (int j = 0; j < RB; j++) acc[j] = _mm512_setzero_ps();
        for (int64_t k = 0; k < K; k += 16) {
            const int n = K - k < 16 ? (int)(K - k) : 16;
            const __m512 w = load16(a->a, ai + k, bf, n);
            for (int j = 0; j < nr; j++)
                acc[j] = _mm512_fmadd_ps(load16(a->x, rows[j] * a->ldx + k, bf, n), w, acc[j]);
        }
        for (int j = 0; j < nr; j++) shr[rows[j] * R + r] = _mm512_reduce_add_ps(acc[j]);
#else
        for (int j = 0; j < nr; j++) {
            float acc = 0.f;
            for (int64_t k = 0; k < K; k++) {
                const int64_t xi = rows[j] * a->ldx + k;
                acc += (bf ? bf16_to_f32(((const uint16_t *)a->x)[xi]) : ((const float *)a->x)[xi])
                     * (bf ? bf16_to_f32(((const uint16_t *)a->a)[ai + k])
                           : ((const float *)a->a)[ai + k]);
            }
            shr[rows[j] * R + r] = acc;
        }
#endif
    }
}

/* out[t, n0:n1] = y[t, n0:n1] + sum_r shr[t][r] * B[s, r, n0:n1] for the nr (<= RB) rows t
 * of one slot s (no term when s < 0). */
static inline __attribute__((always_inline)) void expand_n(
    const LoraAddArgs *a, const int64_t *rows, const int nr, int64_t s, const float *shr,
    int64_t n0, int64_t n1, int bf) {
    const int64_t R = a->R, N = a->N;
#ifdef __AVX512F__
    for (int64_t n = n0; n < n1; n += 16) {
        const int w = n1 - n < 16 ? (int)(n1 - n) : 16;
        __m512 v[RB];
        for (int j = 0; j < nr; j++) v[j] = load16(a->y, rows[j] * a->ldy + n, bf, w);
        if (s >= 0)
            for (int64_t r = 0; r < R; r++) {
                const __m512 b = load16(a->b, (s * R + r) * N + n, bf, w);
                for (int j = 0; j < nr; j++)
                    v[j] = _mm512_fmadd_ps(_mm512_set1_ps(shr[rows[j] * R + r]), b, v[j]);
            }
        for (int j = 0; j < nr; j++) store16(a->out, rows[j] * a->ldo + n, v[j], bf, w);
    }
#else
    for (int j = 0; j < nr; j++)
        for (int64_t n = n0; n < n1; n++) {
            const int64_t t = rows[j];
            float v = bf ? bf16_to_f32(((const uint16_t *)a->y)[t * a->ldy + n])
                         : ((const float *)a->y)[t * a->ldy + n];
            if (s >= 0)
                for (int64_t r = 0; r < R; r++) {
                    const int64_t bi = (s * R + r) * N + n;
                    v += shr[t * R + r] * (bf ? bf16_to_f32(((const uint16_t *)a->b)[bi])
                                              : ((const float *)a->b)[bi]);
                }
            if (bf) ((uint16_t *)a->out)[t * a->ldo + n] = f32_to_bf16(v);
            else ((float *)a->out)[t * a->ldo + n] = v;
        }
#endif
}

/* shrink_n / expand_n with nr a constant of each case, so their RB accumulators live in
 * registers (a run-time count leaves them in memory). */
static void shrink(const LoraAddArgs *a, const int64_t *rows, int nr, int64_t s, float *shr,
                   int bf) {
    switch (nr) {
    case 4: shrink_n(a, rows, 4, s, shr, bf); break;
    case 3: shrink_n(a, rows, 3, s, shr, bf); break;
    case 2: shrink_n(a, rows, 2, s, shr, bf); break;
    default: shrink_n(a, rows, 1, s, shr, bf); break;
    }
}

static void expand(const LoraAddArgs *a, const int64_t *rows, int nr, int64_t s,
                   const float *shr, int64_t n0, int64_t n1, int bf) {
    switch (nr) {
    case 4: expand_n(a, rows, 4, s, shr, n0, n1, bf); break;
    case 3: expand_n(a, rows, 3, s, shr, n0, n1, bf); break;
    case 2: expand_n(a, rows, 2, s, shr, n0, n1, bf); break;
    default: expand_n(a, rows, 1, s, shr, n0, n1, bf); break;
    }
}

/* Rows sorted by slot (base-model rows first), as `order`; groups of up to RB rows of one
 * slot start at the indices `starts` (returns how many groups; starts[groups] = T). */
static int64_t group_rows(const LoraAddArgs *a, int64_t *order, int64_t *starts) {
    const int64_t T = a->T, S = a->S;
    int64_t groups = 0, at = 0;
    for (int64_t s = -1; s < S; s++) {
        const int64_t first = at;
        for (int64_t t = 0; t < T; t++)
            if (a->slots[t] == s) order[at++] = t;
        for (int64_t g = first; g < at; g += RB) starts[groups++] = g;
    }
    starts[groups] = T;
    return groups;
}

/* Scratch: the shrunk rows (T * R floats), the row order and group starts (2T + 1 int64). */
int64_t lora_add_scratch(const LoraAddArgs *a) {
    if (a->T <= 0) return 0;
    return a->T * a->R * (int64_t)sizeof(float) + (2 * a->T + 1) * (int64_t)sizeof(int64_t);
}

int lora_add_team(const LoraAddArgs *a) {
    for (int64_t t = 0; t < a->T; t++)
        if (a->slots[t] < -1 || a->slots[t] >= a->S) return 1;
    if (a->T <= 0) return 0;
    const int64_t T = a->T, N = a->N, R = a->R;
    const int bf = a->dtype == 1;
    float *shr = a->scratch;
    int64_t *order = (int64_t *)(shr + T * R), *starts = order + T;
    int64_t groups = 0;
#pragma omp single copyprivate(groups)
    groups = group_rows(a, order, starts);
#pragma omp for schedule(static)
    for (int64_t g = 0; g < groups; g++) {
        const int64_t s = a->slots[order[starts[g]]];
        if (s >= 0) shrink(a, order + starts[g], (int)(starts[g + 1] - starts[g]), s, shr, bf);
    }   /* the loop's barrier: every shrunk row is written before any is read */
    const int64_t blocks = (N + NB - 1) / NB;
#pragma omp for schedule(static) nowait
    for (int64_t blk = 0; blk < blocks; blk++) {
        const int64_t n0 = blk * NB, n1 = n0 + NB < N ? n0 + NB : N;
        for (int64_t g = 0; g < groups; g++)
            expand(a, order + starts[g], (int)(starts[g + 1] - starts[g]),
                   a->slots[order[starts[g]]], shr, n0, n1, bf);
    }
    return 0;
}

/* An eager call: 0, 1 (a bad slot) or 2 when the scratch cannot be had. */
int lora_add_run(LoraAddArgs *a) {
    return TEAM_RUN_WITH_SCRATCH(lora_add_team, a, lora_add_scratch(a), team_threads(),
                                 a->T * a->N < 8192, 2);
}
