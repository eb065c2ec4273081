/* A strip of 16 output features of packed GGML weights decoded for AMX tiles, shared by the
 * CPU plugin's AMX linears over packed weights (linear_q8act_amx.c: int8 tiles,
 * linear_packed_amx.c: bfloat16 tiles; part of their cache keys). decode_row writes one
 * feature's levels as bytes, 32 a block in input order (Q4_K/Q5_K/legacy 4- and 5-bit:
 * unsigned 0..31; Q8_0: signed; Q6_K: q - 32, signed) and the scales of its blocks into a
 * strip's tables (column n); transpose16 turns 16 rows of 16 words into columns, the step
 * from a strip's rows to a B tile's rows of input groups x features; run_strips is the loop
 * both kernels share (strips of the weight over threads, 16-row tiles of x against each).
 * amx_request_tiles asks Linux for the tile state for this process. Needs AMX and AVX-512
 * BW. */
#ifndef TESSELLM_AMX_STRIPS_H
#define TESSELLM_AMX_STRIPS_H
#include <immintrin.h>
#include <omp.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <sys/syscall.h>
#include <unistd.h>

#include "k_quant_blocks.h"
#include "packed_blocks.h"

#define STRIP 16       /* output features per strip (one C tile's columns) */

#define ARCH_REQ_XCOMP_PERM 0x1023
#define XFEATURE_XTILEDATA 18

/* 0, or 3 when Linux refuses the tile state. */
static inline int amx_request_tiles(void) {
    return syscall(SYS_arch_prctl, ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA) == 0 ? 0 : 3;
}

typedef struct {
    uint8_t palette_id, start_row, reserved[14];
    uint16_t colsb[16];
    uint8_t rows[16];
} __attribute__((packed)) TileConfig;

/* The tile shapes (rows, bytes per row) of tiles 0..7, loaded for this thread. */
static inline void configure_tiles(const uint8_t rows[8], const uint16_t colsb[8]) {
    TileConfig cfg;
    memset(&cfg, 0, sizeof cfg);
    cfg.palette_id = 1;
    for (int i = 0; i < 8; i++) { cfg.rows[i] = rows[i]; cfg.colsb[i] = colsb[i]; }
    _tile_loadconfig(&cfg);
}

/* One row's levels (32 bytes a block, blocks in order, `lv`) and the scales of its blocks into
 * column n of the strip's tables: s0[c * 16 + n] = d_c, s1[c * 16 + n] = o_c (Q6_K: the two
 * halves' d sc). */
