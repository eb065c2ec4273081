/* Linear over packed GGML weights with int8 activations on AMX tiles, for the tessellm CPU
 * plugin: op linear_packed_q8act (the contract of linear_q8act.c: each 32-value block of a row
 * of x rounded to int8 with a float32 scale, q8_rows.h), for steps of many rows (prefill).
 *
 * The weights are read in place, as GGUF stores them (packed_blocks.h, k_quant_blocks.h), and
 * decoded per call: each thread takes strips of 16 output features, writes the strip's levels
 * as bytes (Q4_K/Q5_K/legacy 4- and 5-bit: unsigned 0..31; Q8_0: signed; Q6_K: q - 32,
 * signed) in the B-tile form (rows of 4 consecutive inputs of the 16 features, 8 rows per
 * block of 32 inputs) with the scales of every block (d_c, and the offset o_c per unit of the
 * block's x sum: -dmin m for Q4_K/Q5_K, -8 d / -16 d for Q4_0 / Q5_0, m for Q4_1 / Q5_1, 0
 * for Q8_0; Q6_K: d sc of each 16-input half), then runs every 16-row tile of x against it:
 * per block of 32 inputs one TDPBSUD (signed x, unsigned levels) or TDPBSSD (Q6_K: two, one
 * per 16-input half), the exact int32 dot products of the tile, and in float32
 *   acc += dot_c * (d_c * dx_c) + o_c * sx_c          (c in order; Q6_K: both halves' dots)
 * so the result equals the float32 product of the dequantized operands up to rounding, as the
 * VNNI kernel's does (with its own order of float additions: the two kernels agree to float
 * rounding, not to the bit). Decoding a strip costs about one row tile's work, so the kernel
 * is for steps of tens of rows or more; rows are padded to 16 with zero blocks (their outputs
 * are not written). Threads share nothing but the quantized x. Needs AMX-INT8 and AVX-512
 * BW/VNNI (the build fails without them, and the kernel is then not offered); amx_enable asks
 * Linux for the tile state (linear_amx.c does the same for its process).
 */
#define _GNU_SOURCE   /* syscall() */
#include <immintrin.h>
#include <omp.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <sys/syscall.h>
#include <unistd.h>

#include "k_quant_blocks.h"
#include "packed_blocks.h"
#include "q8_rows.h"

#if !defined(__AMX_TILE__) || !defined(__AMX_INT8__) || !defined(__AVX512BW__) || \
    !defined(__AVX512VNNI__)
#error "linear_q8act_amx needs AMX-INT8 and AVX-512 BW and VNNI"
#endif

#define STRIP 16       /* output features per strip (one C tile's columns) */
#define ROWS 16        /* rows of x per tile */
#define M_BLOCK 256    /* rows whose quantized x a strip's decoded weights serve at once */
#define B_BLOCK 512    /* bytes of one block of 32 inputs of a strip in B form */

enum { OK = 0, ERR_SHAPE = 1, ERR_ALLOC = 2, ERR_UNAVAILABLE = 3 };
/* tiles (numbers, as the tile intrinsics paste them into the instruction) */
#define C0 0
#define C1 1
#define A32 2
#define B8 3
#define A16 4
#define B4 5
#define C2 6
#define C3 7

#define ARCH_REQ_XCOMP_PERM 0x1023
#define XFEATURE_XTILEDATA 18

int amx_enable(void) {
    return syscall(SYS_arch_prctl, ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA) == 0
               ? OK : ERR_UNAVAILABLE;
}

typedef struct {
    uint8_t palette_id, start_row, reserved[14];
    uint16_t colsb[16];
    uint8_t rows[16];
} __attribute__((packed)) TileConfig;

/* C tiles 16 x 16 int32; A32: 16 rows x 32 inputs; B8: their 8 rows of 4 inputs x 16
 * features; A16 / B4: the same for 16 inputs (Q6_K's halves). */
