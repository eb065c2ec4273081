/* Linear over packed GGML weights with float32 activations on AMX bfloat16 tiles, for the
 * tessellm CPU plugin: op linear_packed (out = x @ dequantize(W)^T + bias, float32), for steps
 * of many rows (prefill).
 *
 * Exact to float32 rounding, not a bfloat16 product: each row of x is split into three
 * bfloat16 parts, x = x1 + x2 + x3 (x1 = bf16(x), x2 = bf16(x - x1), x3 = x - x1 - x2: 8 + 8
 * + 8 significant bits, so the sum is x exactly for normal values), and the weight's levels (the
 * integers GGUF stores: 0..31, Q8_0's -128..127, Q6_K's -32..31) are exact in bfloat16, so
 * every product q * x_i is exact in float32 and TDPBF16PS only rounds its float32 sums. Per
 * block c of 32 inputs, a 16-row tile of x gets
 *   dot_c = sum_k q_k x_k   (three TDPBF16PS, one per part, into one float32 C tile)
 *   acc += dot_c * d_c + o_c * sx_c                  (c in order; sx_c = the block's x sum)
 * with d_c and o_c the block's scale and offset (amx_strips.h's decode_row; Q6_K: two
 * half-block tiles with their own d sc). That is the dequantized product reassociated, as the
 * other packed kernels compute it, so it equals the reference up to float32 rounding (the
 * weights are not rounded to float32 first: ~2^-24 relative per product). AMX treats
 * bfloat16 denormals (|x| < 2^-126) as zero, so inputs below ~1e-38 and the third part of
 * values below ~1e-33 are lost: far below float32 rounding of any output that matters.
 *
 * The weights are read in place and decoded per call (amx_strips.h: strips of 16 features,
 * levels as bytes, then here as bfloat16 pairs in the B form: 16 rows of 2 inputs x 16
 * features per block of 32). Decoding a strip costs about a few row tiles' work, so the kernel
 * is for steps of tens of rows or more; rows are padded to 16 (zeros; outputs not written).
 * Needs AMX-BF16 and AVX-512 BF16/BW (the build fails without them, and the kernel is then not
 * offered).
 */
#define _GNU_SOURCE   /* syscall() in amx_strips.h */
#include <immintrin.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "amx_strips.h"
#include "team.h"

#if !defined(__AMX_TILE__) || !defined(__AMX_BF16__) || !defined(__AVX512BF16__) || \
    !defined(__AVX512BW__)
#error "linear_packed_amx needs AMX-BF16 and AVX-512 BF16 and BW"
#endif

#define ROWS 16        /* rows of x per tile */
#define M_BLOCK 128    /* rows whose split x a strip's decoded weights serve at once */
#define B_BLOCK 1024   /* bytes of one block of 32 inputs of a strip in B form */
#define PARTS 3        /* bfloat16 parts of x */

/* tiles (numbers, as the tile intrinsics paste them into the instruction). Whole blocks: C0 /
 * C1 (float32 16 x 16, alternate blocks), X1-X3 (16 rows x 32 inputs, one per part), B (16
 * rows of 2 inputs x 16 features). Q6_K's halves: C0-C3 (two per block), X1-X3 of 16 inputs
 * and B of 8 rows, configured per call by the weight type. */
#define C0 0
#define C1 1
#define X1 2
#define X2 3
#define X3 4
#define B 5
#define C2 6
#define C3 7
static const uint8_t WHOLE_ROWS[8] = {16, 16, 16, 16, 16, 16, 16, 16};
static const uint16_t WHOLE_COLSB[8] = {64, 64, 64, 64, 64, 64, 64, 64};
static const uint8_t HALF_ROWS[8] = {16, 16, 16, 16, 16, 8, 16, 16};
static const uint16_t HALF_COLSB[8] = {64, 64, 32, 32, 32, 64, 64, 64};

enum { OK = 0, ERR_SHAPE = 1, ERR_ALLOC = 2, ERR_UNAVAILABLE = 3 };

