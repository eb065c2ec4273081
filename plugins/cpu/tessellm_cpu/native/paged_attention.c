/* Paged attention for the tessellm CPU plugin, K/V read in place through the block table (no
 * gather, no padding copies): decode (paged_decode_*: one query token per sequence) and, at
 * the end of the file, prefill (paged_prefill_*: every query token, causal, each run as the
 * decode of one token over its sequence's keys up to its position).
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
 * Sliding window (window > 0): a query at position p reads only the keys p - window + 1 .. p
 * (an item's range then starts inside a block); soft-cap (softcap > 0): each score s becomes
 * softcap * tanh(s / softcap) before the softmax, as the reference op does.
 * Math in float32 (scores, softmax, accumulation), like the reference op; bfloat16 output is
 * rounded to nearest even.
 *
 * Work items are (group, run of whole blocks). A group is one sequence, or the rows of one
 * sequence that speculative decoding verifies together (consecutive rows whose lengths rise by
 * one over the same block table, up to GROUP_MAX): its item reads each K/V block once and
 * folds it into each row's state as that row alone would (so a row's result does not depend
 * on its group; 5 verify rows of SmolLM2 at 900 keys: 7.5 -> 5.4 ms over 30 layers). A
 * group's context is split into runs only when there are fewer groups than twice the threads
 * (flash-decoding; the runs' partial results are merged after). An item walks its blocks in order and, inside each block, every
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
#include "team.h"
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

#include "decode_rows.h"
#include "prefill_tiles.h"

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
    PD_ERR_QUERY = 7,        /* prefill: query_start_loc does not rise from 0 to the rows of q,
                              * or a sequence has more query tokens than its length */
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

/* The partial result of one (sequence, KV head, run): m[G], l[G], acc[G * D]. */
INLINE size_t partial_floats(int64_t G, int64_t D) { return (size_t)(G * (D + 2)); }

/* The arguments of paged_decode_* (team.h). threads: the team size scratch is laid out for
 * (paged_decode_scratch); info: on an error, the sequence and column concerned. */
typedef struct {
    const void *q, *kv;
    const int32_t *block_tables;
    int64_t bt_stride, bt_cols;
    const int32_t *seq_lens;
    void *out;
    int64_t B, H, NKV, D, BS, NB;
    float scale;
    int threads;
    int64_t *info;
    void *scratch;
    int64_t window;   /* sliding window in keys, 0: none */
    float softcap;    /* logit soft-cap, 0: none */
} DecodeArgs;

/* Rows of one sequence verified together (speculative decoding): consecutive query rows b,
 * b + 1, .. whose lengths rise by one over the same block table are one group of at most
 * GROUP_MAX rows, and one work item reads each of the group's K/V blocks once for all its rows
 * (each row folds it as it would alone, from L1). */
#define GROUP_MAX 8

/* Scratch, in caller memory: the claim counter and the group count (a cache line), per thread
 * scores [G * BS] and q [GROUP_MAX * H * D] (each a 16-float multiple), the partial results of
 * every work item, then group_len [B] (the rows of the group a sequence leads, 0 if it does
 * not lead one). */
typedef struct {
    int64_t *next_item, *groups;
    float *threads, *parts;
    int32_t *group_len;
    size_t scores_n, qf_n;
} DecodeScratch;

/* Runs per sequence at most: plan_split takes ~2 per thread only below 2 * nt groups, and B
 * sequences make at least ceil(B / GROUP_MAX) groups. */
static int64_t max_chunks(int64_t B, int nt) {
    const int64_t groups = (B + GROUP_MAX - 1) / GROUP_MAX;
    return groups >= 2 * nt || B <= 0 ? 1 : (2 * nt + groups - 1) / groups;
}

/* parts: the floats of every work item's partial results (parts_floats). */
static DecodeScratch decode_scratch(int64_t G, int64_t BS, int64_t H, int64_t D, size_t parts,
                                    int nt, void *base) {
    DecodeScratch s;
    s.scores_n = ((size_t)(G * BS) + 15) & ~(size_t)15;
    s.qf_n = ((size_t)(GROUP_MAX * H * D) + 15) & ~(size_t)15;
    s.next_item = base;
    s.groups = s.next_item + 1;
    s.threads = (float *)((char *)base + 64);
    s.parts = s.threads + (s.scores_n + s.qf_n) * (size_t)nt;
    s.group_len = (int32_t *)(s.parts + parts);
    return s;
}

/* Floats of one thread's scores and q, or 0 when that overflows. */
static size_t per_thread_floats(int64_t G, int64_t BS, int64_t H, int64_t D) {
    size_t s, f, per;
    if (__builtin_mul_overflow((size_t)G, (size_t)BS, &s) ||
        __builtin_mul_overflow((size_t)H * GROUP_MAX, (size_t)D, &f) ||
        __builtin_add_overflow(s, (size_t)15, &s) || __builtin_add_overflow(f, (size_t)15, &f) ||
        __builtin_add_overflow(s & ~(size_t)15, f & ~(size_t)15, &per))
        return 0;
    return per;
}