static void configure_tiles(void) {
    TileConfig cfg;
    memset(&cfg, 0, sizeof cfg);
    cfg.palette_id = 1;
    const int tiles[4] = {C0, C1, C2, C3};
    for (int i = 0; i < 4; i++) { cfg.rows[tiles[i]] = 16; cfg.colsb[tiles[i]] = 64; }
    cfg.rows[A32] = 16; cfg.colsb[A32] = 32;
    cfg.rows[B8] = 8;   cfg.colsb[B8] = 64;
    cfg.rows[A16] = 16; cfg.colsb[A16] = 16;
    cfg.rows[B4] = 4;   cfg.colsb[B4] = 64;
    _tile_loadconfig(&cfg);
}

/* One row's levels (32 bytes a block, blocks in order, `lv`) and the scales of its blocks into
 * column n of the strip's tables: s0[c * 16 + n] = d_c, s1[c * 16 + n] = o_c (Q6_K: the two
 * halves' d sc). */
static void decode_row(const uint8_t *wr, int64_t nb, int qtype, uint8_t *lv, float *s0,
                       float *s1, int n) {
    const __m256i nib = _mm256_set1_epi8(0x0f);
    if (qtype == Q4_K || qtype == Q5_K) {
        const int64_t sbb = block_bytes(qtype);
        const __m256i one = _mm256_set1_epi8(1);
        for (int64_t s = 0; s < nb / 8; s++) {
            const uint8_t *sb = wr + s * sbb;
            float ds[8], os[8];
            k_quant_block_scales(sb, qtype, ds, os);
            const __m256i qh = _mm256_loadu_si256((const __m256i *)(sb + 16));
            for (int p = 0; p < 4; p++) {
                const __m256i q = _mm256_loadu_si256(
                    (const __m256i *)(sb + (qtype == Q5_K ? 48 : 16) + 32 * p));
                __m256i lo = _mm256_and_si256(q, nib);
                __m256i hi = _mm256_and_si256(_mm256_srli_epi16(q, 4), nib);
                if (qtype == Q5_K) {
                    const __m256i h0 = _mm256_and_si256(_mm256_srl_epi16(qh, _mm_cvtsi32_si128(2 * p)), one);
                    const __m256i h1 = _mm256_and_si256(_mm256_srl_epi16(qh, _mm_cvtsi32_si128(2 * p + 1)), one);
                    lo = _mm256_or_si256(lo, _mm256_slli_epi16(h0, 4));
                    hi = _mm256_or_si256(hi, _mm256_slli_epi16(h1, 4));
                }
                _mm256_storeu_si256((__m256i *)(lv + (8 * s + 2 * p) * QK), lo);
                _mm256_storeu_si256((__m256i *)(lv + (8 * s + 2 * p + 1) * QK), hi);
            }
            for (int j = 0; j < 8; j++) {
                s0[(8 * s + j) * STRIP + n] = ds[j];
                s1[(8 * s + j) * STRIP + n] = os[j];
            }
        }
        return;
    }
    if (qtype == Q6_K) {
        const __m256i three = _mm256_set1_epi8(3), bias = _mm256_set1_epi8(32);
        for (int64_t s = 0; s < nb / 8; s++) {
            const uint8_t *sb = wr + s * block_bytes(Q6_K);
            const float d = f16_to_f32(sb + 208);
            const int8_t *sc = (const int8_t *)(sb + 192);
            for (int j = 0; j < 8; j++) {
                const int h = j >> 2, i = j & 3;
                const __m256i ql = _mm256_loadu_si256((const __m256i *)(sb + 64 * h + 32 * (i & 1)));
                const __m256i qh = _mm256_loadu_si256((const __m256i *)(sb + 128 + 32 * h));
                const __m256i low = _mm256_and_si256(_mm256_srl_epi16(ql, _mm_cvtsi32_si128(4 * (i >> 1))), nib);
                const __m256i high = _mm256_and_si256(_mm256_srl_epi16(qh, _mm_cvtsi32_si128(2 * i)), three);
                const __m256i q = _mm256_sub_epi8(_mm256_or_si256(low, _mm256_slli_epi16(high, 4)), bias);
                _mm256_storeu_si256((__m256i *)(lv + (8 * s + j) * QK), q);
                s0[(8 * s + j) * STRIP + n] = d * (float)sc[8 * h + 2 * i];
                s1[(8 * s + j) * STRIP + n] = d * (float)sc[8 * h + 2 * i + 1];
            }
        }
        return;
    }
    const int64_t bb = block_bytes(qtype);
    const int five = qtype == Q5_0 || qtype == Q5_1;
    const int64_t qoff = qtype == Q4_0 ? 2 : qtype == Q4_1 ? 4 : qtype == Q5_0 ? 6 : 8;
    for (int64_t c = 0; c < nb; c++) {
        const uint8_t *b = wr + c * bb;
        const float d = f16_to_f32(b);
        float o = 0.f;
        if (qtype == Q8_0) {
            memcpy(lv + c * QK, b + 2, QK);
        } else {   /* weight j < 16: low nibble of byte j, j + 16: its high nibble */
            const __m128i q = _mm_loadu_si128((const __m128i *)(b + qoff));
            __m256i v = _mm256_and_si256(
                _mm256_set_m128i(_mm_srli_epi16(q, 4), q), nib);
            if (five) {
                uint32_t qh;
                memcpy(&qh, b + (qtype == Q5_0 ? 2 : 4), 4);
                v = _mm256_mask_add_epi8(v, (__mmask32)qh, v, _mm256_set1_epi8(16));
            }
            _mm256_storeu_si256((__m256i *)(lv + c * QK), v);
            o = qtype == Q4_0 ? -8.f * d : qtype == Q5_0 ? -16.f * d : f16_to_f32(b + 2);
        }
        s0[c * STRIP + n] = d;
        s1[c * STRIP + n] = o;
    }
}