/* 0, or 3 when Linux refuses this process the tile state (called once at load). */
int amx_enable(void) { return amx_request_tiles(); }

/* x split into bfloat16 parts: row i is PARTS runs of K bfloat16 then nb2 float block sums,
 * `stride` bytes apart; rows past M zero. */
typedef struct {
    uint8_t *data;
    int64_t stride, K;
} SplitRows;

static inline __m512 bf16_to_f32(__m256i h) {
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
}

static void split_row(const float *x, int64_t K, int64_t nb, uint8_t *dst) {
    uint16_t *p1 = (uint16_t *)dst, *p2 = p1 + K, *p3 = p2 + K;
    float *sums = (float *)(p1 + PARTS * K);
    for (int64_t c = 0; c < nb; c++) {
        __m512 s = _mm512_setzero_ps();
        for (int h = 0; h < 2; h++) {
            const int64_t k = c * 32 + 16 * h;
            const __m512 v = _mm512_loadu_ps(x + k);
            const __m256i a = (__m256i)_mm512_cvtneps_pbh(v);
            const __m512 r1 = _mm512_sub_ps(v, bf16_to_f32(a));
            const __m256i b = (__m256i)_mm512_cvtneps_pbh(r1);
            const __m512 r2 = _mm512_sub_ps(r1, bf16_to_f32(b));
            const __m256i c3 = (__m256i)_mm512_cvtneps_pbh(r2);
            _mm256_storeu_si256((__m256i *)(p1 + k), a);
            _mm256_storeu_si256((__m256i *)(p2 + k), b);
            _mm256_storeu_si256((__m256i *)(p3 + k), c3);
            s = _mm512_add_ps(s, v);
        }
        sums[c] = _mm512_reduce_add_ps(s);
    }
}

/* The levels of a strip in B form: per block, 16 rows holding for each of the 16 features
 * the pair of inputs (2r, 2r + 1) as bfloat16 (exact: small integers). */
static void to_bf16_b_form_signed(const uint8_t *lv, int64_t lv_stride, int64_t nb2,
                                  uint8_t *bform, int is_signed) {
    for (int64_t c = 0; c < nb2; c++) {
        __m512i r[16];
        for (int n = 0; n < 16; n++) {
            const uint8_t *p = lv + n * lv_stride + c * QK;
            const __m128i lo = _mm_loadu_si128((const __m128i *)p);
            const __m128i hi = _mm_loadu_si128((const __m128i *)(p + 16));
            const __m512 flo = _mm512_cvtepi32_ps(is_signed ? _mm512_cvtepi8_epi32(lo)
                                                            : _mm512_cvtepu8_epi32(lo));
            const __m512 fhi = _mm512_cvtepi32_ps(is_signed ? _mm512_cvtepi8_epi32(hi)
                                                            : _mm512_cvtepu8_epi32(hi));
            r[n] = (__m512i)_mm512_cvtne2ps_pbh(fhi, flo);   /* inputs 0..31 in order */
        }
        transpose16(r);
        for (int i = 0; i < 16; i++)
            _mm512_storeu_si512((void *)(bform + c * B_BLOCK + i * 64), r[i]);
    }
}
static void to_b_unsigned(const uint8_t *lv, int64_t s, int64_t nb2, uint8_t *bform) {
    to_bf16_b_form_signed(lv, s, nb2, bform, 0);
}
static void to_b_signed(const uint8_t *lv, int64_t s, int64_t nb2, uint8_t *bform) {
    to_bf16_b_form_signed(lv, s, nb2, bform, 1);
}

/* acc[i] += dot_i * s + o * sx_i for the tile's 16 rows (o NULL: no offset term). */
static inline void scale_add(const float *cb, __m512 s, const __m512 *o, const float *sx,
                             int64_t stride_floats, __m512 acc[ROWS]) {
    for (int i = 0; i < ROWS; i++) {
        acc[i] = _mm512_fmadd_ps(_mm512_load_ps(cb + 16 * i), s, acc[i]);
        if (o) acc[i] = _mm512_fmadd_ps(*o, _mm512_set1_ps(sx[i * stride_floats]), acc[i]);
    }
}