/* Floats of `count` partial results, or 0 when that overflows. */
static size_t parts_floats(int64_t G, int64_t D, int64_t count) {
    size_t p, n;
    if (__builtin_add_overflow((size_t)D, (size_t)2, &p) ||
        __builtin_mul_overflow(p, (size_t)G, &p) ||
        __builtin_mul_overflow(p, (size_t)count, &n))
        return 0;
    return n;
}

/* Bytes of scratch for a->threads threads, or -1 when that overflows. */
int64_t paged_decode_scratch(const DecodeArgs *a) {
    if (a->B <= 0 || a->H <= 0 || a->NKV <= 0 || a->D <= 0 || a->BS <= 0) return 64;
    const int64_t G = a->H / a->NKV;
    size_t t, total;
    const size_t per = per_thread_floats(G, a->BS, a->H, a->D);
    const size_t parts = parts_floats(G, a->D, a->B * a->NKV * max_chunks(a->B, a->threads));
    if (!per || !parts || __builtin_mul_overflow(per, (size_t)a->threads, &t) ||
        __builtin_add_overflow(t, parts, &total) ||
        __builtin_add_overflow(total, (size_t)a->B, &total) ||   /* group_len, 4 bytes each */
        __builtin_mul_overflow(total, sizeof(float), &total) || total > (size_t)INT64_MAX - 64)
        return -1;
    return (int64_t)total + 64;
}

/* group_len[b] for every sequence (GROUP_MAX): b + 1 continues b's group when its length is
 * b's plus one (b's non-empty) and its table holds b's blocks, without a window; returns the
 * number of groups. */
static int64_t find_groups(const int32_t *block_tables, int64_t bt_stride, const int32_t *seq_lens,
                           int64_t B, int64_t BS, int64_t window, int32_t *group_len) {
    int64_t groups = 0, lead = 0;
    for (int64_t b = 0; b < B; ++b) {
        const int64_t prev = b > 0 ? seq_lens[b - 1] : 0;
        const int continues = b > 0 && window == 0 && prev > 0 && seq_lens[b] == prev + 1 &&
                              b - lead < GROUP_MAX &&
                              memcmp(block_tables + b * bt_stride, block_tables + (b - 1) * bt_stride,
                                     sizeof(int32_t) * (size_t)((prev + BS - 1) / BS)) == 0;
        group_len[b] = 0;
        if (continues) {
            group_len[lead]++;
        } else {
            lead = b;
            group_len[b] = 1;
            groups++;
        }
    }
    return groups;
}

#define DEFINE_DECODE(NAME, T, LOAD, STORE)                                                    \
/* Fold `rows` contiguous rows of one block of one KV head (k, v) into the running state of    \
 * its G query heads: m[g] the max score so far, l[g] the sum of exp(score - m[g]), acc[g * D]  \
 * the sum of exp(score - m[g]) v. */                                                          \
