/* bfloat16 linear y = x @ W^T (+ bias) on AMX tiles, for the tessellm CPU plugin.
 *
 * The weight [N, K] is packed once (amx_pack_bf16) into the B-tile form TDPBF16PS reads
 * (bf16_pair_tiles.h): for each strip of 32 output features and each block of 32 inputs, two
 * 16 x 64-byte tiles. A strip's blocks are contiguous, so a thread streams its strips front
 * to back.
 *
 * amx_linear_bf16_team (team.h; amx_linear_bf16_run for an eager call): x [M, K] contiguous
 * bfloat16, y [M, N] bfloat16, float32 sums, the bias
 * (bfloat16, or NULL) added in float32 before the one rounding to nearest even. Rows go in
 * groups of 32 (two A tiles; a group of at most 16 rows uses one), a group against a strip
 * in four float32 C tiles; the last partial group is read from a zero-padded copy. Rows are
 * taken in blocks whose x fits in L2 (x_block_rows), every thread walks its own contiguous
 * range of strips for each block and prefetches the strip data a few KiB ahead on the first
 * group of a block (later groups find it in L2). Threads share nothing past the padded copy
 * (made by one thread, then a barrier); each configures its tiles on entry and releases them
 * on exit. K and N must be multiples of 32 (AMX_ERR_SHAPE otherwise); the padded copy and the
 * many-rows path's sums live in the caller's scratch (amx_linear_bf16_scratch bytes).
 *
 * amx_enable asks Linux for the AMX tile state (arch_prctl ARCH_REQ_XCOMP_PERM) for this
 * process; without it the first tile instruction faults. AMX_ERR_UNAVAILABLE when the build
 * has no AMX (the compiler's -march=native did not report it) or the kernel refuses.
 */
#define _GNU_SOURCE   /* syscall() */
#include <omp.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "bf16_pair_tiles.h"
#include "prefetch.h"
#include "team.h"

#if defined(__AMX_TILE__) && defined(__AMX_BF16__) && defined(__AVX512BF16__)
#include <immintrin.h>
#include <sys/syscall.h>
#include <unistd.h>
#define HAVE_AMX 1
#else
#define HAVE_AMX 0
#endif

enum { AMX_OK = 0, AMX_ERR_SHAPE = 1, AMX_ERR_ALLOC = 2, AMX_ERR_UNAVAILABLE = 3 };

#define STRIP PAIR_TILE_STRIP    /* output features per strip (two B tiles) */
#define KBLOCK PAIR_TILE_KBLOCK  /* inputs per tile step */
#define STRIP_BLOCK PAIR_TILE_BLOCK   /* bf16 values of one (strip, k block) */
#define X_BLOCK_BYTES (512 * 1024)
#define FEW_ROWS_MAX 64   /* more rows take the L1-blocked path */

int amx_pack_bf16(const uint16_t *w, int64_t N, int64_t K, uint16_t *packed) {
    return pack_bf16_pair_tiles(w, N, K, packed) ? AMX_ERR_SHAPE : AMX_OK;
}

#if HAVE_AMX
#define ARCH_REQ_XCOMP_PERM 0x1023
#define XFEATURE_XTILEDATA 18

int amx_enable(void) {
    return syscall(SYS_arch_prctl, ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA) == 0
               ? AMX_OK : AMX_ERR_UNAVAILABLE;
}

typedef struct {
    uint8_t palette_id, start_row, reserved[14];
    uint16_t colsb[16];
    uint8_t rows[16];
} __attribute__((packed)) TileConfig;

/* Tiles 0-3: float32 C (16 x 16); 4-5: A (16 rows x 32 bf16); 6-7: B (16 pair rows x 16). */
static void configure_tiles(void) {
    TileConfig cfg;
    memset(&cfg, 0, sizeof cfg);
    cfg.palette_id = 1;
    for (int i = 0; i < 8; ++i) { cfg.colsb[i] = 64; cfg.rows[i] = 16; }
    _tile_loadconfig(&cfg);
}

/* Rows [m0, m0 + rows) of y for one strip from the four C tiles (rows <= 32). */
static inline void store_group(const float *cbuf, int64_t rows, const uint16_t *bias,
                               uint16_t *y, int64_t N) {
    __m512 b0 = _mm512_setzero_ps(), b1 = b0;
    if (bias) {
        b0 = _mm512_castsi512_ps(_mm512_slli_epi32(
            _mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)bias)), 16));
        b1 = _mm512_castsi512_ps(_mm512_slli_epi32(
            _mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)(bias + 16))), 16));
    }
    for (int64_t r = 0; r < rows; ++r) {
        const __m256bh lo = _mm512_cvtneps_pbh(_mm512_add_ps(_mm512_load_ps(cbuf + r * 32), b0));
        const __m256bh hi = _mm512_cvtneps_pbh(
            _mm512_add_ps(_mm512_load_ps(cbuf + r * 32 + 16), b1));
        _mm256_storeu_si256((__m256i *)(y + r * N), (__m256i)lo);
        _mm256_storeu_si256((__m256i *)(y + r * N + 16), (__m256i)hi);
    }
}

