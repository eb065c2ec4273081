/* The bfloat16 weight form shared by the CPU plugin's bf16 linears on AMX tiles
 * (linear_amx.c) and on AVX-512 BF16 dot products (linear_bf16dot.c): the weight [N, K] in
 * strips of 32 output features, each strip's blocks of 32 inputs contiguous, a block two
 * 16 x 64-byte halves (16 features each) whose row r holds the pairs
 * (W[n][k0 + 2r], W[n][k0 + 2r + 1]) of its 16 features. That row is one TDPBF16PS B-tile row
 * and one VDPBF16PS operand alike. Same size as the plain weight; N and K multiples of 32. */
#ifndef TESSELLM_BF16_PAIR_TILES_H
#define TESSELLM_BF16_PAIR_TILES_H

#include <stdint.h>

#define PAIR_TILE_STRIP 32                 /* output features per strip */
#define PAIR_TILE_KBLOCK 32                /* inputs per block */
#define PAIR_TILE_BLOCK (PAIR_TILE_STRIP * PAIR_TILE_KBLOCK)   /* bf16 values of one block */

/* A pair-tile linear's arguments (team.h): x [M, K] and y [M, N] contiguous bfloat16, the
 * packed weight, the bias (bfloat16, or NULL), the team's threads, and the kernel's scratch
 * (NULL for a kernel that needs none). */
typedef struct {
    const uint16_t *x;
    int64_t M, K;
    const uint16_t *packed;
    int64_t N;
    const uint16_t *bias;
    uint16_t *y;
    int threads;
    void *scratch;
} PairTileLinearArgs;

/* 0, or 1 when N or K is not a positive multiple of 32. */
static inline int pack_bf16_pair_tiles(const uint16_t *w, int64_t N, int64_t K,
                                       uint16_t *packed) {
    if (N <= 0 || K <= 0 || N % PAIR_TILE_STRIP || K % PAIR_TILE_KBLOCK) return 1;
    const int64_t strips = N / PAIR_TILE_STRIP, kbs = K / PAIR_TILE_KBLOCK;
#pragma omp parallel for schedule(static)
    for (int64_t s = 0; s < strips; ++s)
        for (int64_t kb = 0; kb < kbs; ++kb) {
            uint16_t *dst = packed + (s * kbs + kb) * PAIR_TILE_BLOCK;
            for (int t = 0; t < 2; ++t)
                for (int r = 0; r < 16; ++r)
                    for (int n = 0; n < 16; ++n) {
                        const uint16_t *src = w + (s * PAIR_TILE_STRIP + t * 16 + n) * K
                                              + kb * PAIR_TILE_KBLOCK + 2 * r;
                        uint16_t *d = dst + ((t * 16 + r) * 16 + n) * 2;
                        d[0] = src[0];
                        d[1] = src[1];
                    }
        }
    return 0;
}

#endif
