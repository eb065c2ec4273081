/* Paged-attention decode for the tessellm CPU plugin: one query token per sequence, K/V read
 * in place through the block table (no gather, no padding copies).
 *
 * Layouts (contiguous unless a stride is given):
 *   q    [B, H * D]                 out [B, H * D]
 *   kv   [2, NB, NKV, BS, D]        K then V, head-major inside a block; token t of
 *                                   sequence b is row t % BS of block
 *                                   block_tables[b * bt_stride + t / BS]
 *   seq_lens [B] int32 (keys 0..seq_len-1 are attended; seq_len >= 1)
 * Grouped-query attention: query head h reads KV head h / (H / NKV).
 * Math in float32 (scores, softmax, accumulation), like the reference op; bfloat16 output is
 * rounded to nearest even. Work is split over (sequence, KV head) pairs with OpenMP; each pair
 * handles its G = H / NKV query heads together so every K/V row is loaded once. The per-pair
 * body is inlined with D = 64 and D = 128 as constants so the compiler unrolls and keeps the
 * accumulators in registers; other head sizes use the same code with D at run time.
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#define INLINE static inline __attribute__((always_inline))

INLINE float bf16_to_f32(uint16_t x) {
    uint32_t u = (uint32_t)x << 16;
    float f;
    memcpy(&f, &u, sizeof f);
    return f;
}

INLINE uint16_t f32_to_bf16(float f) {
    uint32_t u;
    memcpy(&u, &f, sizeof u);
    if ((u & 0x7fffffffu) > 0x7f800000u) return (uint16_t)((u >> 16) | 0x40u); /* quiet NaN */
    u += 0x7fffu + ((u >> 16) & 1u);
    return (uint16_t)(u >> 16);
}

INLINE float f32_id(float x) { return x; }

/* exp(x) for x <= 0 (softmax after subtracting the max): 2^n * p(r), |rel err| < 2e-7;
 * written without branches or calls so that it vectorizes. Inputs below -87 give 0. */
INLINE float exp_nonpos(float x) {
    const float log2e = 1.44269504088896341f, ln2_hi = 0.693359375f, ln2_lo = -2.12194440e-4f;
    float xc = x < -87.f ? -87.f : x;
    float n = __builtin_floorf(xc * log2e + 0.5f);
    float r = xc - n * ln2_hi - n * ln2_lo;
    float p = 1.9875691500e-4f;
    p = p * r + 1.3981999507e-3f;
    p = p * r + 8.3334519073e-3f;
    p = p * r + 4.1665795894e-2f;
    p = p * r + 1.6666665459e-1f;
    p = p * r + 5.0000001201e-1f;
    p = p * r * r + r + 1.f;
    int32_t bits = ((int32_t)n + 127) << 23;
    float scale;
    memcpy(&scale, &bits, sizeof scale);
    return x < -87.f ? 0.f : p * scale;
}

