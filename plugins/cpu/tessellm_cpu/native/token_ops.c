/* Small per-token kernels for the tessellm CPU plugin, where torch's per-op overhead (tens of
 * microseconds for a handful of tiny ops) costs more than the arithmetic:
 *
 * rotary_*: half-split (NeoX / HF) rotary embedding of q [T, HQ * D] and k [T, HK * D] (rows
 *   of any stride, heads contiguous) into new contiguous outputs; cos_sin [P, D] float32, cos
 *   in the first half, sin in the second; cos and sin are rounded to the activation dtype
 *   first, as the reference does, then the math runs in float32 and rounds once.
 * rms_norm_*: y = weight * round(x * rsqrt(mean(x^2) + eps)) per row of H, optionally after
 *   x = round(x + residual) (written to `summed`): the reference's rounding points.
 * silu_and_mul_*: silu of the first half of each row times the second half (below).
 * write_kv_*: each token's K and V rows [HK * D] (rows of any stride) to its slot of a
 *   contiguous cache [2, NB, HK, BS, D]; slot < 0 is a padding token (skipped); tokens over
 *   the threads once a step is large (its slots are distinct).
 * rms_norm_*, rotary_*, silu_and_mul_*: AVX-512 intrinsics where the compiler targets it
 *   (16 lanes, tails masked), loops the compiler vectorizes elsewhere; the same rounding
 *   points either way.
 * greedy_*: the greedy token of each row of logits [T, V] (rows of any stride): the index of
 *   the first NaN if the row has one, else of the first occurrence of its largest value
 *   (torch.argmax's order; -0.0 and 0.0 are equal). One pass for the maximum, one for its
 *   first index (the row is in cache by then).
 *
 * apply_token_bitmask_*: in place, every token whose bit is 0 in its row's bitmask [T, W]
 *   (int32 words, W = ceil(V / 32), bit t % 32 of word t // 32) gets -inf; bits past V are
 *   ignored. A word of all ones (the common case) is skipped without touching its 32 logits;
 *   otherwise AVX-512 stores -inf under the two 16-bit halves of the inverted word.
 *
 * Every index is checked before use; the functions return 0, or a nonzero code naming the
 * problem (no write happens then). bf16 is stored as uint16 (round to nearest even).
 */
#include <stdint.h>
#include <math.h>
#include <string.h>
#include <omp.h>

#include "team.h"
#include "vec_math.h"

enum { RK_OK = 0, RK_ERR_POSITION = 1, RK_ERR_SLOT = 2, RK_ERR_SHAPE = 3 };

static inline float bf16_to_f32(uint16_t h) {
    uint32_t u = (uint32_t)h << 16;
    float f;
    memcpy(&f, &u, 4);
    return f;
}

/* Round to nearest even; NaN stays NaN (quieted). Branch-free, so loops over it vectorize. */
static inline uint16_t f32_to_bf16(float f) {
    uint32_t u;
    memcpy(&u, &f, 4);
    const uint32_t is_nan = ((u & 0x7f800000u) == 0x7f800000u) & ((u & 0x7fffffu) != 0u);
    const uint32_t rounded = (u + 0x7fffu + ((u >> 16) & 1u)) >> 16;
    return (uint16_t)(is_nan ? ((u >> 16) | 0x40u) : rounded);
}

/* Rows of work below this many elements run on one thread (a team costs more than them). */
#define PARALLEL_MIN 16384

static int check_positions(const int64_t *pos, int64_t T, int64_t P) {
    for (int64_t t = 0; t < T; t++)
        if (pos[t] < 0 || pos[t] >= P) return RK_ERR_POSITION;
    return RK_OK;
}

#define ID(x) (x)
#define BF16_ROUND(x) bf16_to_f32(f32_to_bf16(x))

