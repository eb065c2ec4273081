/* bfloat16 linear y = x @ W^T (+ bias) on AVX-512 BF16 dot products (VDPBF16PS), for the
 * tessellm CPU plugin, where there is no AMX (AMD Zen 4 and later, Intel Cooper Lake).
 *
 * The weight is packed once (bf16dot_pack) into the pair-tile form of bf16_pair_tiles.h, the
 * one the AMX linear reads: a block row is the 16 features' input pairs, so one 64-byte load
 * is a VDPBF16PS operand and x's pair (x[m][2r], x[m][2r + 1]) is a 32-bit broadcast.
 *
 * bf16dot_linear_team (team.h; bf16dot_linear_run for an eager call): x [M, K] contiguous
 * bfloat16, y [M, N] bfloat16, float32 sums, the bias (bfloat16, or NULL) added in float32
 * before the one rounding to nearest even (as the AMX linear and the reference do). A tile is
 * ROWS rows of x against one strip (32 features) over the whole K, its sums in 2 x ROWS
 * registers; the last tile of a row block has fewer rows, each count its own compiled tile.
 * Rows are taken in blocks whose x fits in L2 (BLOCK_BYTES); each thread walks its own
 * contiguous range of strips for each block. While the tiles of a block run against strip s,
 * the thread asks for strip s + 1 (spread over those tiles, a few lines per input block, not
 * in a burst that would fill the line-fill buffers); a block of one tile (decode with few
 * rows) instead reads ahead PREFETCH_BYTES into its own run, which is contiguous.
 *
 * With 9..24 rows (2 or 3 tiles: a serving batch's decode) the tiles instead take each strip
 * in chunks of CHUNK_BLOCKS input blocks (8 KiB), every tile over one chunk before the next,
 * so the tiles after the first read the chunk from L1 rather than the strip from L2; a
 * tile's sums between chunks wait in a float32 array on the stack, and the run CHUNK_AHEAD
 * bytes ahead is asked for into L2, spread over the chunk's tiles. On Zen 4, W1's 48 layer
 * linears with the weights from memory: 12 rows 1.46x, 16 rows 1.2-1.25x, 20 rows 1.15x the
 * whole-strip tiles, equal at 24, behind them from 32 rows on (the one-pass tiles keep the
 * dot products busier; 64 rows: 0.88x).
 *
 * Threads share nothing; no scratch (a->scratch unused), no barrier (the caller's orders the
 * writes). K and N must be multiples of 32 (BF16DOT_ERR_SHAPE otherwise).
 *
 * Why not oneDNN: on Zen 4 its prepacked bf16 linear at 64 rows (W1's decode) runs at ~0.85x
 * of what the same core does with the weights hot; this kernel's spread prefetch keeps the
 * strips ahead of the dot products (W1's 48 layer linears at 64 rows, weights from memory:
 * ~1.1x oneDNN; at 256 rows equal, at 2048 ~0.97x; the profiler picks per bucket and the
 * weight takes one form for all, docs/architecture.md).
 */
#include <omp.h>
#include <stdint.h>

#include "bf16_pair_tiles.h"
#include "prefetch.h"
#include "team.h"

#if defined(__AVX512BF16__) && defined(__AVX512F__)
#include <immintrin.h>
#define HAVE_BF16DOT 1
#else
#define HAVE_BF16DOT 0
#endif

enum { BF16DOT_OK = 0, BF16DOT_ERR_SHAPE = 1, BF16DOT_ERR_UNAVAILABLE = 3 };

#define ROWS 8                      /* rows of x per tile: 16 sums in registers */
#define BLOCK_BYTES (512 * 1024)    /* x rows per block: this many bytes of x */
#define CHUNK_BLOCKS 4              /* input blocks per chunk (8 KiB of a strip) */
#define CHUNK_AHEAD 16384           /* bytes of the run ahead of a chunk asked for into L2 */
#define CHUNKED_MAX_TILES 3         /* row tiles that take strips in chunks (from 2) */

int bf16dot_pack(const uint16_t *w, int64_t N, int64_t K, uint16_t *packed) {
    return pack_bf16_pair_tiles(w, N, K, packed) ? BF16DOT_ERR_SHAPE : BF16DOT_OK;
}

#if HAVE_BF16DOT
int bf16dot_available(void) { return BF16DOT_OK; }

/* The float32 sums of 16 features plus the bias, rounded to bfloat16 into y[0..16). */
static inline void store16(__m512 acc, __m512 bias, uint16_t *y) {
    _mm256_storeu_si256((__m256i *)y, (__m256i)_mm512_cvtneps_pbh(_mm512_add_ps(acc, bias)));
}