/* Few rows (decode): each (row group, strip) runs its whole K in the C tiles. */
static void linear_few_rows(const uint16_t *x, const uint16_t *pad, int64_t M, int64_t K,
                            const uint16_t *packed, int64_t N, const uint16_t *bias,
                            uint16_t *y) {
    const int64_t strips = N / STRIP, kbs = K / KBLOCK, full = M / 32 * 32;
    int64_t block_rows = X_BLOCK_BYTES / (K * 2) / 32 * 32;
    block_rows = block_rows < 32 ? 32 : block_rows;
    {
        configure_tiles();
        float cbuf[32 * 32] __attribute__((aligned(64)));
        const int nt = omp_get_num_threads(), tid = omp_get_thread_num();
        const int64_t s0 = strips * tid / nt, s1 = strips * (tid + 1) / nt;
        for (int64_t mb = 0; mb < M; mb += block_rows) {
            const int64_t mb_end = mb + block_rows < M ? mb + block_rows : M;
            for (int64_t s = s0; s < s1; ++s) {
                const uint16_t *bs = packed + s * kbs * STRIP_BLOCK;
                for (int64_t m0 = mb; m0 < mb_end; m0 += 32) {
                    const uint16_t *xa = m0 < full ? x + m0 * K : pad;
                    const int64_t rows = M - m0 < 32 ? M - m0 : 32;
                    const int two = rows > 16;   /* a second A tile has rows in it */
                    _tile_zero(0);
                    _tile_zero(1);
                    _tile_zero(2);
                    _tile_zero(3);
                    for (int64_t kb = 0; kb < kbs; ++kb) {
                        const uint16_t *b = bs + kb * STRIP_BLOCK;
                        if (m0 == mb)   /* the strip streams in once per row block */
                            prefetch_bytes((const char *)b + PREFETCH_BYTES,
                                           STRIP_BLOCK * (int64_t)sizeof(uint16_t));
                        _tile_loadd(4, xa + kb * KBLOCK, K * 2);
                        _tile_loadd(6, b, 64);
                        _tile_loadd(7, b + STRIP_BLOCK / 2, 64);
                        _tile_dpbf16ps(0, 4, 6);
                        _tile_dpbf16ps(1, 4, 7);
                        if (two) {
                            _tile_loadd(5, xa + 16 * K + kb * KBLOCK, K * 2);
                            _tile_dpbf16ps(2, 5, 6);
                            _tile_dpbf16ps(3, 5, 7);
                        }
                    }
                    _tile_stored(0, cbuf, 128);
                    _tile_stored(1, cbuf + 16, 128);
                    if (two) {
                        _tile_stored(2, cbuf + 512, 128);
                        _tile_stored(3, cbuf + 528, 128);
                    }
                    store_group(cbuf, rows, bias ? bias + s * STRIP : NULL,
                                y + m0 * N + s * STRIP, N);
                }
            }
        }
        _tile_release();
    }
}

/* Many rows (prefill): a 2 x 2 tile step loads 4 KiB per 4 TDPBF16PS, more than L2 feeds, so
 * the work is blocked for L1. Each thread takes its strips NC at a time, rows MB at a time,
 * and K in chunks of KC_BLOCKS tile steps: for one row group and K chunk (16 KiB of x, kept
 * in L1) it walks the NC strips (16 KiB of B each, from L2), keeping the float32 sums of every
 * (row group, strip) in a per-thread buffer between K chunks (4 KiB each way per 32 steps). */