/* elem: bytes per element (4 or 2: the cache has the activations' dtype) */
typedef struct {
    const uint8_t *k;
    int64_t k_stride;
    const uint8_t *v;
    int64_t v_stride;
    const int64_t *slots;
    int64_t T;
    uint8_t *cache;
    int64_t NB, HK, BS, D, elem;
} WriteKVArgs;

int write_kv_team(const WriteKVArgs *a) {
    if (a->elem != 2 && a->elem != 4) return RK_ERR_SHAPE;
    const int64_t T = a->T, BS = a->BS, HK = a->HK;
    for (int64_t t = 0; t < T; t++)
        if (a->slots[t] >= a->NB * BS) return RK_ERR_SLOT;
    const int64_t row = a->D * a->elem, half = a->NB * HK * BS * a->D * a->elem;
    /* a step's tokens own distinct slots, so threads never write the same row */
#pragma omp for schedule(static) nowait
    for (int64_t t = 0; t < T; t++) {
        const int64_t s = a->slots[t];
        if (s < 0) continue;
        const int64_t blk = s / BS, off = s % BS;
        for (int64_t h = 0; h < HK; h++) {
            const int64_t dst = ((blk * HK + h) * BS + off) * row;
            memcpy(a->cache + dst, a->k + t * a->k_stride * a->elem + h * row, (size_t)row);
            memcpy(a->cache + half + dst, a->v + t * a->v_stride * a->elem + h * row,
                   (size_t)row);
        }
    }
    return RK_OK;
}

int write_kv_run(const WriteKVArgs *a) {
    return team_run((TeamKernel)write_kv_team, a, team_threads(),
                    a->T * a->HK * a->D < PARALLEL_MIN);
}

/* select_rows: out[r] = x[index[r]] for R rows of `row_bytes` (x rows `x_stride` bytes apart,
 * N of them; out contiguous). An index outside [0, N) is RK_ERR_POSITION (nothing written). */
typedef struct {
    const uint8_t *x;
    int64_t x_stride, N;
    const int64_t *index;
    int64_t R, row_bytes;
    uint8_t *out;
} SelectRowsArgs;

int select_rows_team(const SelectRowsArgs *a) {
    for (int64_t r = 0; r < a->R; r++)
        if (a->index[r] < 0 || a->index[r] >= a->N) return RK_ERR_POSITION;
#pragma omp for schedule(static) nowait
    for (int64_t r = 0; r < a->R; r++)
        memcpy(a->out + r * a->row_bytes, a->x + a->index[r] * a->x_stride, (size_t)a->row_bytes);
    return RK_OK;
}

int select_rows_run(const SelectRowsArgs *a) {
    return team_run((TeamKernel)select_rows_team, a, team_threads(),
                    a->R * a->row_bytes < 4 * PARALLEL_MIN);
}

/* silu_and_mul_*: y[t, j] = round(silu(x[t, j])) * x[t, F + j] for rows of 2F (rows of any
 * stride), rounded once more: the reference's two rounding points (silu in float32 math). */
#ifdef __AVX512F__
static inline __m512 vload_f32(const float *p, __mmask16 k) { return _mm512_maskz_loadu_ps(k, p); }
static inline __m512 vload_bf16(const uint16_t *p, __mmask16 k) {
    return _mm512_castsi512_ps(_mm512_slli_epi32(
        _mm512_cvtepu16_epi32(_mm256_maskz_loadu_epi16(k, p)), 16));
}
static inline void vstore_f32(float *p, __mmask16 k, __m512 v) { _mm512_mask_storeu_ps(p, k, v); }
/* round to nearest even on 16 lanes, NaN quieted (f32_to_bf16's rule); one instruction where
 * the CPU has AVX-512 BF16 (which also flushes denormal results to zero) */