static inline __m512 bias16(const uint16_t *bias) {
    if (!bias) return _mm512_setzero_ps();
    return _mm512_castsi512_ps(_mm512_slli_epi32(
        _mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)bias)), 16));
}

/* `rows` (<= ROWS, a constant where inlined) rows of x against blocks b[0..nb) of one strip
 * (x at the first block's inputs, K apart). The sums start at zero when `first`, else from
 * `part` (rows x PAIR_TILE_STRIP float32); when `last` they go to y with the bias, else back to `part`.
 * Per input block it asks for `pf_per` lines from `pf` (pf_lines in all; into L2 when `l2`,
 * else L1), or, when `stream`, the block PREFETCH_BYTES ahead of the one it reads. */
static inline __attribute__((always_inline)) void tile(
        const uint16_t *x, int64_t K, const uint16_t *b, int64_t nb, const int rows,
        float *part, int first, int last, const uint16_t *bias, uint16_t *y, int64_t N,
        int stream, const char *pf, int64_t pf_lines, int l2) {
    const int64_t pf_per = (pf_lines + nb - 1) / nb;
    __m512 acc[ROWS][2];
    for (int i = 0; i < rows; ++i) {
        float *p = part + i * PAIR_TILE_STRIP;
        acc[i][0] = first ? _mm512_setzero_ps() : _mm512_load_ps(p);
        acc[i][1] = first ? _mm512_setzero_ps() : _mm512_load_ps(p + 16);
    }
    for (int64_t kb = 0; kb < nb; ++kb) {
        const uint16_t *bk = b + kb * PAIR_TILE_BLOCK;
        if (stream) {
            prefetch_bytes((const char *)bk + PREFETCH_BYTES,
                           PAIR_TILE_BLOCK * (int64_t)sizeof(uint16_t));
        } else if (pf_lines > 0) {
            const int64_t n = pf_per < pf_lines ? pf_per : pf_lines;
            if (l2) prefetch_bytes_l2(pf, 64 * n);
            else prefetch_bytes(pf, 64 * n);
            pf += 64 * n;
            pf_lines -= n;
        }
        const uint16_t *xk = x + kb * PAIR_TILE_KBLOCK;
        for (int r = 0; r < 16; ++r) {
            const __m512bh w0 = (__m512bh)_mm512_loadu_si512(bk + r * 32);
            const __m512bh w1 = (__m512bh)_mm512_loadu_si512(bk + PAIR_TILE_BLOCK / 2 + r * 32);
            for (int i = 0; i < rows; ++i) {
                const __m512bh xi =
                    (__m512bh)_mm512_set1_epi32(*(const int32_t *)(xk + i * K + 2 * r));
                acc[i][0] = _mm512_dpbf16_ps(acc[i][0], xi, w0);
                acc[i][1] = _mm512_dpbf16_ps(acc[i][1], xi, w1);
            }
        }
    }
    if (last) {
        const __m512 b0 = bias16(bias), b1 = bias16(bias ? bias + 16 : NULL);
        for (int i = 0; i < rows; ++i) {
            store16(acc[i][0], b0, y + i * N);
            store16(acc[i][1], b1, y + i * N + 16);
        }
    } else {
        for (int i = 0; i < rows; ++i) {
            _mm512_store_ps(part + i * PAIR_TILE_STRIP, acc[i][0]);
            _mm512_store_ps(part + i * PAIR_TILE_STRIP + 16, acc[i][1]);
        }
    }
}

/* tile compiled for each row count 1..ROWS. */
static void tile_rows(const uint16_t *x, int64_t K, const uint16_t *b, int64_t nb, int rows,
                      float *part, int first, int last, const uint16_t *bias, uint16_t *y,
                      int64_t N, int stream, const char *pf, int64_t pf_lines, int l2) {
    switch (rows) {
#define TILE(R) case R: tile(x, K, b, nb, R, part, first, last, bias, y, N, stream, pf, \
                             pf_lines, l2); break;
    TILE(1) TILE(2) TILE(3) TILE(4) TILE(5) TILE(6) TILE(7) TILE(8)
#undef TILE
    default: break;
    }
}

