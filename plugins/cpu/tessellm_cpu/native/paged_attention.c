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
 * rounded to nearest even. Work is split over (sequence, KV head) pairs with OpenMP, and when
 * there are fewer pairs than twice the threads, over chunks of whole blocks of each pair's
 * context too (merged after, as flash-decoding does); each item handles its G = H / NKV query
 * heads together so every K/V row is loaded once, walking blocks and then rows (no division
 * per token). The body is inlined with D = 64 and D = 128 as constants so the compiler unrolls
 * and keeps the accumulators in registers; other head sizes use the same code with D at run
 * time.
 */
#include <math.h>
#include <omp.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "prefetch.h"
#include "vec_math.h"

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

/* Blocks are scattered over the pool, so the hardware's stream prefetchers lose the trail at
 * every block boundary (and at every 4 KiB page inside a larger block). The K and V passes
 * keep PREFETCH_BYTES of rows asked for ahead of the 16 rows they read, following the block
 * table: at token t they prefetch the rows of token t + PREFETCH_BYTES / row bytes on. */
/* Prefetch the rows of tokens [ta, min(ta + 16, end of ta's block, t1)) of one head. */
#define PREFETCH_ROWS(base, table, ta, t1, BS, block_stride, D, T)                            \
    do {                                                                                       \
        const int64_t ta_ = (ta);                                                              \
        if (ta_ < (t1)) {                                                                      \
            const int64_t row_ = ta_ % (BS);                                                   \
            int64_t n_ = (BS) - row_ < 16 ? (BS) - row_ : 16;                                  \
            n_ = (t1) - ta_ < n_ ? (t1) - ta_ : n_;                                            \
            prefetch_bytes((base) + (int64_t)(table)[ta_ / (BS)] * (block_stride) + row_ * (D),  \
                           n_ * (D) * (int64_t)sizeof(T));                                     \
        }                                                                                      \
    } while (0)
#define PREFETCH_TOKENS(D, T) (PREFETCH_BYTES / ((D) * (int64_t)sizeof(T)))

#ifdef __AVX512F__
#include <immintrin.h>
/* Lane i of the result = the sum of the 16 lanes of v[i] (a transpose-and-add network: four
 * shuffle stages, then one permutation into order). */
INLINE __m512 hsum16(const __m512 v[16]) {
    __m512 t[8], u[4], w[2];
    for (int j = 0; j < 8; ++j)
        t[j] = _mm512_add_ps(_mm512_shuffle_f32x4(v[2 * j], v[2 * j + 1], 0x44),
                             _mm512_shuffle_f32x4(v[2 * j], v[2 * j + 1], 0xEE));
    for (int k = 0; k < 4; ++k)
        u[k] = _mm512_add_ps(_mm512_shuffle_f32x4(t[2 * k], t[2 * k + 1], 0x88),
                             _mm512_shuffle_f32x4(t[2 * k], t[2 * k + 1], 0xDD));
    for (int k = 0; k < 2; ++k)
        w[k] = _mm512_add_ps(_mm512_shuffle_ps(u[2 * k], u[2 * k + 1], 0x44),
                             _mm512_shuffle_ps(u[2 * k], u[2 * k + 1], 0xEE));
    const __m512 r = _mm512_add_ps(_mm512_shuffle_ps(w[0], w[1], 0x88),
                                   _mm512_shuffle_ps(w[0], w[1], 0xDD));
    return _mm512_permutexvar_ps(
        _mm512_setr_epi32(0, 4, 8, 12, 1, 5, 9, 13, 2, 6, 10, 14, 3, 7, 11, 15), r);
}

INLINE __m512 vload_f32(const float *p) { return _mm512_loadu_ps(p); }
INLINE __m512 vload_bf16(const uint16_t *p) {
    return _mm512_castsi512_ps(_mm512_slli_epi32(
        _mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)p)), 16));
}
/* The largest of sg[0 .. n-1] (n >= 1). */
INLINE float max_of(const float *sg, int64_t n) {
    __m512 m = _mm512_set1_ps(sg[0]);
    for (int64_t i = 0; i < n; i += 16) {
        const __mmask16 k = n - i >= 16 ? (__mmask16)0xffff : (__mmask16)((1u << (n - i)) - 1u);
        m = _mm512_mask_max_ps(m, k, m, _mm512_maskz_loadu_ps(k, sg + i));
    }
    return _mm512_reduce_max_ps(m);
}