static inline void decode_row(const uint8_t *wr, int64_t nb, int qtype, uint8_t *lv, float *s0,
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


/* A thread's buffers for one strip: levels row-major (16 x nb2 blocks of 32 bytes), their B
 * form, the scale tables (nb2 x 16 each) and the C tiles' stores (4 tiles of 16 x 16 words). */
typedef struct {
    uint8_t *lv, *bform;
    float *s0, *s1;
    void *cbuf;
} Strip;

/* What run_strips multiplies: x has M rows (prepared by the kernel), the weight N rows of
 * `row` bytes holding nb blocks of 32 of GGML type qtype; a block is b_block bytes in the
 * kernel's B form; x is taken m_block rows at a time (what stays in L2). */
typedef struct {
    int64_t M, N, nb, row;
    int qtype;
    int64_t b_block, m_block;
} StripShape;

/* The kernel's B form of a strip's levels (16 rows of lv, lv_stride bytes apart, nb2 blocks). */
typedef void (*StripToB)(const uint8_t *lv, int64_t lv_stride, int64_t nb2, uint8_t *bform);
/* acc[i] = output features of the strip for row m0 + i of the kernel's prepared x (`rows`),
 * i < 16 (rows past M are zero padding). */
typedef void (*StripTile)(const void *rows, int64_t m0, int64_t nb, int qtype, const Strip *st,
                          __m512 acc[16]);

static inline size_t round64(size_t v) { return (v + 63) / 64 * 64; }

/* The levels and scales of weight rows n0 .. n0 + nr - 1 into the strip; rows past nr zero. */
static inline void decode_strip(const uint8_t *w, const StripShape *sh, int64_t nb2, int64_t n0,
                                int nr, Strip *st) {
    for (int n = 0; n < nr; n++)
        decode_row(w + (n0 + n) * sh->row, sh->nb, sh->qtype, st->lv + n * nb2 * QK, st->s0,
                   st->s1, n);
    if (nr < STRIP) {   /* features past N: zero levels and scales */
        memset(st->lv + nr * nb2 * QK, 0, (size_t)(STRIP - nr) * nb2 * QK);
        for (int64_t c = 0; c < nb2; c++)
            for (int n = nr; n < STRIP; n++) st->s0[c * STRIP + n] = st->s1[c * STRIP + n] = 0.f;
    }
}

/* Bytes of one thread's strip buffers (levels, B form, scale tables, C buffer). */
static inline size_t strip_buffer_bytes(const StripShape *sh) {
    const int64_t nb2 = (sh->nb + 1) / 2 * 2;
    return round64((size_t)STRIP * nb2 * QK) + round64((size_t)nb2 * sh->b_block)
         + 2 * round64((size_t)nb2 * STRIP * sizeof(float)) + 4 * 256 * 4;
}

/* out[M, N] = the tiles' sums (+ bias), run by every thread of a team (team.h): each thread
 * decodes its strips of 16 features (per block of m_block rows) into its own buffers
 * (`buffers`, strip_buffer_bytes each, indexed by thread) and runs the 16-row tiles of x
 * against them. */
static inline void run_strips_team(const StripShape *sh, const uint8_t *w, const float *bias,
                                   float *out, const uint8_t tile_rows[8],
                                   const uint16_t tile_colsb[8], StripToB to_b_form,
                                   StripTile tile, const void *rows, uint8_t *buffers) {
    const int64_t nb2 = (sh->nb + 1) / 2 * 2, strips = (sh->N + STRIP - 1) / STRIP;
    const size_t lv_bytes = round64((size_t)STRIP * nb2 * QK);
    const size_t b_bytes = round64((size_t)nb2 * sh->b_block);
    const size_t table = round64((size_t)nb2 * STRIP * sizeof(float));
    configure_tiles(tile_rows, tile_colsb);
    uint8_t *mine = buffers + strip_buffer_bytes(sh) * (size_t)omp_get_thread_num();
    Strip st = {.lv = mine, .bform = mine + lv_bytes,
                .s0 = (float *)(mine + lv_bytes + b_bytes),
                .s1 = (float *)(mine + lv_bytes + b_bytes + table),
                .cbuf = mine + lv_bytes + b_bytes + 2 * table};
    memset(st.lv, 0, lv_bytes);   /* an odd block count's last pair stays zero */
    for (int64_t mb = 0; mb < sh->M; mb += sh->m_block) {
        const int64_t mb_end = mb + sh->m_block < sh->M ? mb + sh->m_block : sh->M;
#pragma omp for schedule(static) nowait
        for (int64_t s = 0; s < strips; s++) {
            const int64_t n0 = s * STRIP;
            const int nr = (int)(sh->N - n0 < STRIP ? sh->N - n0 : STRIP);
            decode_strip(w, sh, nb2, n0, nr, &st);
            to_b_form(st.lv, nb2 * QK, nb2, st.bform);
            const __mmask16 keep = (__mmask16)((1u << nr) - 1);
            const __m512 b = bias ? _mm512_maskz_loadu_ps(keep, bias + n0)
                                  : _mm512_setzero_ps();
            for (int64_t m0 = mb; m0 < mb_end; m0 += 16) {
                __m512 acc[16];
                tile(rows, m0, sh->nb, sh->qtype, &st, acc);
                const int64_t m = sh->M - m0 < 16 ? sh->M - m0 : 16;
                for (int64_t i = 0; i < m; i++)
                    _mm512_mask_storeu_ps(out + (m0 + i) * sh->N + n0, keep,
                                          _mm512_add_ps(acc[i], b));
            }
        }
    }
    _tile_release();
}

#endif