#ifdef __AVX512BF16__
static inline __m256i bf16_bits16(__m512 v) { return (__m256i)_mm512_cvtneps_pbh(v); }
#else
static inline __m256i bf16_bits16(__m512 v) {
    const __m512i u = _mm512_castps_si512(v);
    const __m512i rounded = _mm512_srli_epi32(_mm512_add_epi32(_mm512_add_epi32(
        u, _mm512_set1_epi32(0x7fff)), _mm512_and_si512(_mm512_srli_epi32(u, 16),
                                                         _mm512_set1_epi32(1))), 16);
    const __mmask16 nan = _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q);
    const __m512i q = _mm512_or_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(0x40));
    return _mm512_cvtepi32_epi16(_mm512_mask_blend_epi32(nan, rounded, q));
}
#endif
static inline void vstore_bf16(uint16_t *p, __mmask16 k, __m512 v) {
    _mm256_mask_storeu_epi16(p, k, bf16_bits16(v));
}
static inline __m512 vround_f32(__m512 v) { return v; }
static inline __m512 vround_bf16(__m512 v) {
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(bf16_bits16(v)), 16));
}
#define SILU_BODY(VLOAD, VSTORE, VROUND)                                                     \
        for (int64_t j = 0; j < F; j += 16) {                                                \
            const __mmask16 k = F - j >= 16 ? (__mmask16)0xffff                               \
                                            : (__mmask16)((1u << (F - j)) - 1u);             \
            const __m512 s = VROUND(silu16(VLOAD(a + j, k)));                                \
            VSTORE(y + j, k, VROUND(_mm512_mul_ps(s, VLOAD(b + j, k))));                     \
        }
#define SILU_VEC(SUFFIX, LOAD, STORE, ROUND) \
    SILU_BODY(vload_##SUFFIX, vstore_##SUFFIX, vround_##SUFFIX)
#else
#define SILU_VEC(SUFFIX, LOAD, STORE, ROUND)                                                 \
        for (int64_t j = 0; j < F; j++) {                                                    \
            const float v = LOAD(a[j]);                                                      \
            const float e = exp_nonpos(v < 0.f ? v : -v);   /* exp(-|v|) */                  \
            const float sig = v < 0.f ? e / (1.f + e) : 1.f / (1.f + e);                     \
            y[j] = STORE(ROUND(v * sig) * LOAD(b[j]));                                       \
        }
#endif

/* rotary_*: per head, the rotated halves 16 lanes at a time with AVX-512 (cos and sin rounded
 * to the activation dtype first, products rounded one by one as the scalar code rounds them);
 * else loops the compiler vectorizes. */
#ifdef __AVX512F__
#define ROT_HEAD(TYPE, LOAD, STORE, ROUND, SUFFIX)                                           \
                for (int64_t j = 0; j < half; j += 16) {                                     \
                    const __mmask16 m = half - j >= 16 ? (__mmask16)0xffff                    \
                                                       : (__mmask16)((1u << (half - j)) - 1u); \
                    const __m512 c = vround_##SUFFIX(_mm512_maskz_loadu_ps(m, cs + j));      \
                    const __m512 s = vround_##SUFFIX(_mm512_maskz_loadu_ps(m, cs + half + j)); \
                    const __m512 x1 = vload_##SUFFIX(x + j, m);                              \
                    const __m512 x2 = vload_##SUFFIX(x + half + j, m);                       \
                    vstore_##SUFFIX(y + j, m, _mm512_sub_ps(_mm512_mul_ps(x1, c),            \
                                                            _mm512_mul_ps(x2, s)));          \
                    vstore_##SUFFIX(y + half + j, m, _mm512_add_ps(_mm512_mul_ps(x2, c),     \
                                                                   _mm512_mul_ps(x1, s)));   \
                }
#else
#define ROT_HEAD(TYPE, LOAD, STORE, ROUND, SUFFIX)                                           \
                _Pragma("omp simd")                                                          \
                for (int64_t j = 0; j < half; j++) {                                         \
                    const float c = ROUND(cs[j]), s = ROUND(cs[half + j]);                   \
                    const float x1 = LOAD(x[j]), x2 = LOAD(x[half + j]);                     \
                    y[j] = STORE(x1 * c - x2 * s);                                           \
                    y[half + j] = STORE(x2 * c + x1 * s);                                    \
                }