/* This thread's strips [s0, s1) for M <= CHUNKED_MAX_TILES * ROWS rows, chunk by chunk. */
static void strips_by_chunks(const PairTileLinearArgs *a, int64_t s0, int64_t s1,
                             int64_t kbs) {
    const int64_t M = a->M, K = a->K, N = a->N, tiles = (M + ROWS - 1) / ROWS;
    float part[CHUNKED_MAX_TILES][ROWS][PAIR_TILE_STRIP] __attribute__((aligned(64)));
    const char *end = (const char *)(a->packed + s1 * kbs * PAIR_TILE_BLOCK);
    for (int64_t s = s0; s < s1; ++s) {
        const uint16_t *bs = a->packed + s * kbs * PAIR_TILE_BLOCK;
        for (int64_t c0 = 0; c0 < kbs; c0 += CHUNK_BLOCKS) {
            const int64_t nb = kbs - c0 < CHUNK_BLOCKS ? kbs - c0 : CHUNK_BLOCKS;
            const uint16_t *b = bs + c0 * PAIR_TILE_BLOCK;
            const char *ahead = (const char *)b + CHUNK_AHEAD;
            int64_t bytes = nb * PAIR_TILE_BLOCK * (int64_t)sizeof(uint16_t);
            if (ahead >= end) bytes = 0;
            else if (end - ahead < bytes) bytes = end - ahead;
            const int64_t lines = bytes / 64;
            for (int64_t j = 0; j < tiles; ++j) {
                const int64_t m0 = j * ROWS;
                const int64_t l0 = lines * j / tiles, l1 = lines * (j + 1) / tiles;
                tile_rows(a->x + m0 * K + c0 * PAIR_TILE_KBLOCK, K, b, nb,
                          (int)(M - m0 < ROWS ? M - m0 : ROWS), &part[j][0][0], c0 == 0,
                          c0 + nb == kbs, a->bias ? a->bias + s * PAIR_TILE_STRIP : NULL,
                          a->y + m0 * N + s * PAIR_TILE_STRIP, N, 0, ahead + 64 * l0,
                          l1 - l0, 1);
            }
        }
    }
}

int bf16dot_linear_team(const PairTileLinearArgs *a) {
    const int64_t M = a->M, K = a->K, N = a->N;
    if (M < 0 || N <= 0 || K <= 0 || N % PAIR_TILE_STRIP || K % PAIR_TILE_KBLOCK)
        return BF16DOT_ERR_SHAPE;
    const int64_t strips = N / PAIR_TILE_STRIP, kbs = K / PAIR_TILE_KBLOCK;
    const int64_t strip_lines = kbs * PAIR_TILE_BLOCK * (int64_t)sizeof(uint16_t) / 64;
    int64_t block_rows = BLOCK_BYTES / (K * (int64_t)sizeof(uint16_t)) / ROWS * ROWS;
    block_rows = block_rows < ROWS ? ROWS : block_rows;
    const int nt = omp_get_num_threads(), tid = omp_get_thread_num();
    const int64_t s0 = strips * tid / nt, s1 = strips * (tid + 1) / nt;
    if (M > ROWS && M <= CHUNKED_MAX_TILES * ROWS) {
        strips_by_chunks(a, s0, s1, kbs);
        return BF16DOT_OK;
    }
    for (int64_t mb = 0; mb < M; mb += block_rows) {
        const int64_t mend = mb + block_rows < M ? mb + block_rows : M;
        const int64_t tiles = (mend - mb + ROWS - 1) / ROWS;
        for (int64_t s = s0; s < s1; ++s) {
            const uint16_t *bs = a->packed + s * kbs * PAIR_TILE_BLOCK;
            const char *next = (const char *)(bs + kbs * PAIR_TILE_BLOCK);
            const int64_t lines = s + 1 < s1 && tiles > 1 ? strip_lines : 0;
            for (int64_t m0 = mb; m0 < mend; m0 += ROWS) {
                const int64_t j = (m0 - mb) / ROWS;
                const int64_t l0 = lines * j / tiles, l1 = lines * (j + 1) / tiles;
                tile_rows(a->x + m0 * K, K, bs, kbs, (int)(mend - m0 < ROWS ? mend - m0 : ROWS),
                          NULL, 1, 1, a->bias ? a->bias + s * PAIR_TILE_STRIP : NULL,
                          a->y + m0 * N + s * PAIR_TILE_STRIP, N, tiles == 1,
                          next + 64 * l0, l1 - l0, 0);
            }
        }
    }
    return BF16DOT_OK;
}

int bf16dot_linear_run(PairTileLinearArgs *a) {
    a->threads = team_threads();
    return team_run((int (*)(const void *))bf16dot_linear_team, a, a->threads, 0);
}
#else
int bf16dot_available(void) { return BF16DOT_ERR_UNAVAILABLE; }

int bf16dot_linear_team(const PairTileLinearArgs *a) { (void)a; return BF16DOT_ERR_UNAVAILABLE; }
int bf16dot_linear_run(PairTileLinearArgs *a) { (void)a; return BF16DOT_ERR_UNAVAILABLE; }
#endif