/* sg[i] = exp(sg[i] - mx) for i < n; returns their sum. */
INLINE float exp_shift_sum(float *sg, int64_t n, float mx) {
    __m512 sum = _mm512_setzero_ps();
    const __m512 vm = _mm512_set1_ps(mx);
    for (int64_t i = 0; i < n; i += 16) {
        const __mmask16 k = n - i >= 16 ? (__mmask16)0xffff : (__mmask16)((1u << (n - i)) - 1u);
        const __m512 e = exp_nonpos16(_mm512_sub_ps(_mm512_maskz_loadu_ps(k, sg + i), vm));
        _mm512_mask_storeu_ps(sg + i, k, e);
        sum = _mm512_add_ps(sum, _mm512_maskz_mov_ps(k, e));
    }
    return _mm512_reduce_add_ps(sum);
}
#define VEC_QK 1
#else
#define VEC_QK 0
#endif

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

/* Work items: (sequence, KV head, context chunk). A chunk is a run of whole blocks; a pair is
 * split into chunks only when there are too few pairs to keep every thread busy
 * (flash-decoding), and then each chunk leaves a partial result (max, sum of exp, unnormalized
 * accumulator per query head) that a second pass merges. */
typedef struct {
    int64_t chunks;        /* chunks per pair */
    int64_t chunk_blocks;  /* blocks per chunk */
} Split;

static Split plan_split(int64_t pairs, int64_t max_len, int64_t BS, int nt) {
    Split sp = {1, (max_len + BS - 1) / BS};
    const int64_t blocks = sp.chunk_blocks;
    if (pairs >= 2 * nt || blocks < 2) return sp;
    int64_t want = (2 * nt + pairs - 1) / pairs;       /* chunks per pair for ~2 per thread */
    if (want > blocks) want = blocks;
    sp.chunk_blocks = (blocks + want - 1) / want;
    sp.chunks = (blocks + sp.chunk_blocks - 1) / sp.chunk_blocks;
    return sp;
}

/* Per thread: scores [G * chunk_len] and q [G * D] (floats, each part a 16-float multiple). */
static float *alloc_scratch(int64_t G, int64_t chunk_len, int64_t D, int nt, size_t *scores_n,
                            size_t *qf_n) {
    size_t s, f, per, total;
    if (__builtin_mul_overflow((size_t)G, (size_t)chunk_len, &s) ||
        __builtin_mul_overflow((size_t)G, (size_t)D, &f) ||
        __builtin_add_overflow(s, (size_t)15, &s) || __builtin_add_overflow(f, (size_t)15, &f))
        return NULL;
    s &= ~(size_t)15;
    f &= ~(size_t)15;
    if (__builtin_add_overflow(f, s, &per) || __builtin_mul_overflow(per, (size_t)nt, &total) ||
        __builtin_mul_overflow(total, sizeof(float), &total))
        return NULL;
    *scores_n = s;
    *qf_n = f;
    return aligned_alloc(64, total);
}

/* The partial result of one work item: m[G], l[G], acc[G * D]. */
INLINE size_t partial_floats(int64_t G, int64_t D) { return (size_t)(G * (D + 2)); }

#if VEC_QK && defined(__AVX512BF16__)
#define DP_BF16 1
/* bfloat16 scores with AVX-512 BF16 dot products: scores[g * n + (t - t0)] = scale (q_g . k_t),
 * 32 products of q and k (both bfloat16, as stored) per instruction, summed in float32; each
 * block's rows 16 at a time. D % 32 == 0. */
