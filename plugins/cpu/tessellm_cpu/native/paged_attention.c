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
 * rounded to nearest even.
 *
 * Work items are (sequence, run of whole blocks): a sequence's context is split into runs only
 * when there are fewer sequences than twice the threads (flash-decoding; the runs' partial
 * results are merged after). An item walks its blocks in order and, inside each block, every
 * KV head in order, so it reads each block's K and V as two contiguous stretches of memory; it
 * folds each (block, KV head) into the running max, sum of exp and accumulator of that head's
 * G = H / NKV query heads (online softmax), so K and V are read once, side by side. While on
 * a block it prefetches the next one into L2 (on an item's last block, the first block of the
 * item its thread takes next: threads claim items from a shared counter one ahead), so memory
 * stays busy while the arithmetic runs. The arithmetic is inlined with D = 64 and D = 128 as
 * constants; other head sizes use the same code with D at run time.
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

INLINE float f32_id(float x) { return x; }

/* Work items: (sequence, run of whole blocks). A sequence is split into runs only when there
 * are too few sequences to keep every thread busy (flash-decoding), and then each run leaves a
 * partial result per KV head (max, sum of exp, unnormalized accumulator per query head) that
 * a second pass merges. */
typedef struct {
    int64_t chunks;        /* runs per sequence */
    int64_t chunk_blocks;  /* blocks per run */
} Split;

static Split plan_split(int64_t seqs, int64_t max_len, int64_t BS, int nt) {
    Split sp = {1, (max_len + BS - 1) / BS};
    const int64_t blocks = sp.chunk_blocks;
    if (seqs >= 2 * nt || blocks < 2) return sp;
    int64_t want = (2 * nt + seqs - 1) / seqs;         /* runs per sequence for ~2 per thread */
    if (want > blocks) want = blocks;
    sp.chunk_blocks = (blocks + want - 1) / want;
    sp.chunks = (blocks + sp.chunk_blocks - 1) / sp.chunk_blocks;
    return sp;
}

