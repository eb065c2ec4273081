/* Paged-attention decode for the tessellm CPU plugin: one query token per sequence, K/V read
 * in place through the block table (no gather, no padding copies).
 *
 * Layouts (contiguous unless a stride is given):
 *   q    [B, H * D]                 out [B, H * D]
 *   kv   [2, NB, NKV, BS, D]        K then V, head-major inside a block; token t of
 *                                   sequence b is row t % BS of block
 *                                   block_tables[b * bt_stride + t / BS]
 *   block_tables [B, bt_cols] int32 (row stride bt_stride)
 *   seq_lens [B] int32 (keys 0..seq_len-1 are attended; seq_len 0 gives zeros)
 * Inputs are checked before anything is read through them (check_inputs: head counts, every
 * seq_len >= 0 and within its table row, every block id it uses inside the pool); a bad input
 * returns its own PD_ERR_* code with the sequence and column in info[2]. Scratch memory for all
 * threads is allocated before the OpenMP region, so a failed allocation returns PD_ERR_ALLOC
 * without ever leaving a parallel region early.
 * Grouped-query attention: query head h reads KV head h / (H / NKV).
 * Math in float32 (scores, softmax, accumulation), like the reference op; bfloat16 output is
 * rounded to nearest even. Work is split over (sequence, KV head) pairs with OpenMP; each pair
 * handles its G = H / NKV query heads together so every K/V row is loaded once. The per-pair
 * body is inlined with D = 64 and D = 128 as constants so the compiler unrolls and keeps the
 * accumulators in registers; other head sizes use the same code with D at run time.
 */
#include <math.h>
#include <omp.h>
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

/* Return codes of paged_decode_*; on an error info[0] is the sequence and info[1] the
 * block-table column (or the blocks needed, for PD_ERR_TABLE_WIDTH) concerned, -1 if none. */
enum {
    PD_OK = 0,
    PD_ERR_ALLOC = 1,        /* scratch buffers could not be allocated */
    PD_ERR_SHAPE = 2,        /* a non-positive head count, head size, block size or pool size */
    PD_ERR_HEADS = 3,        /* H is not a multiple of NKV */
    PD_ERR_SEQ_LEN = 4,      /* seq_lens[b] < 0 */
    PD_ERR_TABLE_WIDTH = 5,  /* ceil(seq_lens[b] / BS) > bt_cols */
    PD_ERR_BLOCK_ID = 6,     /* a block id the sequence uses is outside 0 .. NB-1 */
};

/* Everything the kernel indexes with, checked before anything is read through it. */
static int check_inputs(const int32_t *block_tables, int64_t bt_stride, int64_t bt_cols,
                        const int32_t *seq_lens, int64_t B, int64_t H, int64_t NKV, int64_t D,
                        int64_t BS, int64_t NB, int64_t *info, int64_t *max_len) {
    info[0] = info[1] = -1;
    if (B < 0 || H <= 0 || NKV <= 0 || D <= 0 || BS <= 0 || NB <= 0 || bt_cols < 0 ||
        bt_stride < 0)
        return PD_ERR_SHAPE;
    if (H % NKV != 0) return PD_ERR_HEADS;
    int64_t longest = 0;
    for (int64_t b = 0; b < B; ++b) {
        const int64_t L = seq_lens[b];
        info[0] = b;
        if (L < 0) return PD_ERR_SEQ_LEN;
        const int64_t blocks = (L + BS - 1) / BS;
        if (blocks > bt_cols) { info[1] = blocks; return PD_ERR_TABLE_WIDTH; }
        const int32_t *table = block_tables + b * bt_stride;
        for (int64_t j = 0; j < blocks; ++j)
            if (table[j] < 0 || table[j] >= NB) { info[1] = j; return PD_ERR_BLOCK_ID; }
        longest = L > longest ? L : longest;
    }
    info[0] = -1;
    *max_len = longest;
    return PD_OK;
}

/* One allocation holding nt per-thread scratch areas (scores [G * max_len], q and acc
 * [G * D] each, every part rounded up to a 64-byte multiple); NULL on overflow or failure. */
