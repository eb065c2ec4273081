/* A float32 linear for few rows (decode steps) for the tessellm CPU plugin: out[M, N] =
 * x[M, K] @ W[N, K]^T (+ bias), W float32 read once per call: the team splits the output
 * features, each thread reads its rows of W in order and dots each with every row of x.
 * Per output the products are summed in 16 lanes over K (then the lanes, then the bias), so
 * a row's result does not depend on the batch it is in. For the small dense linears of
 * quantized models (a MoE router's [E, H], float32 in the file) that would otherwise leave
 * the decode step's native program for oneDNN. */
#include <stdint.h>

#include "team.h"

#ifdef __AVX512F__
#include <immintrin.h>
#endif

typedef struct {
    const float *x;
    int64_t M, K;
    const float *w;
    int64_t N;
    const float *bias;
    float *out;
} LinearF32Args;

static inline float dot(const float *a, const float *b, int64_t K) {
#ifdef __AVX512F__
    __m512 acc = _mm512_setzero_ps();
    int64_t k = 0;
    for (; k + 16 <= K; k += 16)
        acc = _mm512_fmadd_ps(_mm512_loadu_ps(a + k), _mm512_loadu_ps(b + k), acc);
    if (k < K) {
        const __mmask16 m = (__mmask16)((1u << (K - k)) - 1);
        acc = _mm512_fmadd_ps(_mm512_maskz_loadu_ps(m, a + k), _mm512_maskz_loadu_ps(m, b + k),
                              acc);
    }
    return _mm512_reduce_add_ps(acc);
#else
    float s = 0.f;
    for (int64_t k = 0; k < K; k++) s += a[k] * b[k];
    return s;
#endif
}

/* Returns 0, or 1 on a negative size. */
int linear_f32_team(const LinearF32Args *a) {
    const int64_t M = a->M, K = a->K, N = a->N;
    if (M < 0 || K < 0 || N < 0) return 1;
#pragma omp for schedule(static) nowait
    for (int64_t n = 0; n < N; n++) {
        const float *wr = a->w + n * K;
        const float b = a->bias ? a->bias[n] : 0.f;
        for (int64_t m = 0; m < M; m++) a->out[m * N + n] = dot(a->x + m * K, wr, K) + b;
    }
    return 0;
}

int linear_f32_run(const LinearF32Args *a) {
    return team_run((TeamKernel)linear_f32_team, a, team_threads(), a->N * a->K < 65536);
}