/* Per thread: scores [G * BS] and q [H * D] (floats, each part a 16-float multiple). */
static float *alloc_scratch(int64_t G, int64_t BS, int64_t H, int64_t D, int nt,
                            size_t *scores_n, size_t *qf_n) {
    size_t s, f, per, total;
    if (__builtin_mul_overflow((size_t)G, (size_t)BS, &s) ||
        __builtin_mul_overflow((size_t)H, (size_t)D, &f) ||
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

/* The partial result of one (sequence, KV head, run): m[G], l[G], acc[G * D]. */
INLINE size_t partial_floats(int64_t G, int64_t D) { return (size_t)(G * (D + 2)); }

/* partial_floats(G, D) * count floats, or NULL if that overflows or cannot be had. */
static float *alloc_parts(int64_t G, int64_t D, int64_t count) {
    size_t n;
    if (__builtin_mul_overflow(partial_floats(G, D), (size_t)count, &n) ||
        __builtin_mul_overflow(n, sizeof(float), &n))
        return NULL;
    return malloc(n ? n : 1);
}

#if VEC_QK && defined(__AVX512BF16__)
#define DP_BF16 1
/* scores[g * rows + r] = scale (q_g . k_r) for `rows` contiguous rows k_r of D, with AVX-512
 * BF16 dot products (32 products of q and k, both bfloat16 as stored, per instruction, summed
 * in float32), 16 rows at a time. D % 32 == 0. */
INLINE void scores_dpbf16(const uint16_t *q, float scale, const uint16_t *k, int64_t rows,
                          int64_t G, int64_t D, float *scores) {
    const __m512 vs = _mm512_set1_ps(scale);
    for (int64_t r0 = 0; r0 < rows; r0 += 16) {
        const int64_t nr = rows - r0 < 16 ? rows - r0 : 16;
        for (int64_t g = 0; g < G; ++g) {
            const uint16_t *qg = q + g * D;
            __m512 part[16];
            for (int64_t r = 0; r < 16; ++r) {
                __m512 a = _mm512_setzero_ps();
                if (r < nr)
                    for (int64_t c = 0; c < D; c += 32)
                        a = _mm512_dpbf16_ps(a, (__m512bh)_mm512_loadu_si512(qg + c),
                                             (__m512bh)_mm512_loadu_si512(k + (r0 + r) * D + c));
                part[r] = a;
            }
            _mm512_mask_storeu_ps(scores + g * rows + r0, (__mmask16)((1u << nr) - 1u),
                                  _mm512_mul_ps(hsum16(part), vs));
        }
    }
}
#else
#define DP_BF16 0
INLINE void scores_dpbf16(const uint16_t *q, float scale, const uint16_t *k, int64_t rows,
                          int64_t G, int64_t D, float *scores) {
    (void)q; (void)scale; (void)k; (void)rows; (void)G; (void)D; (void)scores;
}
#endif

#if VEC_QK
/* acc[d] += sum over r of p[r] v_r[d] for `rows` contiguous bfloat16 rows v_r of D (D % 32 ==
 * 0). A 64-byte load of 32 features splits into its even features (a shift) and its odd ones
 * (a mask) as float32: two instructions for 32 features where widening loads take four. The
 * accumulators keep even and odd features apart (even and odd rows apart too, for more
 * independent sums) and are interleaved back into acc once at the end. */
INLINE void pv_bf16_split(const float *p, const uint16_t *v, int64_t rows, int64_t D,
                          float *acc) {
    const __m512i even = _mm512_setr_epi32(0, 2, 4, 6, 8, 10, 12, 14, 16, 18, 20, 22, 24, 26,
                                           28, 30);
    const __m512i odd = _mm512_add_epi32(even, _mm512_set1_epi32(1));
    const __m512i lo = _mm512_setr_epi32(0, 16, 1, 17, 2, 18, 3, 19, 4, 20, 5, 21, 6, 22, 7,
                                         23);
    const __m512i hi = _mm512_add_epi32(lo, _mm512_set1_epi32(8));
    const __m512i top = _mm512_set1_epi32((int)0xffff0000u);
#define EVEN_F32(w) _mm512_castsi512_ps(_mm512_slli_epi32((w), 16))
#define ODD_F32(w) _mm512_castsi512_ps(_mm512_and_si512((w), top))
    for (int64_t c = 0; c < D; c += 32) {
        const __m512 x0 = _mm512_loadu_ps(acc + c), x1 = _mm512_loadu_ps(acc + c + 16);
        __m512 ev = _mm512_permutex2var_ps(x0, even, x1), od = _mm512_permutex2var_ps(x0, odd, x1);
        __m512 ev2 = _mm512_setzero_ps(), od2 = _mm512_setzero_ps();
        int64_t r = 0;
        for (; r + 2 <= rows; r += 2) {
            const __m512i w0 = _mm512_loadu_si512(v + r * D + c);
            const __m512i w1 = _mm512_loadu_si512(v + (r + 1) * D + c);
            const __m512 p0 = _mm512_set1_ps(p[r]), p1 = _mm512_set1_ps(p[r + 1]);
            ev = _mm512_fmadd_ps(p0, EVEN_F32(w0), ev);
            od = _mm512_fmadd_ps(p0, ODD_F32(w0), od);
            ev2 = _mm512_fmadd_ps(p1, EVEN_F32(w1), ev2);
            od2 = _mm512_fmadd_ps(p1, ODD_F32(w1), od2);
        }
        if (r < rows) {
            const __m512i w0 = _mm512_loadu_si512(v + r * D + c);
            const __m512 p0 = _mm512_set1_ps(p[r]);
            ev = _mm512_fmadd_ps(p0, EVEN_F32(w0), ev);
            od = _mm512_fmadd_ps(p0, ODD_F32(w0), od);
        }
        ev = _mm512_add_ps(ev, ev2);
        od = _mm512_add_ps(od, od2);
        _mm512_storeu_ps(acc + c, _mm512_permutex2var_ps(ev, lo, od));
        _mm512_storeu_ps(acc + c + 16, _mm512_permutex2var_ps(ev, hi, od));
    }
#undef EVEN_F32
#undef ODD_F32
}
#define PV_BF16_SPLIT 1
#else
#define PV_BF16_SPLIT 0
INLINE void pv_bf16_split(const float *p, const uint16_t *v, int64_t rows, int64_t D,
                          float *acc) {
    (void)p; (void)v; (void)rows; (void)D; (void)acc;
}
#endif

#if VEC_QK
#define DEFINE_ROWS(NAME, T, VLOAD)                                                            \
/* scores[g * rows + r] = qf_g . k_r (qf already scaled), 16 rows at a time. D % 16 == 0. */   \
INLINE void NAME##_scores16(const float *qf, const T *k, int64_t rows, int64_t G, int64_t D,  \
                            float *scores) {                                                   \
    for (int64_t r0 = 0; r0 < rows; r0 += 16) {                                                \
        const int64_t nr = rows - r0 < 16 ? rows - r0 : 16;                                    \
        for (int64_t g = 0; g < G; ++g) {                                                      \
            const float *qg = qf + g * D;                                                      \
            __m512 part[16];                                                                   \
            for (int64_t r = 0; r < 16; ++r) {                                                 \
                __m512 a = _mm512_setzero_ps();                                                \
                if (r < nr)                                                                    \
                    for (int64_t c = 0; c < D; c += 16)                                        \
                        a = _mm512_fmadd_ps(_mm512_loadu_ps(qg + c),                           \
                                            VLOAD(k + (r0 + r) * D + c), a);                   \
                part[r] = a;                                                                   \
            }                                                                                  \
            _mm512_mask_storeu_ps(scores + g * rows + r0, (__mmask16)((1u << nr) - 1u),       \
                                  hsum16(part));                                               \
        }                                                                                      \
    }                                                                                          \
}                                                                                              \
/* acc[d] += sum over r of p[r] v_r[d] for `rows` contiguous rows v_r of D (D % 16 == 0):      \
 * 64 features at a time in registers, even and odd rows in separate accumulators. */          \
INLINE void NAME##_pv(const float *p, const T *v, int64_t rows, int64_t D, float *acc) {      \
    int64_t c = 0;                                                                             \
    for (; c + 64 <= D; c += 64) {                                                             \
        __m512 a[4], e[4];                                                                     \
        for (int i = 0; i < 4; ++i) { a[i] = _mm512_loadu_ps(acc + c + 16 * i);               \
                                      e[i] = _mm512_setzero_ps(); }                            \
        int64_t r = 0;                                                                         \
        for (; r + 2 <= rows; r += 2) {                                                        \
            const __m512 p0 = _mm512_set1_ps(p[r]), p1 = _mm512_set1_ps(p[r + 1]);            \
            const T *v0 = v + r * D + c, *v1 = v0 + D;                                         \
            for (int i = 0; i < 4; ++i) {                                                      \
                a[i] = _mm512_fmadd_ps(p0, VLOAD(v0 + 16 * i), a[i]);                          \
                e[i] = _mm512_fmadd_ps(p1, VLOAD(v1 + 16 * i), e[i]);                          \
            }                                                                                  \
        }                                                                                      \
        if (r < rows) {                                                                        \
            const __m512 p0 = _mm512_set1_ps(p[r]);                                            \
            for (int i = 0; i < 4; ++i)                                                        \
                a[i] = _mm512_fmadd_ps(p0, VLOAD(v + r * D + c + 16 * i), a[i]);               \
        }                                                                                      \
        for (int i = 0; i < 4; ++i) _mm512_storeu_ps(acc + c + 16 * i, _mm512_add_ps(a[i], e[i])); \
    }                                                                                          \
    for (; c < D; c += 16) {                                                                   \
        __m512 a = _mm512_loadu_ps(acc + c);                                                   \
        for (int64_t r = 0; r < rows; ++r)                                                     \
            a = _mm512_fmadd_ps(_mm512_set1_ps(p[r]), VLOAD(v + r * D + c), a);                \
        _mm512_storeu_ps(acc + c, a);                                                          \
    }                                                                                          \
}
#else
#define DEFINE_ROWS(NAME, T, VLOAD)                                                            \
INLINE void NAME##_scores16(const float *qf, const T *k, int64_t rows, int64_t G, int64_t D,  \
                            float *scores) {                                                   \
    (void)qf; (void)k; (void)rows; (void)G; (void)D; (void)scores;                             \
}                                                                                              \
INLINE void NAME##_pv(const float *p, const T *v, int64_t rows, int64_t D, float *acc) {      \
    (void)p; (void)v; (void)rows; (void)D; (void)acc;                                          \
}
INLINE float max_of(const float *sg, int64_t n) { (void)sg; (void)n; return 0.f; }
INLINE float exp_shift_sum(float *sg, int64_t n, float mx) {
    (void)sg; (void)n; (void)mx; return 0.f;
}
#endif