INLINE void NAME##_fold(const T *q, const float *qf, const T *k, const T *v, int64_t rows,    \
                        int64_t G, int64_t D, float scale, float softcap, float *scores,        \
                        float *m, float *l, float *acc) {                                      \
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
    if (softcap > 0.f) {   /* Gemma 2's soft-cap, before the max and the exp */               \
        const float inv_cap = 1.f / softcap;                                                   \
        for (int64_t i = 0; i < G * rows; ++i) scores[i] = softcap * tanhf(scores[i] * inv_cap); \
    }                                                                                          \
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
/* One work item: keys t0 .. t1 - 1 of the n rows of a group (n = 1: one sequence), every KV  \
 * head, into each row's partials (row i's at part0 + i row_stride, a KV head's kvh_stride      \
 * further). Row i's query is at q + i q_stride, its block table at table + i bt_stride, and it \
 * reads its keys below lens[i] only; each of its blocks is folded as it would be alone.        \
 * pf_next: the block to prefetch after this item's last (-1: none), pf_next_rows its rows. */ \
INLINE void NAME##_item(const T *q, int64_t q_stride, const T *kv, const T *vbase,            \
                       const int32_t *table, int64_t bt_stride, const int32_t *lens, int64_t n, \
                       int64_t t0, int64_t t1, int64_t H, int64_t NKV, int64_t D, int64_t BS,  \
                       float scale, float softcap, int64_t pf_next, int64_t pf_next_rows,      \
                       float *scores, float *qf, float *part0, size_t row_stride,              \
                       size_t kvh_stride) {                                                    \
    const int64_t G = H / NKV, head_stride = BS * D, block_stride = NKV * head_stride;         \
    const int32_t *last_table = table + (n - 1) * bt_stride;   /* the longest row's */         \
    if (!(DP_BF16 && sizeof(T) == 2 && D % 32 == 0))                                           \
        for (int64_t i = 0; i < n; ++i)                                                        \
            for (int64_t e = 0; e < H * D; ++e) qf[i * H * D + e] = LOAD(q[i * q_stride + e]) * scale; \
    for (int64_t j = t0 / BS; j * BS < t1; ++j) {                                              \
        /* rows r0 .. end - 1 of block j: a window's first block starts inside it */           \
        const int64_t r0 = t0 > j * BS ? t0 - j * BS : 0;                                      \
        const int last = (j + 1) * BS >= t1;                                                   \
        const int64_t pf = last ? pf_next : last_table[j + 1];                                 \
        const int64_t pf_rows = last ? pf_next_rows                                            \
                                     : (t1 - (j + 1) * BS < BS ? t1 - (j + 1) * BS : BS);      \
        for (int64_t kvh = 0; kvh < NKV; ++kvh) {                                              \
            const int64_t off = kvh * head_stride;                                             \
            if (pf >= 0) {                                                                     \
                prefetch_bytes_l2(kv + pf * block_stride + off, pf_rows * D * (int64_t)sizeof(T)); \
                prefetch_bytes_l2(vbase + pf * block_stride + off,                             \
                                  pf_rows * D * (int64_t)sizeof(T));                           \
            }                                                                                  \
            for (int64_t i = 0; i < n; ++i) {                                                  \
                const int64_t end = lens[i] < t1 ? lens[i] : t1;                               \
                const int64_t rows = (end - j * BS < BS ? end - j * BS : BS) - r0;             \
                if (rows <= 0) continue;                                                       \
                const int64_t blk = table[i * bt_stride + j];                                  \
                float *part = part0 + (size_t)i * row_stride + (size_t)kvh * kvh_stride;       \
                NAME##_fold(q + i * q_stride + kvh * G * D, qf + i * H * D + kvh * G * D,      \
                            kv + blk * block_stride + off + r0 * D,                            \
                            vbase + blk * block_stride + off + r0 * D, rows, G, D, scale,       \
                            softcap, scores, part, part + G, part + 2 * G);                    \
            }                                                                                  \
        }                                                                                      \
    }                                                                                          \
}                                                                                              \
                                                                                               \
INLINE void NAME##_item_d(const T *q, int64_t q_stride, const T *kv, const T *vbase,          \
                         const int32_t *table, int64_t bt_stride, const int32_t *lens,         \
                         int64_t n, int64_t t0, int64_t t1, int64_t H, int64_t NKV, int64_t D, \
                         int64_t BS, float scale, float softcap, int64_t pf_next,              \
                         int64_t pf_next_rows, float *scores, float *qf, float *part0,         \
                         size_t row_stride, size_t kvh_stride) {                               \
    if (D == 64)                                                                               \
        NAME##_item(q, q_stride, kv, vbase, table, bt_stride, lens, n, t0, t1, H, NKV, 64, BS, \
                   scale, softcap, pf_next, pf_next_rows, scores, qf, part0, row_stride,       \
                   kvh_stride);                                                                \
    else if (D == 128)                                                                         \
        NAME##_item(q, q_stride, kv, vbase, table, bt_stride, lens, n, t0, t1, H, NKV, 128, BS, \
                   scale, softcap, pf_next, pf_next_rows, scores, qf, part0, row_stride,       \
                   kvh_stride);                                                                \
    else                                                                                       \
        NAME##_item(q, q_stride, kv, vbase, table, bt_stride, lens, n, t0, t1, H, NKV, D, BS,  \
                   scale, softcap, pf_next, pf_next_rows, scores, qf, part0, row_stride,       \
                   kvh_stride);                                                                \
}                                                                                              \
                                                                                               \