#endif

typedef struct {
    const int64_t *pos;
    int64_t T;
    const void *q;
    int64_t q_stride, HQ;
    const void *k;
    int64_t k_stride, HK;
    const float *cos_sin;
    int64_t P, D;
    void *q_out, *k_out;
} RotaryArgs;

#define ROTARY(NAME, TYPE, LOAD, STORE, ROUND, SUFFIX)                                       \
int NAME##_team(const RotaryArgs *a) {                                                        \
    const int64_t T = a->T, D = a->D, HQ = a->HQ, HK = a->HK;                                 \
    if (D <= 0 || D % 2) return RK_ERR_SHAPE;                                                 \
    if (check_positions(a->pos, T, a->P)) return RK_ERR_POSITION;                             \
    const int64_t half = D / 2;                                                               \
    const TYPE *q = a->q, *k = a->k;                                                          \
    TYPE *q_out = a->q_out, *k_out = a->k_out;                                                \
    _Pragma("omp for schedule(static) nowait")                                                \
    for (int64_t t = 0; t < T; t++) {                                                         \
        const float *cs = a->cos_sin + a->pos[t] * D;                                         \
        for (int which = 0; which < 2; which++) {                                             \
            const TYPE *src = which ? k + t * a->k_stride : q + t * a->q_stride;              \
            TYPE *dst = which ? k_out + t * HK * D : q_out + t * HQ * D;                      \
            const int64_t heads = which ? HK : HQ;                                            \
            for (int64_t h = 0; h < heads; h++) {                                             \
                const TYPE *x = src + h * D;                                                  \
                TYPE *y = dst + h * D;                                                        \
                ROT_HEAD(TYPE, LOAD, STORE, ROUND, SUFFIX)                                    \
            }                                                                                 \
        }                                                                                     \
    }                                                                                         \
    return RK_OK;                                                                             \
}                                                                                             \
int NAME##_run(const RotaryArgs *a) {                                                         \
    return team_run((TeamKernel)NAME##_team, a, team_threads(),                               \
                    a->T * (a->HQ + a->HK) * a->D < PARALLEL_MIN);                            \
}

ROTARY(rotary_f32, float, ID, ID, ID, f32)
ROTARY(rotary_bf16, uint16_t, bf16_to_f32, f32_to_bf16, BF16_ROUND, bf16)

/* rms_norm_*: one row per iteration; with AVX-512 16 lanes at a time (the tail masked), the
 * sum of squares in 16 float32 partial sums; else loops the compiler vectorizes. */
#ifdef __AVX512F__
#define RMS_ROW(TYPE, LOAD, STORE, ROUND, SUFFIX)                                            \
        __m512 acc = _mm512_setzero_ps();                                                    \
        for (int64_t j = 0; j < H; j += 16) {                                                \
            const __mmask16 k = H - j >= 16 ? (__mmask16)0xffff                               \
                                            : (__mmask16)((1u << (H - j)) - 1u);             \
            __m512 v = vload_##SUFFIX(xr + j, k);                                            \
            if (res) {                                                                       \
                v = vround_##SUFFIX(_mm512_add_ps(v, vload_##SUFFIX(res + t * res_stride + j, \
                                                                    k)));                    \
                vstore_##SUFFIX(sr + j, k, v);                                               \
            }                                                                                \
            acc = _mm512_fmadd_ps(v, v, acc);                                                \
        }                                                                                    \
        const __m512 inv = _mm512_set1_ps(1.0f / sqrtf(_mm512_reduce_add_ps(acc) / (float)H  \
                                                       + eps));                              \
        TYPE *o = out + t * H;                                                               \
        const TYPE *src = res ? sr : xr;                                                     \
        for (int64_t j = 0; j < H; j += 16) {                                                \
            const __mmask16 k = H - j >= 16 ? (__mmask16)0xffff                               \
                                            : (__mmask16)((1u << (H - j)) - 1u);             \
            const __m512 n = vround_##SUFFIX(_mm512_mul_ps(vload_##SUFFIX(src + j, k), inv)); \
            vstore_##SUFFIX(o + j, k, _mm512_mul_ps(vload_##SUFFIX(w + j, k), n));           \
        }