#define DEFINE_DECODE(NAME, T, LOAD, STORE)                                                    \
/* Fold `rows` contiguous rows of one block of one KV head (k, v) into the running state of    \
 * its G query heads: m[g] the max score so far, l[g] the sum of exp(score - m[g]), acc[g * D]  \
 * the sum of exp(score - m[g]) v. */                                                          \
INLINE void NAME##_fold(const T *q, const float *qf, const T *k, const T *v, int64_t rows,    \
                        int64_t G, int64_t D, float scale, float *scores, float *m, float *l,   \
                        float *acc) {                                                          \
    const int vec = VEC_QK && D % 16 == 0;                                                     \
    if (DP_BF16 && sizeof(T) == 2 && D % 32 == 0)   /* bfloat16 dot products */              \
        scores_dpbf16((const uint16_t *)q, scale, (const uint16_t *)k, rows, G, D, scores);    \
    else if (vec)                                                                              \
        NAME##_scores16(qf, k, rows, G, D, scores);                                            \
    else                                                                                       \
        for (int64_t r = 0; r < rows; ++r)                                                     \
            for (int64_t g = 0; g < G; ++g) {                                                  \
                const float *qg = qf + g * D;                                                  \
                const T *kr = k + r * D;                                                       \
                float s = 0.f;                                                                 \
                _Pragma("omp simd reduction(+:s)")                                             \
                for (int64_t d = 0; d < D; ++d) s += qg[d] * LOAD(kr[d]);                      \
                scores[g * rows + r] = s;                                                      \
            }                                                                                  \
    for (int64_t g = 0; g < G; ++g) {                                                          \
        float *sg = scores + g * rows, *ag = acc + g * D, mx = sg[0];                          \
        if (VEC_QK) mx = max_of(sg, rows);                                                     \
        else for (int64_t r = 1; r < rows; ++r) mx = sg[r] > mx ? sg[r] : mx;                  \
        if (mx > m[g]) {   /* a new max: rescale what is summed so far (exp(-inf) = 0) */     \
            const float alpha = exp_nonpos(m[g] - mx);                                         \
            l[g] *= alpha;                                                                     \
            _Pragma("omp simd")                                                                \
            for (int64_t d = 0; d < D; ++d) ag[d] *= alpha;                                    \
            m[g] = mx;                                                                         \
        }                                                                                      \
        if (VEC_QK) {                                                                          \
            l[g] += exp_shift_sum(sg, rows, m[g]);                                             \
        } else {                                                                               \
            for (int64_t r = 0; r < rows; ++r) { sg[r] = exp_nonpos(sg[r] - m[g]); l[g] += sg[r]; } \
        }                                                                                      \
        if (PV_BF16_SPLIT && sizeof(T) == 2 && D % 32 == 0) {                                  \
            pv_bf16_split(sg, (const uint16_t *)v, rows, D, ag);                               \
        } else if (vec) {                                                                      \
            NAME##_pv(sg, v, rows, D, ag);                                                     \
        } else {                                                                               \
            for (int64_t r = 0; r < rows; ++r) {                                               \
                const float pr = sg[r];                                                        \
                const T *vr = v + r * D;                                                       \
                _Pragma("omp simd")                                                            \
                for (int64_t d = 0; d < D; ++d) ag[d] += pr * LOAD(vr[d]);                     \
            }                                                                                  \
        }                                                                                      \
    }                                                                                          \
}                                                                                              \
                                                                                               \