int NAME##_team(const DecodeArgs *a) {                                                        \
    const int64_t B = a->B, H = a->H, NKV = a->NKV, D = a->D, BS = a->BS, NB = a->NB;           \
    const int64_t bt_stride = a->bt_stride;                                                    \
    const int32_t *block_tables = a->block_tables, *seq_lens = a->seq_lens;                    \
    int64_t max_len = 0, info[2];                                                              \
    const int rc = check_inputs(block_tables, bt_stride, a->bt_cols, seq_lens, B, H, NKV, D,   \
                                BS, NB, info, &max_len);                                       \
    const int tid = omp_get_thread_num(), nt = omp_get_num_threads();                          \
    if (tid == 0 && a->info) { a->info[0] = info[0]; a->info[1] = info[1]; }                  \
    if (rc != PD_OK || B == 0) return rc;                                                      \
    if (nt > a->threads) return PD_ERR_ALLOC;   /* scratch is for a->threads threads */       \
    const int64_t G = H / NKV, pairs = B * NKV;                                                \
    const T *q = a->q, *kv = a->kv;                                                            \
    T *out = a->out;                                                                           \
    const float scale = a->scale, softcap = a->softcap;                                        \
    const int64_t window = a->window > 0 ? a->window : 0;                                      \
    const T *vbase = kv + NB * NKV * BS * D;                                                   \
    const size_t per_part = partial_floats(G, D);                                              \
    DecodeScratch sc = decode_scratch(G, BS, H, D,                                             \
                                      parts_floats(G, D, B * NKV * max_chunks(B, a->threads)), \
                                      a->threads, a->scratch);                                 \
    const size_t per_thread = sc.scores_n + sc.qf_n;                                           \
    _Pragma("omp single")                                                                      \
    {   /* items are claimed in order from this counter, one ahead; the groups */              \
        *sc.next_item = 0;                                                                     \
        *sc.groups = find_groups(block_tables, bt_stride, seq_lens, B, BS, window, sc.group_len); \
    }                                                                                          \
    /* a windowed sequence's items cover its last `window` keys, from key L - window on */     \
    const Split sp = plan_split(*sc.groups, window && max_len > window ? window : max_len, BS, nt); \
    if (sp.chunks > max_chunks(B, a->threads)) return PD_ERR_ALLOC;   /* cannot happen */      \
    const int64_t items = B * sp.chunks;                                                       \
    {                                                                                          \
        float *scores = sc.threads + (size_t)tid * per_thread;                                 \
        float *qf = scores + sc.scores_n;                                                      \
        int64_t item = __atomic_fetch_add(sc.next_item, 1, __ATOMIC_RELAXED);                  \
        while (item < items) {                                                                 \
            const int64_t following = __atomic_fetch_add(sc.next_item, 1, __ATOMIC_RELAXED);   \
            const int64_t b = item / sp.chunks, c = item % sp.chunks, n = sc.group_len[b];     \
            if (n == 0) { item = following; continue; }   /* b's group's lead does its work */ \
            const int64_t L = seq_lens[b + n - 1];    /* the group's longest row */            \
            const int64_t lo = window && L > window ? L - window : 0;                          \
            const int64_t t0 = lo + c * sp.chunk_blocks * BS;                                  \
            const int64_t t1 = t0 + sp.chunk_blocks * BS < L ? t0 + sp.chunk_blocks * BS : L;  \
            float *part0 = sc.parts + (size_t)(b * NKV * sp.chunks + c) * per_part;            \
            const size_t kvh_stride = (size_t)sp.chunks * per_part;                            \
            const size_t row_stride = (size_t)NKV * kvh_stride;                                \
            for (int64_t i = 0; i < n; ++i)                                                    \
                for (int64_t kvh = 0; kvh < NKV; ++kvh) {  /* empty: m = -inf, l = 0, acc = 0 */ \
                    float *part = part0 + (size_t)i * row_stride + (size_t)kvh * kvh_stride;   \
                    for (int64_t g = 0; g < G; ++g) part[g] = -INFINITY;                       \
                    memset(part + G, 0, sizeof(float) * (size_t)(G * (D + 1)));                \
                }                                                                              \
            int64_t pf_next = -1, pf_next_rows = 0;                                            \
            if (following < items) {                                                           \
                const int64_t b2 = following / sp.chunks, c2 = following % sp.chunks;         \
                const int64_t L2 = seq_lens[b2];                                               \
                const int64_t s0 = (window && L2 > window ? L2 - window : 0)                   \
                                   + c2 * sp.chunk_blocks * BS;                                \
                if (s0 < L2) {                                                                 \
                    pf_next = block_tables[b2 * bt_stride + s0 / BS];                          \
                    pf_next_rows = L2 - s0 < BS ? L2 - s0 : BS;                                \
                }                                                                              \
            }                                                                                  \
            if (t0 < t1)                                                                       \
                NAME##_item_d(q + b * H * D, H * D, kv, vbase, block_tables + b * bt_stride,    \
                             bt_stride, seq_lens + b, n, t0, t1, H, NKV, D, BS, scale, softcap, \
                             pf_next, pf_next_rows, scores, qf, part0, row_stride, kvh_stride); \
            item = following;                                                                  \
        }                                                                                      \
        _Pragma("omp barrier")   /* every partial is written */                                \
        /* merge each (sequence, KV head)'s runs */                                            \
        _Pragma("omp for schedule(static) nowait")                                             \
        for (int64_t pair = 0; pair < pairs; ++pair) {                                         \
            const int64_t b = pair / NKV, kvh = pair % NKV;                                    \
            T *op = out + (b * H + kvh * G) * D;                                               \
            const float *first = sc.parts + (size_t)(pair * sp.chunks) * per_part;             \
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
    return PD_OK;                                                                              \
}                                                                                              \
                                                                                               \
int NAME##_run(DecodeArgs *a) {                                                               \
    a->threads = team_threads();                                                               \
    return TEAM_RUN_WITH_SCRATCH(NAME##_team, a, paged_decode_scratch(a), a->threads, 0,      \
                                 PD_ERR_ALLOC);                                                \
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