/* Rows m0 .. m0 + 15 of the split x (a SplitRows) against the decoded strip. */
static void tile_rows(const void *rows, int64_t m0, int64_t nb, int qtype, const Strip *st,
                      __m512 acc[ROWS]) {
    const SplitRows *x = rows;
    const int64_t K = x->K, stride = x->stride;
    const uint8_t *base = x->data + m0 * stride;
    const uint16_t *x1 = (const uint16_t *)base, *x2 = x1 + K, *x3 = x2 + K;
    const float *sx = (const float *)(x1 + PARTS * K);
    const int64_t sx_stride = stride / (int64_t)sizeof(float);
    for (int i = 0; i < ROWS; i++) acc[i] = _mm512_setzero_ps();
    float *cbuf = st->cbuf;
    if (qtype == Q6_K) {
        for (int64_t c = 0; c < nb; c++) {
            const int even = (c & 1) == 0;
            float *cb = cbuf + (even ? 0 : 512);
            const uint8_t *b = st->bform + c * B_BLOCK;
            const int64_t k = c * 32;
            if (even) {
                _tile_zero(C0);
                _tile_zero(C1);
                _tile_loadd(B, b, 64);
                _tile_loadd(X1, x1 + k, stride);
                _tile_loadd(X2, x2 + k, stride);
                _tile_loadd(X3, x3 + k, stride);
                _tile_dpbf16ps(C0, X1, B);
                _tile_dpbf16ps(C0, X2, B);
                _tile_dpbf16ps(C0, X3, B);
                _tile_loadd(B, b + 512, 64);
                _tile_loadd(X1, x1 + k + 16, stride);
                _tile_loadd(X2, x2 + k + 16, stride);
                _tile_loadd(X3, x3 + k + 16, stride);
                _tile_dpbf16ps(C1, X1, B);
                _tile_dpbf16ps(C1, X2, B);
                _tile_dpbf16ps(C1, X3, B);
                _tile_stored(C0, cb, 64);
                _tile_stored(C1, cb + 256, 64);
            } else {
                _tile_zero(C2);
                _tile_zero(C3);
                _tile_loadd(B, b, 64);
                _tile_loadd(X1, x1 + k, stride);
                _tile_loadd(X2, x2 + k, stride);
                _tile_loadd(X3, x3 + k, stride);
                _tile_dpbf16ps(C2, X1, B);
                _tile_dpbf16ps(C2, X2, B);
                _tile_dpbf16ps(C2, X3, B);
                _tile_loadd(B, b + 512, 64);
                _tile_loadd(X1, x1 + k + 16, stride);
                _tile_loadd(X2, x2 + k + 16, stride);
                _tile_loadd(X3, x3 + k + 16, stride);
                _tile_dpbf16ps(C3, X1, B);
                _tile_dpbf16ps(C3, X2, B);
                _tile_dpbf16ps(C3, X3, B);
                _tile_stored(C2, cb, 64);
                _tile_stored(C3, cb + 256, 64);
            }
            scale_add(cb, _mm512_loadu_ps(st->s0 + c * STRIP), NULL, sx + c, sx_stride, acc);
            scale_add(cb + 256, _mm512_loadu_ps(st->s1 + c * STRIP), NULL, sx + c, sx_stride, acc);
        }
        return;
    }
    const int has_offset = qtype != Q8_0;
    for (int64_t c = 0; c < nb; c++) {
        const int even = (c & 1) == 0;
        float *cb = cbuf + (even ? 0 : 512);
        const int64_t k = c * 32;
        _tile_loadd(B, st->bform + c * B_BLOCK, 64);
        _tile_loadd(X1, x1 + k, stride);
        _tile_loadd(X2, x2 + k, stride);
        _tile_loadd(X3, x3 + k, stride);
        if (even) {
            _tile_zero(C0);
            _tile_dpbf16ps(C0, X1, B);
            _tile_dpbf16ps(C0, X2, B);
            _tile_dpbf16ps(C0, X3, B);
            _tile_stored(C0, cb, 64);
        } else {
            _tile_zero(C1);
            _tile_dpbf16ps(C1, X1, B);
            _tile_dpbf16ps(C1, X2, B);
            _tile_dpbf16ps(C1, X3, B);
            _tile_stored(C1, cb, 64);
        }
        const __m512 o = _mm512_loadu_ps(st->s1 + c * STRIP);
        scale_add(cb, _mm512_loadu_ps(st->s0 + c * STRIP), has_offset ? &o : NULL, sx + c,
                  sx_stride, acc);
    }
}