#define NC 16          /* strips per thread block */
#define MB 256         /* rows per block */
#define KC_BLOCKS 8    /* tile steps (32 inputs each) per K chunk */
static void linear_many_rows(const uint16_t *x, const uint16_t *pad, int64_t M, int64_t K,
                             const uint16_t *packed, int64_t N, const uint16_t *bias,
                             uint16_t *y, float *acc_all) {
    const int64_t strips = N / STRIP, kbs = K / KBLOCK, full = M / 32 * 32;
    {
        configure_tiles();
        float cbuf[32 * 32] __attribute__((aligned(64)));
        const int nt = omp_get_num_threads(), tid = omp_get_thread_num();
        float *acc = acc_all + (size_t)tid * (MB / 32) * NC * 1024;
        const int64_t s0 = strips * tid / nt, s1 = strips * (tid + 1) / nt;
        for (int64_t n0 = s0; n0 < s1; n0 += NC) {
            const int64_t n1 = n0 + NC < s1 ? n0 + NC : s1;
            for (int64_t mb = 0; mb < M; mb += MB) {
                const int64_t mb_end = mb + MB < M ? mb + MB : M;
                for (int64_t k0 = 0; k0 < kbs; k0 += KC_BLOCKS) {
                    const int64_t k1 = k0 + KC_BLOCKS < kbs ? k0 + KC_BLOCKS : kbs;
                    for (int64_t m0 = mb; m0 < mb_end; m0 += 32) {
                        const uint16_t *xa = m0 < full ? x + m0 * K : pad;
                        const int64_t rows = M - m0 < 32 ? M - m0 : 32;
                        for (int64_t s = n0; s < n1; ++s) {
                            float *cb = acc + (((m0 - mb) / 32) * NC + (s - n0)) * 1024;
                            if (k0 == 0) {
                                _tile_zero(0);
                                _tile_zero(1);
                                _tile_zero(2);
                                _tile_zero(3);
                            } else {
                                _tile_loadd(0, cb, 128);
                                _tile_loadd(1, cb + 16, 128);
                                _tile_loadd(2, cb + 512, 128);
                                _tile_loadd(3, cb + 528, 128);
                            }
                            const uint16_t *bs = packed + s * kbs * STRIP_BLOCK;
                            for (int64_t kb = k0; kb < k1; ++kb) {
                                const uint16_t *b = bs + kb * STRIP_BLOCK;
                                _tile_loadd(4, xa + kb * KBLOCK, K * 2);
                                _tile_loadd(5, xa + 16 * K + kb * KBLOCK, K * 2);
                                _tile_loadd(6, b, 64);
                                _tile_loadd(7, b + STRIP_BLOCK / 2, 64);
                                _tile_dpbf16ps(0, 4, 6);
                                _tile_dpbf16ps(1, 4, 7);
                                _tile_dpbf16ps(2, 5, 6);
                                _tile_dpbf16ps(3, 5, 7);
                            }
                            if (k1 < kbs) {
                                _tile_stored(0, cb, 128);
                                _tile_stored(1, cb + 16, 128);
                                _tile_stored(2, cb + 512, 128);
                                _tile_stored(3, cb + 528, 128);
                                continue;
                            }
                            _tile_stored(0, cbuf, 128);
                            _tile_stored(1, cbuf + 16, 128);
                            _tile_stored(2, cbuf + 512, 128);
                            _tile_stored(3, cbuf + 528, 128);
                            store_group(cbuf, rows, bias ? bias + s * STRIP : NULL,
                                        y + m0 * N + s * STRIP, N);
                        }
                    }
                }
            }
        }
        _tile_release();
    }
}

/* The scratch of a call (PairTileLinearArgs.scratch) holds the zero-padded last row group
 * (when M is not a multiple of 32), then, past FEW_ROWS_MAX rows, every thread's float32
 * sums. */

static int64_t pad_bytes(const PairTileLinearArgs *a) {
    return a->M % 32 ? (32 * a->K * (int64_t)sizeof(uint16_t) + 63) / 64 * 64 : 0;
}

int64_t amx_linear_bf16_scratch(const PairTileLinearArgs *a) {
    if (a->M <= 0 || a->K <= 0) return 0;
    const int64_t acc = a->M > FEW_ROWS_MAX
        ? (int64_t)a->threads * (MB / 32) * NC * 1024 * (int64_t)sizeof(float) : 0;
    return pad_bytes(a) + acc;
}

int amx_linear_bf16_team(const PairTileLinearArgs *a) {
    const int64_t M = a->M, K = a->K, N = a->N;
    if (M < 0 || N <= 0 || K <= 0 || N % STRIP || K % KBLOCK) return AMX_ERR_SHAPE;
    if (M == 0) return AMX_OK;
    if (omp_get_num_threads() > a->threads) return AMX_ERR_ALLOC;   /* scratch is per thread */
    const int64_t full = M / 32 * 32;
    uint16_t *pad = full < M ? a->scratch : NULL;
    float *acc = M > FEW_ROWS_MAX ? (float *)((char *)a->scratch + pad_bytes(a)) : NULL;
    if (pad) {   /* the last partial group of rows, zero-padded to 32 */
#pragma omp single
        {
            memset(pad, 0, (size_t)(32 * K) * sizeof(uint16_t));
            memcpy(pad, a->x + full * K, (size_t)((M - full) * K) * sizeof(uint16_t));
        }
    }
    if (acc) linear_many_rows(a->x, pad, M, K, a->packed, N, a->bias, a->y, acc);
    else linear_few_rows(a->x, pad, M, K, a->packed, N, a->bias, a->y);
    return AMX_OK;
}

/* An eager call: AMX_OK, AMX_ERR_SHAPE, or AMX_ERR_ALLOC when the scratch cannot be had. */
int amx_linear_bf16_run(PairTileLinearArgs *a) {
    a->threads = team_threads();
    return TEAM_RUN_WITH_SCRATCH(amx_linear_bf16_team, a, amx_linear_bf16_scratch(a),
                                 a->threads, 0, AMX_ERR_ALLOC);
}
#else
int amx_enable(void) { return AMX_ERR_UNAVAILABLE; }

int64_t amx_linear_bf16_scratch(const PairTileLinearArgs *a) { (void)a; return 0; }
int amx_linear_bf16_team(const PairTileLinearArgs *a) { (void)a; return AMX_ERR_UNAVAILABLE; }
int amx_linear_bf16_run(PairTileLinearArgs *a) { (void)a; return AMX_ERR_UNAVAILABLE; }
#endif