/* Query rows of sequence b are query_start_loc[b] .. query_start_loc[b + 1] - 1; the last one
 * is the sequence's last token, so each query's position follows from seq_lens. */
static int check_queries(const int32_t *qsl, const int32_t *seq_lens, int64_t B, int64_t NT,
                         int64_t *info) {
    info[0] = info[1] = -1;
    if (qsl[0] != 0) { info[0] = 0; return PD_ERR_QUERY; }   /* else rows no sequence owns */
    for (int64_t b = 0; b < B; ++b) {
        const int64_t ql = (int64_t)qsl[b + 1] - qsl[b];
        if (ql < 0 || ql > seq_lens[b]) { info[0] = b; return PD_ERR_QUERY; }
    }
    if (qsl[B] != NT) { info[0] = B; return PD_ERR_QUERY; }
    return PD_OK;
}

/* Paged-attention prefill: every query token of every sequence, causal. A query at position p
 * (its sequence's cached context plus its index among the query tokens) attends to keys
 * 0 .. p. With AVX-512 and G = H / NKV <= 16 query heads per KV head, the work items are
 * tiles (prefill_tiles.h): up to 16 query rows of one sequence and KV head, each a lane, so a
 * tile reads each K/V run once for all its rows; the tiles of a sequence go to the threads in
 * order, so its K/V stays in their L2. Otherwise each token is a work item run by the decode's
 * arithmetic (DEC##_item_d) over its sequence's blocks, read in place, and normalized as soon
 * as it is done; tokens go to the threads 8 at a time in order. Either way a row's result
 * does not depend on which other rows share its step. Inputs are checked first as the
 * decode's (check_inputs) plus query_start_loc (check_queries); scratch for every thread is
 * taken before the parallel region. */
typedef struct {
    const void *q, *kv;
    const int32_t *block_tables;
    int64_t bt_stride, bt_cols;
    const int32_t *seq_lens, *query_start_loc;
    void *out;
    int64_t B, NT, H, NKV, D, BS, NB;
    float scale;
    int threads;
    int64_t *info;
    void *scratch;
    int64_t window;   /* sliding window in keys, 0: none */
    float softcap;    /* logit soft-cap, 0: none */
} PrefillArgs;

/* Whether the prefill runs in tiles: AVX-512 and at most 16 query heads per KV head. */
static int prefill_tiled(int64_t H, int64_t NKV) { return VEC_QK && H / NKV <= TILE_LANES; }

/* Scratch in tiles: each thread's tile scratch (tile_scratch_floats), then each tile's
 * sequence and first query row (int32 pairs; at most NT tiles). Per token: the decode's
 * per-thread part, each thread's partials of its token (NKV of them), then each query
 * token's sequence (int32). */
int64_t paged_prefill_scratch(const PrefillArgs *a) {
    if (a->H <= 0 || a->NKV <= 0 || a->D <= 0 || a->BS <= 0 || a->NT < 0) return 64;
    const int64_t G = a->H / a->NKV;
    size_t total;
    if (prefill_tiled(a->H, a->NKV)) {
        if (__builtin_mul_overflow(tile_scratch_floats(a->D), (size_t)a->threads, &total) ||
            __builtin_mul_overflow(total, sizeof(float), &total) ||
            __builtin_add_overflow(total, 2 * sizeof(int32_t) * (size_t)a->NT + 64, &total) ||
            total > (size_t)INT64_MAX)
            return -1;
        return (int64_t)total;
    }
    const size_t per = per_thread_floats(G, a->BS, a->H, a->D);
    const size_t parts = parts_floats(G, a->D, a->NKV);
    if (!per || !parts || __builtin_add_overflow(per, parts, &total) ||
        __builtin_mul_overflow(total, (size_t)a->threads, &total) ||
        __builtin_mul_overflow(total, sizeof(float), &total) ||
        __builtin_add_overflow(total, sizeof(int32_t) * (size_t)a->NT + 64, &total) ||
        total > (size_t)INT64_MAX)
        return -1;
    return (int64_t)total;
}

#if VEC_QK
/* One tile: query rows t0 .. t0 + ntok - 1 (of sequence b) times the G heads of KV head kvh,
 * lane l = token l / G, head kvh * G + l % G. LOAD16 widens 16 stored values to float32,
 * STORE16 stores 16 back; DP: the scores are bfloat16 dot products (T is bfloat16, D even). */