#else
#define RMS_ROW(TYPE, LOAD, STORE, ROUND, SUFFIX)                                            \
        float ss = 0.f;                                                                      \
        if (res) {                                                                           \
            const TYPE *rr = res + t * res_stride;                                           \
            _Pragma("omp simd reduction(+:ss)")                                              \
            for (int64_t j = 0; j < H; j++) {                                                \
                const float v = ROUND(LOAD(xr[j]) + LOAD(rr[j]));                            \
                sr[j] = STORE(v);                                                            \
                ss += v * v;                                                                 \
            }                                                                                \
        } else {                                                                             \
            _Pragma("omp simd reduction(+:ss)")                                              \
            for (int64_t j = 0; j < H; j++) { const float v = LOAD(xr[j]); ss += v * v; }    \
        }                                                                                    \
        const float inv = 1.0f / sqrtf(ss / (float)H + eps);                                 \
        TYPE *o = out + t * H;                                                               \
        const TYPE *src = res ? sr : xr;                                                     \
        _Pragma("omp simd")                                                                  \
        for (int64_t j = 0; j < H; j++)                                                      \
            o[j] = STORE(LOAD(w[j]) * ROUND(LOAD(src[j]) * inv));
#endif

/* Row t of x starts at x + (t / rows_per_group) * group_stride + (t % rows_per_group) *
 * x_stride (elements): plain rows are one group (rows_per_group >= T); per-head norms read
 * [T, heads, D] views of a fused projection's output as T groups of `heads` rows. */
typedef struct {
    const void *x;
    int64_t x_stride;
    const void *res;
    int64_t res_stride;
    const void *w;
    int64_t T, H;
    float eps;
    void *out, *summed;
    int64_t rows_per_group, group_stride;
} RmsNormArgs;

#define RMS_NORM(NAME, TYPE, LOAD, STORE, ROUND, SUFFIX)                                     \
int NAME##_team(const RmsNormArgs *a) {                                                      \
    const int64_t T = a->T, H = a->H, x_stride = a->x_stride, res_stride = a->res_stride;    \
    const int64_t per_group = a->rows_per_group, group_stride = a->group_stride;             \
    if (H <= 0 || per_group <= 0) return RK_ERR_SHAPE;                                       \
    const TYPE *x = a->x, *res = a->res, *w = a->w;                                          \
    TYPE *out = a->out, *summed = a->summed;                                                 \
    const float eps = a->eps;                                                                \
    _Pragma("omp for schedule(static) nowait")                                               \
    for (int64_t t = 0; t < T; t++) {                                                        \
        const TYPE *xr = x + (t / per_group) * group_stride + (t % per_group) * x_stride;    \
        TYPE *sr = summed ? summed + t * H : 0;                                              \
        RMS_ROW(TYPE, LOAD, STORE, ROUND, SUFFIX)                                            \
    }                                                                                        \
    return RK_OK;                                                                            \
}                                                                                            \
int NAME##_run(const RmsNormArgs *a) {                                                       \
    return team_run((TeamKernel)NAME##_team, a, team_threads(), a->T * a->H < PARALLEL_MIN); \
}

RMS_NORM(rms_norm_f32, float, ID, ID, ID, f32)
RMS_NORM(rms_norm_bf16, uint16_t, bf16_to_f32, f32_to_bf16, BF16_ROUND, bf16)

typedef struct {
    const void *x;
    int64_t x_stride, T, F;
    void *out;
} SiluAndMulArgs;

