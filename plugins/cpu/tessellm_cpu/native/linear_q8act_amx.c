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
#define _GNU_SOURCE   /* syscall() in amx_strips.h */
#include <immintrin.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "amx_strips.h"
#include "q8_rows.h"
#include "team.h"

#if !defined(__AMX_TILE__) || !defined(__AMX_INT8__) || !defined(__AVX512BW__) || \
    !defined(__AVX512VNNI__)
#error "linear_q8act_amx needs AMX-INT8 and AVX-512 BW and VNNI"
#endif

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

/* C tiles 16 x 16 int32; A32: 16 rows x 32 inputs; B8: their 8 rows of 4 inputs x 16
 * features; A16 / B4: the same for 16 inputs (Q6_K's halves). */
static const uint8_t TILE_ROWS[8] = {16, 16, 16, 8, 16, 4, 16, 16};
static const uint16_t TILE_COLSB[8] = {64, 64, 32, 64, 16, 64, 64, 64};

/* 0, or 3 when Linux refuses this process the tile state (called once at load). */
int amx_enable(void) { return amx_request_tiles(); }

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

/* Rows m0 .. m0 + 15 of the quantized x (a Q8Rows) against the decoded strip. */
static void tile_rows(const void *rows, int64_t m0, int64_t nb, int qtype, const Strip *st,
                      __m512 acc[ROWS]) {
    const Q8Rows *q = rows;
    const QRow *xr = q->rows + m0;
    const int64_t stride = (int64_t)q->per_row;
    for (int i = 0; i < ROWS; i++) acc[i] = _mm512_setzero_ps();
    const int8_t *xa = xr[0].xq;
    if (qtype == Q6_K) {
        for (int64_t c = 0; c < nb; c++) {
            const int even = (c & 1) == 0;
            int32_t *cb = (int32_t *)st->cbuf + (even ? 0 : 512);
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
        int32_t *cb = (int32_t *)st->cbuf + (even ? 0 : 512);
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

/* The linear's arguments (team.h; the layout of linear_q8act.c's plus `threads`). scratch:
 * the rounded rows of x padded to 16 (rows past M zero), their QRow records, then every
 * thread's strip buffers. */
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
} Q8ActAmxArgs;

static StripShape shape_of(const Q8ActAmxArgs *a) {
    return (StripShape){.M = a->M, .N = a->N, .nb = a->K / QK,
                        .row = a->K / block_weights(a->qtype) * block_bytes(a->qtype),
                        .qtype = a->qtype, .b_block = B_BLOCK, .m_block = M_BLOCK};
}

int64_t linear_q8act_amx_scratch(const Q8ActAmxArgs *a) {
    if (a->M <= 0 || a->K <= 0 || block_bytes(a->qtype) == 0) return 0;
    const StripShape sh = shape_of(a);
    const size_t per_row = q8_row_stride(sh.nb);
    const size_t padded = (size_t)round_up(a->M, ROWS);
    return (int64_t)(round64((per_row + sizeof(QRow)) * padded)
                     + strip_buffer_bytes(&sh) * (size_t)a->threads);
}

/* Returns 0; 1 on a bad format or K; 2 when the scratch is for fewer threads than the team
 * has; 3 when the tile state is not granted (amx_enable failed or was not called). */
int linear_q8act_amx_team(const Q8ActAmxArgs *a) {
    const int qtype = a->qtype;
    const int64_t M = a->M, K = a->K;
    if (block_bytes(qtype) == 0 || K <= 0 || K % block_weights(qtype) != 0 || M < 0 || a->N < 0)
        return ERR_SHAPE;
    if (M == 0 || a->N == 0) return OK;
    if (amx_request_tiles() != OK) return ERR_UNAVAILABLE;
    if (omp_get_num_threads() > a->threads) return ERR_ALLOC;
    const StripShape sh = shape_of(a);
    const int64_t nb = sh.nb, padded = round_up(M, ROWS);
    const size_t per_row = q8_row_stride(nb);
    uint8_t *base = a->scratch;
    QRow *rows = (QRow *)(base + per_row * (size_t)padded);
    Q8Rows q = {.scratch = base, .rows = rows, .per_row = per_row};
#pragma omp for schedule(static)
    for (int64_t i = 0; i < padded; i++) {
        rows[i] = q8_row_at(base, nb, i);
        if (i < M) quantize_row(a->x + i * K, nb, Q8_ORDER, rows[i]);
        else memset(rows[i].xq, 0, per_row);   /* padding rows: d = 0, q = 0 */
    }
    run_strips_team(&sh, a->w, a->bias, a->out, TILE_ROWS, TILE_COLSB, to_b_form, tile_rows, &q,
                    base + round64((per_row + sizeof(QRow)) * (size_t)padded));
    return OK;
}

/* An eager call: the team codes, or 2 when scratch memory cannot be allocated. */
int linear_q8act_amx_run(Q8ActAmxArgs *a) {
    a->threads = team_threads();
    return TEAM_RUN_WITH_SCRATCH(linear_q8act_amx_team, a, linear_q8act_amx_scratch(a),
                                 a->threads, 0, ERR_ALLOC);
}