#define DEFINE_PREFILL_TILE(NAME, T, LOAD16, STORE16, DP)                                           \
INLINE void NAME##_tile_d(const PrefillArgs *a, const T *q, const T *kv, const T *vbase,      \
                          T *out, int64_t b, int64_t t0, int64_t ntok, int64_t kvh, float *scr, \
                          const int64_t D) {                                                   \
    const int64_t H = a->H, NKV = a->NKV, BS = a->BS, G = H / NKV;                             \
    const int32_t *table = a->block_tables + b * a->bt_stride;                                 \
    const int64_t first = a->query_start_loc[b];                                               \
    const int64_t pos0 = a->seq_lens[b] - (a->query_start_loc[b + 1] - first) + (t0 - first); \
    const int64_t lanes = ntok * G;                                                            \
    const int dp = (DP) && D % 2 == 0;                                                         \
    float *qt = scr, *o = qt + D * TILE_LANES, *kf = o + D * TILE_LANES, *vf = kf + 16 * D;    \
    int32_t lane_pos[TILE_LANES], lane_lo[TILE_LANES];                                         \
    for (int64_t l = 0; l < TILE_LANES; ++l) {   /* idle lanes repeat the last row */          \
        const int64_t p = pos0 + (l < lanes ? l / G : ntok - 1);                               \
        lane_pos[l] = (int32_t)p;                                                              \
        lane_lo[l] = (int32_t)(a->window > 0 && p + 1 > a->window ? p + 1 - a->window : 0);    \
    }                                                                                          \
    const __m512i pos = _mm512_loadu_si512(lane_pos), lo = _mm512_loadu_si512(lane_lo);         \
    if (dp) {   /* q's pairs as stored, transposed: qt[c * 16 + l] = pair c of lane l */        \
        const uint32_t *row[TILE_LANES];                                                       \
        for (int64_t l = 0; l < TILE_LANES; ++l)                                               \
            row[l] = l < lanes ? (const uint32_t *)(q + (t0 + l / G) * H * D + (kvh * G + l % G) * D) \
                               : NULL;                                                         \
        TILE_TRANSPOSE_ROWS((float *)qt, row, D / 2, load16_words);                            \
    } else {    /* q widened, transposed, then scaled */                                       \
        const T *row[TILE_LANES];                                                              \
        for (int64_t l = 0; l < TILE_LANES; ++l)                                               \
            row[l] = l < lanes ? q + (t0 + l / G) * H * D + (kvh * G + l % G) * D : NULL;      \
        TILE_TRANSPOSE_ROWS(qt, row, D, LOAD16);                                               \
        const __m512 vs = _mm512_set1_ps(a->scale);                                            \
        for (int64_t d = 0; d < D; ++d)                                                        \
            _mm512_storeu_ps(qt + d * TILE_LANES, _mm512_mul_ps(_mm512_loadu_ps(qt + d * TILE_LANES), vs)); \
    }                                                                                          \
    memset(o, 0, sizeof(float) * (size_t)(D * TILE_LANES));                                    \
    TileState st = {_mm512_set1_ps(-INFINITY), _mm512_setzero_ps()};                          \
    const int64_t kbeg = lane_lo[0], kend = lane_pos[TILE_LANES - 1] + 1;                      \
    __m512 s[16];                                                                              \
    for (int64_t blk = kbeg / BS; blk * BS < kend; ++blk) {                                    \
        const int64_t id = table[blk];                                                         \
        const T *kb = kv + (id * NKV + kvh) * BS * D, *vb = vbase + (id * NKV + kvh) * BS * D; \
        for (int64_t r0 = 0; r0 < BS && blk * BS + r0 < kend; r0 += 16) {                      \
            const int64_t k0 = blk * BS + r0;                                                  \
            int64_t nk = BS - r0 < 16 ? BS - r0 : 16;                                          \
            if (kend - k0 < nk) nk = kend - k0;                                                \
            if (k0 + nk <= kbeg) continue;                                                     \
            const T *kr = kb + r0 * D, *vr = vb + r0 * D;                                      \
            if (dp) {                                                                          \
                const uint16_t *k16 = nk == 16 ? (const uint16_t *)kr                          \
                                               : pad_rows16(kr, nk, sizeof(T) * (size_t)D, kf); \
                NAME##_scores_dp((const uint32_t *)qt, k16, D, s);                            \
                for (int j = 0; j < 16; ++j) s[j] = _mm512_mul_ps(s[j], _mm512_set1_ps(a->scale)); \
            } else {                                                                           \
                const float *k32 = NAME##_rows_f32(kr, nk, D, kf);                             \
                tile_scores_f32(qt, k32, D, s);                                                \
            }                                                                                  \
            if (a->softcap > 0.f)                                                              \
                for (int j = 0; j < 16; ++j) s[j] = softcap16(s[j], a->softcap);               \
            tile_fold(&st, s, NAME##_rows_f32(vr, nk, D, vf), D, nk, k0, pos, lo, o);          \
        }                                                                                      \
    }                                                                                          \
    tile_normalize(o, st.l, D, kf);   /* the rows, as float32, into the K scratch */           \
    for (int64_t l = 0; l < lanes; ++l) {                                                      \
        T *dst = out + (t0 + l / G) * H * D + (kvh * G + l % G) * D;                           \
        for (int64_t d = 0; d < D; d += 16)                                                    \
            STORE16(dst + d, (__mmask16)(D - d >= 16 ? 0xffffu : (1u << (D - d)) - 1u),       \
                    _mm512_loadu_ps(kf + l * D + d));                                          \
    }                                                                                          \
}                                                                                              \
                                                                                               \
/* One tile, with head sizes 64 and 128 compiled as constants (rows at fixed offsets). */    \
static void NAME##_tile(const PrefillArgs *a, const T *q, const T *kv, const T *vbase, T *out, \
                        int64_t b, int64_t t0, int64_t ntok, int64_t kvh, float *scr) {       \
    if (a->D == 64) NAME##_tile_d(a, q, kv, vbase, out, b, t0, ntok, kvh, scr, 64);            \
    else if (a->D == 128) NAME##_tile_d(a, q, kv, vbase, out, b, t0, ntok, kvh, scr, 128);     \
    else NAME##_tile_d(a, q, kv, vbase, out, b, t0, ntok, kvh, scr, a->D);                     \
}                                                                                              \
                                                                                               \