#define SILU_AND_MUL(NAME, TYPE, LOAD, STORE, ROUND, SUFFIX)                                 \
int NAME##_team(const SiluAndMulArgs *args) {                                                   \
    const int64_t T = args->T, F = args->F;                                                        \
    if (F <= 0) return RK_ERR_SHAPE;                                                         \
    const TYPE *x = args->x;                                                                    \
    TYPE *out = args->out;                                                                      \
    _Pragma("omp for schedule(static) nowait")                                               \
    for (int64_t t = 0; t < T; t++) {                                                        \
        const TYPE *a = x + t * args->x_stride, *b = a + F;                                   \
        TYPE *y = out + t * F;                                                               \
        SILU_VEC(SUFFIX, LOAD, STORE, ROUND)                                                 \
    }                                                                                        \
    return RK_OK;                                                                            \
}                                                                                            \
int NAME##_run(const SiluAndMulArgs *a) {                                                    \
    return team_run((TeamKernel)NAME##_team, a, team_threads(), a->T * a->F < PARALLEL_MIN); \
}

SILU_AND_MUL(silu_and_mul_f32, float, ID, ID, ID, f32)
SILU_AND_MUL(silu_and_mul_bf16, uint16_t, bf16_to_f32, f32_to_bf16, BF16_ROUND, bf16)

/* greedy_*: see the header. `load16(p, n)` reads min(n, 16) values as float32, the lanes past
 * n set to -inf (they never win and never count as NaN). */
#ifdef __AVX512F__
static inline __m512 greedy_load_f32(const float *p, int64_t n) {
    const __mmask16 k = n >= 16 ? (__mmask16)0xffff : (__mmask16)((1u << n) - 1u);
    return _mm512_mask_loadu_ps(_mm512_set1_ps(-INFINITY), k, p);
}
static inline __m512 greedy_load_bf16(const uint16_t *p, int64_t n) {
    const __mmask16 k = n >= 16 ? (__mmask16)0xffff : (__mmask16)((1u << n) - 1u);
    const __m512 v = _mm512_castsi512_ps(_mm512_slli_epi32(
        _mm512_cvtepu16_epi32(_mm256_maskz_loadu_epi16(k, p)), 16));
    return _mm512_mask_blend_ps(k, _mm512_set1_ps(-INFINITY), v);
}
#define GREEDY_ROW(NAME, TYPE, LOAD16)                                                       \
static int64_t NAME(const TYPE *x, int64_t V) {                                              \
    __m512 mx = _mm512_set1_ps(-INFINITY);                                                   \
    __mmask16 nan = 0;                                                                       \
    for (int64_t j = 0; j < V; j += 16) {                                                    \
        const __m512 v = LOAD16(x + j, V - j);                                               \
        nan |= _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q);                                       \
        mx = _mm512_max_ps(v, mx);   /* a NaN lane of v keeps mx */                          \
    }                                                                                        \
    const float best = _mm512_reduce_max_ps(mx);                                             \
    for (int64_t j = 0; j < V; j += 16) {                                                    \
        const __m512 v = LOAD16(x + j, V - j);                                               \
        const __mmask16 hit = nan ? _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q)                   \
                                  : _mm512_cmp_ps_mask(v, _mm512_set1_ps(best), _CMP_EQ_OQ); \
        if (hit) return j + __builtin_ctz((unsigned)hit);                                    \
    }                                                                                        \
    return 0;   /* V > 0 and every lane compares equal to itself or is NaN: unreachable */  \
}
GREEDY_ROW(greedy_row_f32, float, greedy_load_f32)
GREEDY_ROW(greedy_row_bf16, uint16_t, greedy_load_bf16)
#else
#define GREEDY_ROW_SCALAR(NAME, TYPE, LOAD)                                                  \
static int64_t NAME(const TYPE *x, int64_t V) {                                              \
    int64_t arg = 0;                                                                         \
    float best = LOAD(x[0]);                                                                 \
    if (isnan(best)) return 0;                                                               \
    for (int64_t j = 1; j < V; j++) {                                                        \
        const float v = LOAD(x[j]);                                                          \
        if (isnan(v)) return j;                                                              \
        if (v > best) { best = v; arg = j; }                                                 \
    }                                                                                        \
    return arg;                                                                              \
}
GREEDY_ROW_SCALAR(greedy_row_f32, float, ID)
GREEDY_ROW_SCALAR(greedy_row_bf16, uint16_t, bf16_to_f32)
#endif