/* One work item: run c of sequence b, every KV head, into the partials of (b, kvh, c).         \
 * pf_next: the block to prefetch after this item's last (-1: none), pf_next_rows its rows. */ \
INLINE void NAME##_run(const T *q, const T *kv, const T *vbase, const int32_t *table,         \
                       int64_t t0, int64_t t1, int64_t H, int64_t NKV, int64_t D, int64_t BS,  \
                       float scale, int64_t pf_next, int64_t pf_next_rows, float *scores,      \
                       float *qf, float *part0, size_t kvh_stride) {                           \
    const int64_t G = H / NKV, head_stride = BS * D, block_stride = NKV * head_stride;         \
    if (!(DP_BF16 && sizeof(T) == 2 && D % 32 == 0))                                           \
        for (int64_t i = 0; i < H * D; ++i) qf[i] = LOAD(q[i]) * scale;                        \
    for (int64_t j = t0 / BS; j * BS < t1; ++j) {                                              \
        const int64_t rows = t1 - j * BS < BS ? t1 - j * BS : BS;                              \
        const int64_t blk = table[j];                                                          \
        const int last = (j + 1) * BS >= t1;                                                   \
        const int64_t pf = last ? pf_next : table[j + 1];                                      \
        const int64_t pf_rows = last ? pf_next_rows                                            \
                                     : (t1 - (j + 1) * BS < BS ? t1 - (j + 1) * BS : BS);      \
        for (int64_t kvh = 0; kvh < NKV; ++kvh) {                                              \
            const int64_t off = kvh * head_stride;                                             \
            if (pf >= 0) {                                                                     \
                prefetch_bytes_l2(kv + pf * block_stride + off, pf_rows * D * (int64_t)sizeof(T)); \
                prefetch_bytes_l2(vbase + pf * block_stride + off,                             \
                                  pf_rows * D * (int64_t)sizeof(T));                           \
            }                                                                                  \
            float *part = part0 + (size_t)kvh * kvh_stride;                                    \
            NAME##_fold(q + kvh * G * D, qf + kvh * G * D, kv + blk * block_stride + off,       \
                        vbase + blk * block_stride + off, rows, G, D, scale, scores, part,      \
                        part + G, part + 2 * G);                                               \
        }                                                                                      \
    }                                                                                          \
}                                                                                              \
                                                                                               \