/* Every thread of the team: list the tiles (one thread), then take (tile, KV head) items in  \
 * order, one at a time. */                                                                    \
static int NAME##_tiled(const PrefillArgs *a, int tid) {                                       \
    const int64_t NKV = a->NKV, TT = TILE_TOKENS(a->H / NKV);                                  \
    const size_t per_thread = tile_scratch_floats(a->D);                                       \
    int64_t *count = (int64_t *)a->scratch;                                                    \
    float *base = (float *)((char *)a->scratch + 64);                                          \
    int32_t *tiles = (int32_t *)(base + per_thread * (size_t)a->threads);                      \
    const int32_t *qsl = a->query_start_loc;                                                   \
    _Pragma("omp single")                                                                      \
    {                                                                                          \
        int64_t n = 0;                                                                         \
        for (int64_t b = 0; b < a->B; ++b)                                                     \
            for (int64_t t = qsl[b]; t < qsl[b + 1]; t += TT) {                                \
                tiles[2 * n] = (int32_t)b;                                                     \
                tiles[2 * n + 1] = (int32_t)t;                                                 \
                ++n;                                                                           \
            }                                                                                  \
        *count = n;                                                                            \
    }                                                                                          \
    const T *q = a->q, *kv = a->kv;                                                            \
    const T *vbase = kv + a->NB * NKV * a->BS * a->D;                                          \
    float *scr = base + per_thread * (size_t)tid;                                              \
    const int64_t items = *count * NKV;                                                        \
    _Pragma("omp for schedule(dynamic, 1) nowait")                                             \
    for (int64_t i = 0; i < items; ++i) {                                                      \
        const int64_t tile = i / NKV, b = tiles[2 * tile], t0 = tiles[2 * tile + 1];           \
        const int64_t ntok = qsl[b + 1] - t0 < TT ? qsl[b + 1] - t0 : TT;                      \
        NAME##_tile(a, q, kv, vbase, (T *)a->out, b, t0, ntok, i % NKV, scr);                  \
    }                                                                                          \
    return PD_OK;                                                                              \
}

/* 16 float32 rows of D from nk stored rows (the rest zero): src itself when it is float32 and
 * nk is 16, else widened or copied into buf. */
INLINE const float *paged_prefill_f32_rows_f32(const float *src, int64_t nk, int64_t D,
                                               float *buf) {
    return nk == 16 ? src : pad_rows16(src, nk, sizeof(float) * (size_t)D, buf);
}
INLINE const float *paged_prefill_bf16_rows_f32(const uint16_t *src, int64_t nk, int64_t D,
                                                float *buf) {
    for (int64_t i = 0; i < nk * D; ++i) buf[i] = bf16_to_f32(src[i]);
    memset(buf + nk * D, 0, sizeof(float) * (size_t)((16 - nk) * D));
    return buf;
}
INLINE void paged_prefill_f32_scores_dp(const uint32_t *qp, const uint16_t *k, int64_t D,
                                        __m512 s[16]) {
    (void)qp; (void)k; (void)D; (void)s;   /* float32 caches take the FMA path */
}
#if DP_BF16
#define paged_prefill_bf16_scores_dp tile_scores_dpbf16
#else
#define paged_prefill_bf16_scores_dp paged_prefill_f32_scores_dp
#endif
DEFINE_PREFILL_TILE(paged_prefill_f32, float, load16_f32, store16_f32, 0)
DEFINE_PREFILL_TILE(paged_prefill_bf16, uint16_t, load16_bf16, store16_bf16, DP_BF16)
#else   /* no tiles without AVX-512 (prefill_tiled is false): never called */
static int paged_prefill_f32_tiled(const PrefillArgs *a, int tid) {
    (void)a; (void)tid;
    return PD_ERR_SHAPE;
}
static int paged_prefill_bf16_tiled(const PrefillArgs *a, int tid) {
    (void)a; (void)tid;
    return PD_ERR_SHAPE;
}
#endif