INLINE void scores16_dpbf16(const uint16_t *q, float scale, const uint16_t *kbase,
                            const int32_t *table, int64_t t0, int64_t t1, int64_t G, int64_t D,
                            int64_t BS, int64_t block_stride, float *scores) {
    const int64_t n = t1 - t0;
    const __m512 vs = _mm512_set1_ps(scale);
    for (int64_t b = t0 / BS, t = t0; t < t1; ++b) {
        const uint16_t *kb = kbase + (int64_t)table[b] * block_stride;
        const int64_t rows = t1 - t < BS ? t1 - t : BS;
        for (int64_t r0 = 0; r0 < rows; r0 += 16) {
            const int64_t nr = rows - r0 < 16 ? rows - r0 : 16;
            PREFETCH_ROWS(kbase, table, t + r0 + PREFETCH_TOKENS(D, uint16_t), t1, BS,
                          block_stride, D, uint16_t);
            for (int64_t g = 0; g < G; ++g) {
                const uint16_t *qg = q + g * D;
                __m512 part[16];
                for (int64_t r = 0; r < 16; ++r) {
                    __m512 a = _mm512_setzero_ps();
                    if (r < nr)
                        for (int64_t c = 0; c < D; c += 32)
                            a = _mm512_dpbf16_ps(
                                a, (__m512bh)_mm512_loadu_si512(qg + c),
                                (__m512bh)_mm512_loadu_si512(kb + (r0 + r) * D + c));
                    part[r] = a;
                }
                _mm512_mask_storeu_ps(scores + g * n + (t - t0) + r0,
                                      (__mmask16)((1u << nr) - 1u),
                                      _mm512_mul_ps(hsum16(part), vs));
            }
        }
        t += rows;
    }
}
#else
#define DP_BF16 0
INLINE void scores16_dpbf16(const uint16_t *q, float scale, const uint16_t *kbase,
                            const int32_t *table, int64_t t0, int64_t t1, int64_t G, int64_t D,
                            int64_t BS, int64_t block_stride, float *scores) {
    (void)q; (void)scale; (void)kbase; (void)table; (void)t0; (void)t1; (void)G; (void)D;
    (void)BS; (void)block_stride; (void)scores;
}
#endif

#if VEC_QK
#define DEFINE_SCORES16(NAME, T, VLOAD)                                                        \
/* scores[g * n + (t - t0)] = q_g . k_t for tokens [t0, t1), 16 rows of a block at a time. */  \
INLINE void NAME##_scores16(const float *qf, const T *kbase, const int32_t *table, int64_t t0, \
                            int64_t t1, int64_t G, int64_t D, int64_t BS,                      \
                            int64_t block_stride, float *scores) {                             \
    const int64_t n = t1 - t0;                                                                 \
    for (int64_t b = t0 / BS, t = t0; t < t1; ++b) {                                           \
        const T *kb = kbase + (int64_t)table[b] * block_stride;                                \
        const int64_t rows = t1 - t < BS ? t1 - t : BS;                                        \
        for (int64_t r0 = 0; r0 < rows; r0 += 16) {                                            \
            const int64_t nr = rows - r0 < 16 ? rows - r0 : 16;                                \
            PREFETCH_ROWS(kbase, table, t + r0 + PREFETCH_TOKENS(D, T), t1, BS, block_stride, D, \
                          T);                                                                  \
            for (int64_t g = 0; g < G; ++g) {                                                  \
                const float *qg = qf + g * D;                                                  \
                __m512 part[16];                                                               \
                for (int64_t r = 0; r < 16; ++r) {                                             \
                    __m512 a = _mm512_setzero_ps();                                            \
                    if (r < nr)                                                                \
                        for (int64_t c = 0; c < D; c += 16)                                    \
                            a = _mm512_fmadd_ps(_mm512_loadu_ps(qg + c),                       \
                                                VLOAD(kb + (r0 + r) * D + c), a);              \
                    part[r] = a;                                                               \
                }                                                                              \
                _mm512_mask_storeu_ps(scores + g * n + (t - t0) + r0,                          \
                                      (__mmask16)((1u << nr) - 1u), hsum16(part));             \
            }                                                                                  \
        }                                                                                      \
        t += rows;                                                                             \
    }                                                                                          \
}                                                                                              \
INLINE float NAME##_exp_sum(float *sg, int64_t n, float mx) { return exp_shift_sum(sg, n, mx); } \
INLINE float NAME##_max(const float *sg, int64_t n) { return max_of(sg, n); }                  \
/* acc[g * D + d] = sum over tokens of p[g][t] v_t[d], 64 features in four registers. */       \
INLINE void NAME##_pv64(const float *scores, const T *vbase, const int32_t *table, int64_t t0, \
                        int64_t t1, int64_t G, int64_t D, int64_t BS, int64_t block_stride,    \
                        float *acc) {                                                          \
    const int64_t n = t1 - t0;                                                                 \
    for (int64_t g = 0; g < G; ++g)                                                            \
        for (int64_t c = 0; c < D; c += 64) {                                                  \
            __m512 a0 = _mm512_setzero_ps(), a1 = a0, a2 = a0, a3 = a0;                        \
            for (int64_t b = t0 / BS, t = t0; t < t1; ++b) {                                   \
                const T *vb = vbase + (int64_t)table[b] * block_stride + c;                    \
                const int64_t rows = t1 - t < BS ? t1 - t : BS;                                \
                for (int64_t r = 0; r < rows; ++r, ++t) {                                      \
                    if (c == 0 && (r & 15) == 0)                                               \
                        PREFETCH_ROWS(vbase, table, t + PREFETCH_TOKENS(D, T), t1, BS,         \
                                      block_stride, D, T);                                     \
                    const __m512 p = _mm512_set1_ps(scores[g * n + (t - t0)]);                 \
                    const T *v = vb + r * D;                                                   \
                    a0 = _mm512_fmadd_ps(p, VLOAD(v), a0);                                     \
                    a1 = _mm512_fmadd_ps(p, VLOAD(v + 16), a1);                                \
                    a2 = _mm512_fmadd_ps(p, VLOAD(v + 32), a2);                                \
                    a3 = _mm512_fmadd_ps(p, VLOAD(v + 48), a3);                                \
                }                                                                              \
            }                                                                                  \
            float *o = acc + g * D + c;                                                        \
            _mm512_storeu_ps(o, a0);                                                           \
            _mm512_storeu_ps(o + 16, a1);                                                      \
            _mm512_storeu_ps(o + 32, a2);                                                      \
            _mm512_storeu_ps(o + 48, a3);                                                      \
        }                                                                                      \
}
#else
#define DEFINE_SCORES16(NAME, T, VLOAD)                                                        \
INLINE void NAME##_scores16(const float *qf, const T *kbase, const int32_t *table, int64_t t0, \
                            int64_t t1, int64_t G, int64_t D, int64_t BS,                      \
                            int64_t block_stride, float *scores) {                             \
    (void)qf; (void)kbase; (void)table; (void)t0; (void)t1; (void)G; (void)D; (void)BS;        \
    (void)block_stride; (void)scores;                                                          \
}                                                                                              \
INLINE float NAME##_exp_sum(float *sg, int64_t n, float mx) {                                  \
    (void)sg; (void)n; (void)mx; return 0.f;                                                   \
}                                                                                              \
INLINE float NAME##_max(const float *sg, int64_t n) { (void)sg; (void)n; return 0.f; }        \
INLINE void NAME##_pv64(const float *scores, const T *vbase, const int32_t *table, int64_t t0, \
                        int64_t t1, int64_t G, int64_t D, int64_t BS, int64_t block_stride,    \
                        float *acc) {                                                          \
    (void)scores; (void)vbase; (void)table; (void)t0; (void)t1; (void)G; (void)D; (void)BS;    \
    (void)block_stride; (void)acc;                                                             \
}
#endif