/* r[i] (row i of a 16 x 16 matrix of 32-bit words) becomes column i. */
static inline void transpose16(__m512i r[16]) {
    __m512i t[16], u[16];
    for (int i = 0; i < 16; i += 2) {
        t[i] = _mm512_unpacklo_epi32(r[i], r[i + 1]);
        t[i + 1] = _mm512_unpackhi_epi32(r[i], r[i + 1]);
    }
    for (int i = 0; i < 16; i += 4) {
        u[i] = _mm512_unpacklo_epi64(t[i], t[i + 2]);
        u[i + 1] = _mm512_unpackhi_epi64(t[i], t[i + 2]);
        u[i + 2] = _mm512_unpacklo_epi64(t[i + 1], t[i + 3]);
        u[i + 3] = _mm512_unpackhi_epi64(t[i + 1], t[i + 3]);
    }
    /* u[4q + j]: column 4g + j of rows 4q .. 4q + 3 in its 128-bit lane group g */
    for (int j = 0; j < 4; j++) {
        const __m512i a = _mm512_shuffle_i32x4(u[j], u[4 + j], 0x88);       /* g0,g2 | g0,g2 */
        const __m512i b = _mm512_shuffle_i32x4(u[j], u[4 + j], 0xdd);       /* g1,g3 | g1,g3 */
        const __m512i c = _mm512_shuffle_i32x4(u[8 + j], u[12 + j], 0x88);
        const __m512i e = _mm512_shuffle_i32x4(u[8 + j], u[12 + j], 0xdd);
        r[j] = _mm512_shuffle_i32x4(a, c, 0x88);        /* column j */
        r[8 + j] = _mm512_shuffle_i32x4(a, c, 0xdd);    /* column 8 + j */
        r[4 + j] = _mm512_shuffle_i32x4(b, e, 0x88);    /* column 4 + j */
        r[12 + j] = _mm512_shuffle_i32x4(b, e, 0xdd);   /* column 12 + j */
    }
}

/* The levels of a strip (16 rows of lv, `lv_stride` bytes apart) in B form: for blocks
 * 2p, 2p + 1, the 16 B rows of 4 inputs x 16 features, B_BLOCK bytes a block. */
static void to_b_form(const uint8_t *lv, int64_t lv_stride, int64_t nb, uint8_t *bform) {
    for (int64_t c = 0; c < nb; c += 2) {
        __m512i r[16];
        for (int n = 0; n < 16; n++)
            r[n] = _mm512_loadu_si512((const void *)(lv + n * lv_stride + c * QK));
        transpose16(r);
        for (int i = 0; i < 16; i++) _mm512_storeu_si512((void *)(bform + c * B_BLOCK + i * 64), r[i]);
    }
}