#define GREEDY(NAME, TYPE, ROW)                                                              \
int NAME(const TYPE *x, int64_t x_stride, int64_t T, int64_t V, int64_t *out) {             \
    if (V <= 0) return RK_ERR_SHAPE;                                                         \
    _Pragma("omp parallel for schedule(static) if (T > 1 && T * V >= PARALLEL_MIN)")         \
    for (int64_t t = 0; t < T; t++) out[t] = ROW(x + t * x_stride, V);                      \
    return RK_OK;                                                                            \
}
GREEDY(greedy_f32, float, greedy_row_f32)
GREEDY(greedy_bf16, uint16_t, greedy_row_bf16)

/* apply_token_bitmask_*: see the header. */
#ifdef __AVX512F__
static inline void bitmask_word_f32(float *x, uint32_t forbid, int64_t n) {
    const __m512 ninf = _mm512_set1_ps(-INFINITY);
    __mmask16 lo = (__mmask16)(forbid & 0xffffu), hi = (__mmask16)(forbid >> 16);
    if (n < 16) lo &= (__mmask16)((1u << n) - 1u);
    if (n < 32) hi &= n <= 16 ? (__mmask16)0 : (__mmask16)((1u << (n - 16)) - 1u);
    _mm512_mask_storeu_ps(x, lo, ninf);
    _mm512_mask_storeu_ps(x + 16, hi, ninf);
}
static inline void bitmask_word_bf16(uint16_t *x, uint32_t forbid, int64_t n) {
    if (n < 32) forbid &= (uint32_t)((1ull << n) - 1ull);
    _mm512_mask_storeu_epi16(x, (__mmask32)forbid, _mm512_set1_epi16((short)0xff80));
}
#else
static inline void bitmask_word_f32(float *x, uint32_t forbid, int64_t n) {
    for (int64_t b = 0; b < n && b < 32; b++) if (forbid >> b & 1u) x[b] = -INFINITY;
}
static inline void bitmask_word_bf16(uint16_t *x, uint32_t forbid, int64_t n) {
    for (int64_t b = 0; b < n && b < 32; b++) if (forbid >> b & 1u) x[b] = 0xff80u;
}
#endif

#define APPLY_BITMASK(NAME, TYPE, WORD)                                                      \
int NAME(TYPE *x, int64_t x_stride, const int32_t *mask, int64_t mask_stride, int64_t T,    \
         int64_t V) {                                                                        \
    if (V <= 0) return RK_ERR_SHAPE;                                                         \
    const int64_t W = (V + 31) / 32;                                                         \
    _Pragma("omp parallel for schedule(static) if (T > 1 && T * V >= PARALLEL_MIN)")         \
    for (int64_t t = 0; t < T; t++) {                                                        \
        TYPE *row = x + t * x_stride;                                                        \
        const int32_t *m = mask + t * mask_stride;                                           \
        for (int64_t w = 0; w < W; w++) {                                                    \
            const uint32_t forbid = ~(uint32_t)m[w];                                         \
            if (forbid) WORD(row + 32 * w, forbid, V - 32 * w);                              \
        }                                                                                    \
    }                                                                                        \
    return RK_OK;                                                                            \
}
APPLY_BITMASK(apply_token_bitmask_f32, float, bitmask_word_f32)
APPLY_BITMASK(apply_token_bitmask_bf16, uint16_t, bitmask_word_bf16)