#define DEFINE_DECODE(NAME, T, LOAD, STORE)                                                    \
/* Query heads g of one KV head over tokens [t0, t1) (whole blocks from block t0 / BS): m[g]    \
 * the max score, l[g] the sum of exp(score - m), acc the sum of exp(score - m) * v. */          \
INLINE void NAME##_chunk(const T *q, const T *kbase, const T *vbase, const int32_t *table,    \
                         int64_t t0, int64_t t1, int64_t G, int64_t D, int64_t BS,              \
                         int64_t block_stride, float scale, float *scores, float *qf,           \
                         float *m, float *l, float *acc) {                                      \
    const int64_t n = t1 - t0;                                                                 \
    for (int64_t g = 0; g < G; ++g)                                                            \
        for (int64_t d = 0; d < D; ++d) qf[g * D + d] = LOAD(q[g * D + d]) * scale;            \
    if (DP_BF16 && sizeof(T) == 2 && D % 32 == 0)   /* bfloat16 dot products */              \
        scores16_dpbf16((const uint16_t *)q, scale, (const uint16_t *)kbase, table, t0, t1, G,  \
                        D, BS, block_stride, scores);                                          \
    else if (VEC_QK && D % 16 == 0)   /* 16 rows at a time, no reduction per row */           \
        NAME##_scores16(qf, kbase, table, t0, t1, G, D, BS, block_stride, scores);             \
    else                                                                                       \
    for (int64_t b = t0 / BS, t = t0; t < t1; ++b) {                                           \
        const T *kb = kbase + (int64_t)table[b] * block_stride;                                \
        const int64_t rows = t1 - t < BS ? t1 - t : BS;                                        \
        for (int64_t r = 0; r < rows; ++r, ++t) {                                              \
            const T *k = kb + r * D;                                                           \
            for (int64_t g = 0; g < G; ++g) {                                                  \
                const float *qg = qf + g * D;                                                  \
                float s = 0.f;                                                                 \
                _Pragma("omp simd reduction(+:s)")                                             \
                for (int64_t d = 0; d < D; ++d) s += qg[d] * LOAD(k[d]);                       \
                scores[g * n + (t - t0)] = s;                                                  \
            }                                                                                  \
        }                                                                                      \
    }                                                                                          \
    for (int64_t g = 0; g < G; ++g) {                                                          \
        float *sg = scores + g * n, mx = sg[0], sum = 0.f;                                     \
        if (VEC_QK) {                                                                          \
            mx = NAME##_max(sg, n);                                                            \
            sum = NAME##_exp_sum(sg, n, mx);                                                   \
        } else {                                                                               \
            for (int64_t i = 1; i < n; ++i) mx = sg[i] > mx ? sg[i] : mx;                      \
            for (int64_t i = 0; i < n; ++i) { sg[i] = exp_nonpos(sg[i] - mx); sum += sg[i]; } \
        }                                                                                      \
        m[g] = mx;                                                                             \
        l[g] = sum;                                                                            \
    }                                                                                          \
    if (VEC_QK && D % 64 == 0) {  /* accumulators in registers, 64 features at a time */      \
        NAME##_pv64(scores, vbase, table, t0, t1, G, D, BS, block_stride, acc);               \
        return;                                                                                \
    }                                                                                          \
    memset(acc, 0, sizeof(float) * (size_t)(G * D));                                           \
    for (int64_t b = t0 / BS, t = t0; t < t1; ++b) {                                           \
        const T *vb = vbase + (int64_t)table[b] * block_stride;                                \
        const int64_t rows = t1 - t < BS ? t1 - t : BS;                                        \
        for (int64_t r = 0; r < rows; ++r, ++t) {                                              \
            const T *v = vb + r * D;                                                           \
            for (int64_t g = 0; g < G; ++g) {                                                  \
                const float p = scores[g * n + (t - t0)];                                      \
                float *ag = acc + g * D;                                                       \
                _Pragma("omp simd")                                                            \
                for (int64_t d = 0; d < D; ++d) ag[d] += p * LOAD(v[d]);                       \
            }                                                                                  \
        }                                                                                      \
    }                                                                                          \
}                                                                                              \
                                                                                               \