static float *alloc_scratch(int64_t G, int64_t max_len, int64_t D, int nt, size_t *scores_n,
                            size_t *qf_n) {
    size_t s, f, per, total;
    if (__builtin_mul_overflow((size_t)G, (size_t)max_len, &s) ||
        __builtin_mul_overflow((size_t)G, (size_t)D, &f) ||
        __builtin_add_overflow(s, (size_t)15, &s) || __builtin_add_overflow(f, (size_t)15, &f))
        return NULL;
    s &= ~(size_t)15;
    f &= ~(size_t)15;
    if (__builtin_mul_overflow(f, (size_t)2, &per) || __builtin_add_overflow(per, s, &per) ||
        __builtin_mul_overflow(per, (size_t)nt, &total) ||
        __builtin_mul_overflow(total, sizeof(float), &total))
        return NULL;
    *scores_n = s;
    *qf_n = f;
    return aligned_alloc(64, total);
}

#define DEFINE_DECODE(NAME, T, LOAD, STORE)                                                    \
INLINE void NAME##_pair(const T *q, const T *kbase, const T *vbase, const int32_t *table,     \
                        T *out, int64_t L, int64_t G, int64_t D, int64_t BS, int64_t block_stride,      \
                        float scale, float *scores, float *qf, float *acc) {                   \
    if (L == 0) {                                                                              \
        for (int64_t i = 0; i < G * D; ++i) out[i] = STORE(0.f);                              \
        return;                                                                                \
    }                                                                                          \
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
         int64_t bt_cols, const int32_t *seq_lens, T *out, int64_t B, int64_t H, int64_t NKV,  \
         int64_t D, int64_t BS, int64_t NB, float scale, int64_t *info) {                      \
    int64_t max_len = 0;                                                                       \
    const int rc = check_inputs(block_tables, bt_stride, bt_cols, seq_lens, B, H, NKV, D, BS,  \
                                NB, info, &max_len);                                           \
    if (rc != PD_OK || B == 0) return rc;                                                      \
    const int64_t G = H / NKV, block_stride = NKV * BS * D;                                    \
    const T *vbase = kv + NB * BS * NKV * D;                                                   \
    /* scratch for every thread, taken before the parallel region: a failed allocation      \
     * returns here, never inside the OpenMP team */                                          \
    const int nt = omp_get_max_threads() > 0 ? omp_get_max_threads() : 1;                      \
    size_t scores_n, qf_n;                                                                     \
    float *scratch = alloc_scratch(G, max_len, D, nt, &scores_n, &qf_n);                       \
    if (!scratch) return PD_ERR_ALLOC;                                                         \
    const size_t per_thread = scores_n + 2 * qf_n;                                             \
    _Pragma("omp parallel num_threads(nt)")                                                    \
    {                                                                                          \
        float *scores = scratch + (size_t)omp_get_thread_num() * per_thread;                   \
        float *qf = scores + scores_n, *acc = qf + qf_n;                                       \
        _Pragma("omp for schedule(dynamic, 4)")                                                \
        for (int64_t task = 0; task < B * NKV; ++task) {                                       \
            const int64_t b = task / NKV, kvh = task % NKV;                                    \
            const T *qp = q + (b * H + kvh * G) * D;                                           \
            const int32_t *table = block_tables + b * bt_stride;                               \
            T *op = out + (b * H + kvh * G) * D;                                               \
            const T *kp = kv + kvh * BS * D, *vp = vbase + kvh * BS * D;                       \
            if (D == 64)                                                                       \
                NAME##_pair(qp, kp, vp, table, op, seq_lens[b], G, 64, BS, block_stride, scale, \
                            scores, qf, acc);                                                  \
            else if (D == 128)                                                                 \
                NAME##_pair(qp, kp, vp, table, op, seq_lens[b], G, 128, BS, block_stride,      \
                            scale, scores, qf, acc);                                           \
            else                                                                               \
                NAME##_pair(qp, kp, vp, table, op, seq_lens[b], G, D, BS, block_stride, scale,  \
                            scores, qf, acc);                                                  \
        }                                                                                      \
    }                                                                                          \
    free(scratch);                                                                             \
    return PD_OK;                                                                              \
}

DEFINE_DECODE(paged_decode_f32, float, f32_id, f32_id)
DEFINE_DECODE(paged_decode_bf16, uint16_t, bf16_to_f32, f32_to_bf16)