#define DEFINE_PREFILL(NAME, DEC, T, STORE)                                                    \
int NAME##_team(const PrefillArgs *a) {                                                        \
    const int64_t B = a->B, NT = a->NT, H = a->H, NKV = a->NKV, D = a->D, BS = a->BS;          \
    const int32_t *block_tables = a->block_tables, *seq_lens = a->seq_lens;                    \
    const int32_t *query_start_loc = a->query_start_loc;                                       \
    int64_t max_len = 0, info[2];                                                              \
    int rc = check_inputs(block_tables, a->bt_stride, a->bt_cols, seq_lens, B, H, NKV, D, BS,  \
                          a->NB, info, &max_len);                                              \
    if (rc == PD_OK && NT < 0) rc = PD_ERR_SHAPE;                                              \
    if (rc == PD_OK) rc = check_queries(query_start_loc, seq_lens, B, NT, info);               \
    const int tid = omp_get_thread_num();                                                      \
    if (tid == 0 && a->info) { a->info[0] = info[0]; a->info[1] = info[1]; }                  \
    if (rc != PD_OK || NT == 0) return rc;                                                     \
    if (omp_get_num_threads() > a->threads) return PD_ERR_ALLOC;                               \
    if (prefill_tiled(H, NKV)) return NAME##_tiled(a, tid);                                    \
    const int64_t G = H / NKV;                                                                 \
    const T *q = a->q, *kv = a->kv;                                                            \
    T *out = a->out;                                                                           \
    const T *vbase = kv + a->NB * NKV * BS * D;                                                \
    DecodeScratch sc = decode_scratch(G, BS, H, D, 0, a->threads, a->scratch);                 \
    const size_t per_thread = sc.scores_n + sc.qf_n, per_part = partial_floats(G, D);          \
    int32_t *tok_seq = (int32_t *)(sc.parts + per_part * (size_t)(NKV * a->threads));          \
    _Pragma("omp single")                                                                      \
    for (int64_t b = 0; b < B; ++b)                                                            \
        for (int64_t t = query_start_loc[b]; t < query_start_loc[b + 1]; ++t) tok_seq[t] = (int32_t)b; \
    {                                                                                          \
        float *scores = sc.threads + (size_t)tid * per_thread, *qf = scores + sc.scores_n;     \
        float *part0 = sc.parts + (size_t)tid * (size_t)NKV * per_part;                        \
        _Pragma("omp for schedule(dynamic, 8) nowait")                                         \
        for (int64_t t = 0; t < NT; ++t) {                                                     \
            const int64_t b = tok_seq[t], first = query_start_loc[b];                          \
            const int64_t pos = seq_lens[b] - (query_start_loc[b + 1] - first) + (t - first);  \
            for (int64_t kvh = 0; kvh < NKV; ++kvh) {  /* m = -inf, l = 0, acc = 0 */          \
                float *part = part0 + (size_t)kvh * per_part;                                  \
                for (int64_t g = 0; g < G; ++g) part[g] = -INFINITY;                           \
                memset(part + G, 0, sizeof(float) * (size_t)(G * (D + 1)));                    \
            }                                                                                  \
            const int64_t lo = a->window > 0 && pos + 1 > a->window ? pos + 1 - a->window : 0;  \
            const int32_t len = (int32_t)(pos + 1);                                            \
            DEC##_item_d(q + t * H * D, H * D, kv, vbase, block_tables + b * a->bt_stride,      \
                        a->bt_stride, &len, 1, lo, pos + 1, H, NKV, D, BS, a->scale, a->softcap, \
                        -1, 0, scores, qf, part0, 0, per_part);                                \
            for (int64_t kvh = 0; kvh < NKV; ++kvh) {                                          \
                const float *part = part0 + (size_t)kvh * per_part;                            \
                for (int64_t g = 0; g < G; ++g) {                                              \
                    const float inv = part[G + g] > 0.f ? 1.f / part[G + g] : 0.f;             \
                    const float *acc = part + 2 * G + g * D;                                   \
                    T *o = out + t * H * D + (kvh * G + g) * D;                                \
                    for (int64_t d = 0; d < D; ++d) o[d] = STORE(acc[d] * inv);                \
                }                                                                              \
            }                                                                                  \
        }                                                                                      \
    }                                                                                          \
    return PD_OK;                                                                              \
}                                                                                              \
                                                                                               \
int NAME##_run(PrefillArgs *a) {                                                               \
    a->threads = team_threads();                                                               \
    return TEAM_RUN_WITH_SCRATCH(NAME##_team, a, paged_prefill_scratch(a), a->threads, 0,     \
                                 PD_ERR_ALLOC);                                                \
}

DEFINE_PREFILL(paged_prefill_f32, paged_decode_f32, float, f32_id)
DEFINE_PREFILL(paged_prefill_bf16, paged_decode_bf16, uint16_t, f32_to_bf16)