INLINE void NAME##_item(const T *q, const T *kp, const T *vp, const int32_t *table, int64_t t0, \
                        int64_t t1, int64_t G, int64_t D, int64_t BS, int64_t block_stride,     \
                        float scale, float *scores, float *qf, float *part) {                  \
    float *m = part, *l = part + G, *acc = part + 2 * G;                                       \
    if (D == 64)                                                                               \
        NAME##_chunk(q, kp, vp, table, t0, t1, G, 64, BS, block_stride, scale, scores, qf, m, \
                     l, acc);                                                                  \
    else if (D == 128)                                                                         \
        NAME##_chunk(q, kp, vp, table, t0, t1, G, 128, BS, block_stride, scale, scores, qf, m, \
                     l, acc);                                                                  \
    else                                                                                       \
        NAME##_chunk(q, kp, vp, table, t0, t1, G, D, BS, block_stride, scale, scores, qf, m,  \
                     l, acc);                                                                  \
}                                                                                              \
                                                                                               \
int NAME(const T *q, const T *kv, const int32_t *block_tables, int64_t bt_stride,             \
         int64_t bt_cols, const int32_t *seq_lens, T *out, int64_t B, int64_t H, int64_t NKV,  \
         int64_t D, int64_t BS, int64_t NB, float scale, int64_t *info) {                      \
    int64_t max_len = 0;                                                                       \
    const int rc = check_inputs(block_tables, bt_stride, bt_cols, seq_lens, B, H, NKV, D, BS,  \
                                NB, info, &max_len);                                           \
    if (rc != PD_OK || B == 0) return rc;                                                      \
    const int64_t G = H / NKV, block_stride = NKV * BS * D, pairs = B * NKV;                   \
    const T *vbase = kv + NB * BS * NKV * D;                                                   \
    const int nt = omp_get_max_threads() > 0 ? omp_get_max_threads() : 1;                      \
    const Split sp = plan_split(pairs, max_len, BS, nt);                                       \
    const int64_t chunk_len = sp.chunk_blocks * BS < max_len ? sp.chunk_blocks * BS : max_len; \
    /* scratch for every thread and every partial result, taken before the parallel region: \
     * a failed allocation returns here, never inside the OpenMP team */                      \
    size_t scores_n, qf_n;                                                                     \
    float *scratch = alloc_scratch(G, chunk_len > 0 ? chunk_len : 1, D, nt, &scores_n, &qf_n); \
    float *parts = malloc(sizeof(float) * partial_floats(G, D) * (size_t)(pairs * sp.chunks)); \
    if (!scratch || !parts) { free(scratch); free(parts); return PD_ERR_ALLOC; }               \
    const size_t per_thread = scores_n + qf_n, per_part = partial_floats(G, D);                \
    _Pragma("omp parallel num_threads(nt)")                                                    \
    {                                                                                          \
        float *scores = scratch + (size_t)omp_get_thread_num() * per_thread;                   \
        float *qf = scores + scores_n;                                                         \
        _Pragma("omp for schedule(dynamic, 1)")                                                \
        for (int64_t item = 0; item < pairs * sp.chunks; ++item) {                             \
            const int64_t pair = item / sp.chunks, c = item % sp.chunks;                       \
            const int64_t b = pair / NKV, kvh = pair % NKV, L = seq_lens[b];                   \
            const int64_t t0 = c * sp.chunk_blocks * BS;                                       \
            const int64_t t1 = t0 + sp.chunk_blocks * BS < L ? t0 + sp.chunk_blocks * BS : L;  \
            float *part = parts + (size_t)item * per_part;                                     \
            if (t0 >= t1) { part[0] = -INFINITY; continue; }  /* nothing of this sequence */   \
            NAME##_item(q + (b * H + kvh * G) * D, kv + kvh * BS * D, vbase + kvh * BS * D,    \
                        block_tables + b * bt_stride, t0, t1, G, D, BS, block_stride, scale,   \
                        scores, qf, part);                                                     \
        }                                                                                      \
        /* merge each pair's chunks (the implicit barrier above: all partials are written) */  \
        _Pragma("omp for schedule(static)")                                                    \
        for (int64_t pair = 0; pair < pairs; ++pair) {                                         \
            const int64_t b = pair / NKV, kvh = pair % NKV;                                    \
            T *op = out + (b * H + kvh * G) * D;                                               \
            const float *first = parts + (size_t)(pair * sp.chunks) * per_part;                \
            for (int64_t g = 0; g < G; ++g) {                                                  \
                float mx = -INFINITY;                                                          \
                for (int64_t c = 0; c < sp.chunks; ++c) {                                      \
                    const float *pc = first + (size_t)c * per_part;                            \
                    if (pc[0] != -INFINITY && pc[g] > mx) mx = pc[g];                          \
                }                                                                              \
                float *o = qf;   /* this thread's scratch: the merged accumulator */           \
                float sum = 0.f;                                                               \
                for (int64_t d = 0; d < D; ++d) o[d] = 0.f;                                    \
                for (int64_t c = 0; c < sp.chunks && mx != -INFINITY; ++c) {                   \
                    const float *pc = first + (size_t)c * per_part;                            \
                    if (pc[0] == -INFINITY) continue;                                          \
                    const float w = exp_nonpos(pc[g] - mx);                                    \
                    sum += w * pc[G + g];                                                      \
                    const float *ac = pc + 2 * G + g * D;                                      \
                    _Pragma("omp simd")                                                        \
                    for (int64_t d = 0; d < D; ++d) o[d] += w * ac[d];                         \
                }                                                                              \
                const float inv = sum > 0.f ? 1.f / sum : 0.f;  /* seq_len 0: zeros */         \
                for (int64_t d = 0; d < D; ++d) op[g * D + d] = STORE(o[d] * inv);             \
            }                                                                                  \
        }                                                                                      \
    }                                                                                          \
    free(parts);                                                                               \
    free(scratch);                                                                             \
    return PD_OK;                                                                              \
}

#if VEC_QK
DEFINE_SCORES16(paged_decode_f32, float, vload_f32)
DEFINE_SCORES16(paged_decode_bf16, uint16_t, vload_bf16)
#else
DEFINE_SCORES16(paged_decode_f32, float, (void))
DEFINE_SCORES16(paged_decode_bf16, uint16_t, (void))
#endif
DEFINE_DECODE(paged_decode_f32, float, f32_id, f32_id)
DEFINE_DECODE(paged_decode_bf16, uint16_t, bf16_to_f32, f32_to_bf16)