/* A thread's buffers for one strip: levels row-major (16 x nb2 blocks), their B form, the
 * scale tables, and the C tiles' stores. */
typedef struct {
    uint8_t *lv, *bform;
    float *s0, *s1;
    int32_t *cbuf;   /* 4 tiles of 16 x 16 */
} Strip;

/* acc[i] (16 features of row i) += dot * (s * dx_i) (+ o * sx_i) for the tile's 16 rows. */
INLINE void scale_add(const int32_t *cb, __m512 s, const __m512 *o, const QRow *xr, int64_t c,
                      __m512 acc[ROWS]) {
    for (int i = 0; i < ROWS; i++) {
        const __m512 sd = _mm512_mul_ps(s, _mm512_set1_ps(xr[i].dx[c]));
        acc[i] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_load_si512((const void *)(cb + 16 * i))),
                                 sd, acc[i]);
        if (o) acc[i] = _mm512_fmadd_ps(*o, _mm512_set1_ps(xr[i].sx[c]), acc[i]);
    }
}

/* Rows xr[0 .. 15] (quantized, `stride` bytes apart from xr[0].xq) against the decoded strip. */
static void tile_rows(const QRow *xr, int64_t stride, int64_t nb, int qtype, const Strip *st,
                      __m512 acc[ROWS]) {
    for (int i = 0; i < ROWS; i++) acc[i] = _mm512_setzero_ps();
    const int8_t *xa = xr[0].xq;
    if (qtype == Q6_K) {
        for (int64_t c = 0; c < nb; c++) {
            const int even = (c & 1) == 0;
            int32_t *cb = st->cbuf + (even ? 0 : 512);
            const uint8_t *b = st->bform + c * B_BLOCK;
            if (even) {
                _tile_zero(C0);
                _tile_zero(C1);
                _tile_loadd(A16, xa + c * QK, stride);
                _tile_loadd(B4, b, 64);
                _tile_dpbssd(C0, A16, B4);
                _tile_loadd(A16, xa + c * QK + 16, stride);
                _tile_loadd(B4, b + 256, 64);
                _tile_dpbssd(C1, A16, B4);
                _tile_stored(C0, cb, 64);
                _tile_stored(C1, cb + 256, 64);
            } else {
                _tile_zero(C2);
                _tile_zero(C3);
                _tile_loadd(A16, xa + c * QK, stride);
                _tile_loadd(B4, b, 64);
                _tile_dpbssd(C2, A16, B4);
                _tile_loadd(A16, xa + c * QK + 16, stride);
                _tile_loadd(B4, b + 256, 64);
                _tile_dpbssd(C3, A16, B4);
                _tile_stored(C2, cb, 64);
                _tile_stored(C3, cb + 256, 64);
            }
            scale_add(cb, _mm512_loadu_ps(st->s0 + c * STRIP), NULL, xr, c, acc);
            scale_add(cb + 256, _mm512_loadu_ps(st->s1 + c * STRIP), NULL, xr, c, acc);
        }
        return;
    }
    const int has_offset = qtype != Q8_0;
    for (int64_t c = 0; c < nb; c++) {
        const int even = (c & 1) == 0;
        int32_t *cb = st->cbuf + (even ? 0 : 512);
        _tile_loadd(A32, xa + c * QK, stride);
        _tile_loadd(B8, st->bform + c * B_BLOCK, 64);
        if (even) {
            _tile_zero(C0);
            if (qtype == Q8_0) _tile_dpbssd(C0, A32, B8);
            else _tile_dpbsud(C0, A32, B8);
            _tile_stored(C0, cb, 64);
        } else {
            _tile_zero(C1);
            if (qtype == Q8_0) _tile_dpbssd(C1, A32, B8);
            else _tile_dpbsud(C1, A32, B8);
            _tile_stored(C1, cb, 64);
        }
        const __m512 o = _mm512_loadu_ps(st->s1 + c * STRIP);
        scale_add(cb, _mm512_loadu_ps(st->s0 + c * STRIP), has_offset ? &o : NULL, xr, c, acc);
    }
}