/* The linear's arguments (team.h; linear_q8act_amx.c's layout). scratch: the split rows of
 * x padded to 16 (rows past M zero), then every thread's strip buffers. */
typedef struct {
    const float *x;
    int64_t M, K;
    const uint8_t *w;
    int64_t N;
    int qtype;
    const float *bias;
    float *out;
    int threads;
    void *scratch;
} PackedAmxArgs;

static StripShape shape_of(const PackedAmxArgs *a) {
    return (StripShape){.M = a->M, .N = a->N, .nb = a->K / QK,
                        .row = a->K / block_weights(a->qtype) * block_bytes(a->qtype),
                        .qtype = a->qtype, .b_block = B_BLOCK, .m_block = M_BLOCK};
}

static int64_t split_stride(int64_t K) {
    const int64_t nb2 = (K / QK + 1) / 2 * 2;
    return (int64_t)round64((size_t)(PARTS * K * 2 + nb2 * 4));
}

int64_t linear_packed_amx_scratch(const PackedAmxArgs *a) {
    if (a->M <= 0 || a->K <= 0 || block_bytes(a->qtype) == 0) return 0;
    const StripShape sh = shape_of(a);
    const int64_t padded = (a->M + ROWS - 1) / ROWS * ROWS;
    return split_stride(a->K) * padded + (int64_t)(strip_buffer_bytes(&sh) * (size_t)a->threads);
}

/* Returns 0; 1 on a bad format or K; 2 when the scratch is for fewer threads than the team
 * has; 3 when the tile state is not granted. */
int linear_packed_amx_team(const PackedAmxArgs *a) {
    const int qtype = a->qtype;
    const int64_t M = a->M, K = a->K;
    if (block_bytes(qtype) == 0 || K <= 0 || K % block_weights(qtype) != 0 || M < 0 || a->N < 0)
        return ERR_SHAPE;
    if (M == 0 || a->N == 0) return OK;
    if (amx_request_tiles() != OK) return ERR_UNAVAILABLE;
    if (omp_get_num_threads() > a->threads) return ERR_ALLOC;
    const StripShape sh = shape_of(a);
    const int64_t nb = sh.nb, padded = (M + ROWS - 1) / ROWS * ROWS;
    SplitRows split = {.data = a->scratch, .stride = split_stride(K), .K = K};
#pragma omp for schedule(static)
    for (int64_t i = 0; i < padded; i++) {
        if (i < M) split_row(a->x + i * K, K, nb, split.data + i * split.stride);
        else memset(split.data + i * split.stride, 0, (size_t)split.stride);
    }
    const int half = qtype == Q6_K, is_signed = qtype == Q6_K || qtype == Q8_0;
    run_strips_team(&sh, a->w, a->bias, a->out, half ? HALF_ROWS : WHOLE_ROWS,
                    half ? HALF_COLSB : WHOLE_COLSB, is_signed ? to_b_signed : to_b_unsigned,
                    tile_rows, &split, split.data + split.stride * padded);
    return OK;
}

/* An eager call: the team codes, or 2 when scratch memory cannot be allocated. */
int linear_packed_amx_run(PackedAmxArgs *a) {
    a->threads = team_threads();
    return TEAM_RUN_WITH_SCRATCH(linear_packed_amx_team, a, linear_packed_amx_scratch(a),
                                 a->threads, 0, ERR_ALLOC);
}