#define DEFINE_DECODE(NAME, T, LOAD, STORE)                                                    \
INLINE void NAME##_pair(const T *q, const T *kbase, const T *vbase, const int32_t *table,     \
                        T *out, int64_t L, int64_t G, int64_t D, int64_t BS, int64_t block_stride,      \
                        float scale, float *scores, float *qf, float *acc) {                   \
    for (int64_t g = 0; g < G; ++g)                                                            \
        for (int64_t d = 0; d < D; ++d) qf[g * D + d] = LOAD(q[g * D + d]) * scale;            \
    for (int64_t t = 0; t < L; ++t) {                                                          \
        const T *k = kbase + (int64_t)table[t / BS] * block_stride + (t % BS) * D;                     \
        for (int64_t g = 0; g < G; ++g) {                                                      \
            const float *qg = qf + g * D;                                                      \
            float s = 0.f;                                                                     \
            _Pragma("omp simd reduction(+:s)")                                                 \
            for (int64_t d = 0; d < D; ++d) s += qg[d] * LOAD(k[d]);                           \
            scores[g * L + t] = s;                                                             \
        }                                                                                      \
    }                                                                                          \
    for (int64_t g = 0; g < G; ++g) {                                                          \
        float *sg = scores + g * L, m = sg[0], sum = 0.f;                                      \
        for (int64_t t = 1; t < L; ++t) m = sg[t] > m ? sg[t] : m;                             \
        _Pragma("omp simd reduction(+:sum)")                                                   \
        for (int64_t t = 0; t < L; ++t) { sg[t] = exp_nonpos(sg[t] - m); sum += sg[t]; }      \
        const float inv = 1.f / sum;                                                           \
        _Pragma("omp simd")                                                                    \
        for (int64_t t = 0; t < L; ++t) sg[t] *= inv;                                          \
    }                                                                                          \
    memset(acc, 0, sizeof(float) * (size_t)(G * D));                                           \
    for (int64_t t = 0; t < L; ++t) {                                                          \
        const T *v = vbase + (int64_t)table[t / BS] * block_stride + (t % BS) * D;                     \
        for (int64_t g = 0; g < G; ++g) {                                                      \
            const float p = scores[g * L + t];                                                 \
            float *ag = acc + g * D;                                                           \
            _Pragma("omp simd")                                                                \
            for (int64_t d = 0; d < D; ++d) ag[d] += p * LOAD(v[d]);                           \
        }                                                                                      \
    }                                                                                          \
    for (int64_t g = 0; g < G; ++g)                                                            \
        for (int64_t d = 0; d < D; ++d) out[g * D + d] = STORE(acc[g * D + d]);               \
}                                                                                              \
                                                                                               \
int NAME(const T *q, const T *kv, const int32_t *block_tables, int64_t bt_stride,             \
         const int32_t *seq_lens, T *out, int64_t B, int64_t H, int64_t NKV, int64_t D,        \
         int64_t BS, int64_t NB, float scale) {                                                \
    const int64_t G = H / NKV, block_stride = NKV * BS * D;                                                  \
    const T *vbase = kv + NB * BS * NKV * D;                                                   \
    int64_t max_len = 1;                                                                       \
    for (int64_t b = 0; b < B; ++b) max_len = seq_lens[b] > max_len ? seq_lens[b] : max_len;  \
    int failed = 0;                                                                            \
    _Pragma("omp parallel")                                                                    \
    {                                                                                          \
        float *scores = malloc(sizeof(float) * (size_t)(G * max_len));                         \
        float *qf = malloc(sizeof(float) * (size_t)(G * D));                                   \
        float *acc = malloc(sizeof(float) * (size_t)(G * D));                                  \
        if (!scores || !qf || !acc) {                                                          \
            _Pragma("omp atomic write") failed = 1;                                            \
        } else {                                                                               \
            _Pragma("omp for schedule(dynamic, 4)")                                           \
            for (int64_t task = 0; task < B * NKV; ++task) {                                   \
                const int64_t b = task / NKV, kvh = task % NKV;                                \
                const T *qp = q + (b * H + kvh * G) * D;                                       \
                const int32_t *table = block_tables + b * bt_stride;                           \
                T *op = out + (b * H + kvh * G) * D;                                           \
                const T *kp = kv + kvh * BS * D, *vp = vbase + kvh * BS * D;                             \
                if (D == 64)                                                                   \
                    NAME##_pair(qp, kp, vp, table, op, seq_lens[b], G, 64, BS, block_stride, scale,     \
                                scores, qf, acc);                                              \
                else if (D == 128)                                                             \
                    NAME##_pair(qp, kp, vp, table, op, seq_lens[b], G, 128, BS, block_stride, scale,    \
                                scores, qf, acc);                                              \
                else                                                                           \
                    NAME##_pair(qp, kp, vp, table, op, seq_lens[b], G, D, BS, block_stride, scale,      \
                                scores, qf, acc);                                              \
            }                                                                                  \
        }                                                                                      \
        free(scores); free(qf); free(acc);                                                     \
    }                                                                                          \
    return failed ? -1 : 0;                                                                    \
}

DEFINE_DECODE(paged_decode_f32, float, f32_id, f32_id)
DEFINE_DECODE(paged_decode_bf16, uint16_t, bf16_to_f32, f32_to_bf16)