/* Returns 0; 1 on a bad format or K; 2 when scratch memory cannot be allocated; 3 when the
 * tile state is not granted (amx_enable failed or was not called). */
int linear_q8act_amx_f32(const float *x, int64_t M, int64_t K, const uint8_t *w, int64_t N,
                         int qtype, const float *bias, float *out) {
    if (block_bytes(qtype) == 0 || K <= 0 || K % block_weights(qtype) != 0 || M < 0 || N < 0)
        return ERR_SHAPE;
    if (M == 0 || N == 0) return OK;
    if (amx_enable() != OK) return ERR_UNAVAILABLE;
    const int64_t nb = K / QK, nb2 = round_up(nb, 2);
    const int64_t row = K / block_weights(qtype) * block_bytes(qtype);
    const int64_t padded = round_up(M, ROWS);
    Q8Rows q;
    if (q8_rows_alloc(&q, padded, nb)) return ERR_ALLOC;
    const int nt = omp_get_max_threads() > 0 ? omp_get_max_threads() : 1;
    const size_t lv_bytes = (size_t)STRIP * nb2 * QK, table = (size_t)nb2 * STRIP * sizeof(float);
    const size_t per_thread = 2 * lv_bytes + 2 * table + 4 * 256 * sizeof(int32_t);
    uint8_t *buffers = aligned_alloc(64, per_thread * (size_t)nt);
    if (!buffers) { q8_rows_free(&q); return ERR_ALLOC; }
#pragma omp parallel for schedule(static) if (M > 1)
    for (int64_t i = 0; i < M; i++) quantize_row(x + i * K, nb, 0, q.rows[i]);
    const int64_t strips = (N + STRIP - 1) / STRIP;
#pragma omp parallel
    {
        configure_tiles();
        uint8_t *mine = buffers + per_thread * (size_t)omp_get_thread_num();
        Strip st = {.lv = mine, .bform = mine + lv_bytes,
                    .s0 = (float *)(mine + 2 * lv_bytes),
                    .s1 = (float *)(mine + 2 * lv_bytes + table),
                    .cbuf = (int32_t *)(mine + 2 * lv_bytes + 2 * table)};
        memset(st.lv, 0, lv_bytes);   /* an odd block count's last pair and absent features */
        memset(st.s0, 0, 2 * table);
        for (int64_t mb = 0; mb < M; mb += M_BLOCK) {   /* its quantized x stays in L2 */
            const int64_t mb_end = mb + M_BLOCK < M ? mb + M_BLOCK : M;
#pragma omp for schedule(static)
            for (int64_t s = 0; s < strips; s++) {
                const int64_t n0 = s * STRIP;
                const int nr = (int)(N - n0 < STRIP ? N - n0 : STRIP);
                for (int n = 0; n < nr; n++)
                    decode_row(w + (n0 + n) * row, nb, qtype, st.lv + n * nb2 * QK, st.s0,
                               st.s1, n);
                if (nr < STRIP) {   /* features past N: zero levels and scales */
                    memset(st.lv + nr * nb2 * QK, 0, (size_t)(STRIP - nr) * nb2 * QK);
                    for (int64_t c = 0; c < nb2; c++)
                        for (int n = nr; n < STRIP; n++)
                            st.s0[c * STRIP + n] = st.s1[c * STRIP + n] = 0.f;
                }
                to_b_form(st.lv, nb2 * QK, nb2, st.bform);
                const __mmask16 keep = (__mmask16)((1u << nr) - 1);
                const __m512 b = bias ? _mm512_maskz_loadu_ps(keep, bias + n0) : _mm512_setzero_ps();
                for (int64_t m0 = mb; m0 < mb_end; m0 += ROWS) {
                    __m512 acc[ROWS];
                    tile_rows(q.rows + m0, (int64_t)q.per_row, nb, qtype, &st, acc);
                    const int64_t rows = M - m0 < ROWS ? M - m0 : ROWS;
                    for (int64_t i = 0; i < rows; i++)
                        _mm512_mask_storeu_ps(out + (m0 + i) * N + n0, keep,
                                              _mm512_add_ps(acc[i], b));
                }
            }
        }
        _tile_release();
    }
    free(buffers);
    q8_rows_free(&q);
    return OK;
}