INLINE void NAME##_run_d(const T *q, const T *kv, const T *vbase, const int32_t *table,       \
                         int64_t t0, int64_t t1, int64_t H, int64_t NKV, int64_t D, int64_t BS, \
                         float scale, int64_t pf_next, int64_t pf_next_rows, float *scores,    \
                         float *qf, float *part0, size_t kvh_stride) {                         \
    if (D == 64)                                                                               \
        NAME##_run(q, kv, vbase, table, t0, t1, H, NKV, 64, BS, scale, pf_next, pf_next_rows, \
                   scores, qf, part0, kvh_stride);                                             \
    else if (D == 128)                                                                         \
        NAME##_run(q, kv, vbase, table, t0, t1, H, NKV, 128, BS, scale, pf_next, pf_next_rows, \
                   scores, qf, part0, kvh_stride);                                             \
    else                                                                                       \
        NAME##_run(q, kv, vbase, table, t0, t1, H, NKV, D, BS, scale, pf_next, pf_next_rows,  \
                   scores, qf, part0, kvh_stride);                                             \
}                                                                                              \
                                                                                               \
int NAME(const T *q, const T *kv, const int32_t *block_tables, int64_t bt_stride,             \
         int64_t bt_cols, const int32_t *seq_lens, T *out, int64_t B, int64_t H, int64_t NKV,  \
         int64_t D, int64_t BS, int64_t NB, float scale, int64_t *info) {                      \
    int64_t max_len = 0;                                                                       \
    const int rc = check_inputs(block_tables, bt_stride, bt_cols, seq_lens, B, H, NKV, D, BS,  \
                                NB, info, &max_len);                                           \
    if (rc != PD_OK || B == 0) return rc;                                                      \
    const int64_t G = H / NKV, pairs = B * NKV;                                                \
    const T *vbase = kv + NB * NKV * BS * D;                                                   \
    const int nt = omp_get_max_threads() > 0 ? omp_get_max_threads() : 1;                      \
    const Split sp = plan_split(B, max_len, BS, nt);                                           \
    const int64_t items = B * sp.chunks;                                                       \
    /* scratch for every thread and every partial result, taken before the parallel region: \
     * a failed allocation returns here, never inside the OpenMP team */                      \
    size_t scores_n, qf_n;                                                                     \
    float *scratch = alloc_scratch(G, BS, H, D, nt, &scores_n, &qf_n);                         \
    float *parts = scratch ? alloc_parts(G, D, pairs * sp.chunks) : NULL;                      \
    if (!scratch || !parts) { free(scratch); free(parts); return PD_ERR_ALLOC; }               \
    const size_t per_thread = scores_n + qf_n, per_part = partial_floats(G, D);                \
    int64_t next_item = 0;   /* items are claimed in order from this counter, one ahead */    \
    _Pragma("omp parallel num_threads(nt)")                                                    \
    {                                                                                          \
        float *scores = scratch + (size_t)omp_get_thread_num() * per_thread;                   \
        float *qf = scores + scores_n;                                                         \
        int64_t item = __atomic_fetch_add(&next_item, 1, __ATOMIC_RELAXED);                    \
        while (item < items) {                                                                 \
            const int64_t following = __atomic_fetch_add(&next_item, 1, __ATOMIC_RELAXED);     \
            const int64_t b = item / sp.chunks, c = item % sp.chunks, L = seq_lens[b];         \
            const int64_t t0 = c * sp.chunk_blocks * BS;                                       \
            const int64_t t1 = t0 + sp.chunk_blocks * BS < L ? t0 + sp.chunk_blocks * BS : L;  \
            float *part0 = parts + (size_t)(b * NKV * sp.chunks + c) * per_part;               \
            const size_t kvh_stride = (size_t)sp.chunks * per_part;                            \
            for (int64_t kvh = 0; kvh < NKV; ++kvh) {  /* empty: m = -inf, l = 0, acc = 0 */   \
                float *part = part0 + (size_t)kvh * kvh_stride;                                \
                for (int64_t g = 0; g < G; ++g) part[g] = -INFINITY;                           \
                memset(part + G, 0, sizeof(float) * (size_t)(G * (D + 1)));                    \
            }                                                                                  \
            int64_t pf_next = -1, pf_next_rows = 0;                                            \
            if (following < items) {                                                           \
                const int64_t b2 = following / sp.chunks, c2 = following % sp.chunks;         \
                const int64_t s0 = c2 * sp.chunk_blocks * BS, L2 = seq_lens[b2];               \
                if (s0 < L2) {                                                                 \
                    pf_next = block_tables[b2 * bt_stride + s0 / BS];                          \
                    pf_next_rows = L2 - s0 < BS ? L2 - s0 : BS;                                \
                }                                                                              \
            }                                                                                  \
            if (t0 < t1)                                                                       \
                NAME##_run_d(q + b * H * D, kv, vbase, block_tables + b * bt_stride, t0, t1,   \
                             H, NKV, D, BS, scale, pf_next, pf_next_rows, scores, qf, part0,   \
                             kvh_stride);                                                      \
            item = following;                                                                  \
        }                                                                                      \
        _Pragma("omp barrier")   /* every partial is written */                                \
        /* merge each (sequence, KV head)'s runs */                                            \
        _Pragma("omp for schedule(static)")                                                    \
        for (int64_t pair = 0; pair < pairs; ++pair) {                                         \
            const int64_t b = pair / NKV, kvh = pair % NKV;                                    \
            T *op = out + (b * H + kvh * G) * D;                                               \
            const float *first = parts + (size_t)(pair * sp.chunks) * per_part;                \
            for (int64_t g = 0; g < G; ++g) {                                                  \
                float mx = -INFINITY;                                                          \
                for (int64_t c = 0; c < sp.chunks; ++c) {                                      \
                    const float *pc = first + (size_t)c * per_part;                            \
                    if (pc[g] > mx) mx = pc[g];                                                \
                }                                                                              \
                float *o = qf;   /* this thread's scratch: the merged accumulator */           \
                float sum = 0.f;                                                               \
                for (int64_t d = 0; d < D; ++d) o[d] = 0.f;                                    \
                for (int64_t c = 0; c < sp.chunks && mx != -INFINITY; ++c) {                   \
                    const float *pc = first + (size_t)c * per_part;                            \
                    if (pc[g] == -INFINITY) continue;   /* a run with nothing in it */         \
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
DEFINE_ROWS(paged_decode_f32, float, vload_f32)
DEFINE_ROWS(paged_decode_bf16, uint16_t, vload_bf16)
#else
DEFINE_ROWS(paged_decode_f32, float, (void))
DEFINE_ROWS(paged_decode_bf16, uint16_t, (void))
#endif
DEFINE_DECODE(paged_decode_f32, float, f32_id, f32_id)
DEFINE_DECODE(paged_decode_bf16, uint16_t, bf16_to_f32, f32_to_bf16)
