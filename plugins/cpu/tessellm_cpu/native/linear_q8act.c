/* Linear over packed GGML weights with int8 activations (llama.cpp's way) for the tessellm
 * CPU plugin: op linear_packed_q8act, out[M, N] = q8(x)[M, K] @ W[N, K]^T (+ bias), where q8(x)
 * quantizes each 32-value block of a row of x to int8 with a float32 scale
 * (d = max|x| / 127, q = round-half-even(x / d); an all-zero block has d = 0, q = 0), exactly
 * as tessellm.kernels.reference.quantize_q8_blocks does, and the dot products of a block run
 * on integers (AVX-512 VNNI: 64 u8 x s8 products per instruction).
 *
 * Weights are the GGUF blocks, read in place (tessellm.quant.formats): Q8_0 (fp16 d, s8 q[32]:
 * w = d q), Q4_0 (fp16 d, nibbles: w = d (q - 8), i.e. m = -8 d), Q4_1 (fp16 d, fp16 m,
 * nibbles: w = d q + m), Q5_0 / Q5_1 (as Q4_0 / Q4_1 with a fifth bit per weight in u32 qh,
 * m = -16 d for Q5_0); weight j < 16 of a 4/5-bit block is the low nibble of byte j, weight
 * j + 16 its high nibble. Q4_0 / Q4_1 blocks go four to a vector of nibbles (two dot
 * products, one conversion, one FMA per four blocks), Q8_0 blocks two to a vector; such a run
 * of blocks is read from its own one or two 64-byte lines, its weights and its fp16 scales
 * both taken out by permutes (the 4-bit linears of a decode step were bound by their
 * instructions, not by memory: ~18 GB/s with a 16-lane gather of the scales per 16 blocks).
 * Q5_0 / Q5_1 gather the scales of 16 blocks at once. K-quant super-blocks
 * (k_quant_blocks.h) are read as 8 blocks of 32 with a scale and offset each (Q4_K, Q5_K:
 * d sc and -dmin m) or as 16-weight groups of signed levels (Q6_K: d sc (q - 32)).
 * Per block: sum_j w_j xq_j dx = dx d (q . xq) + m dx (sum xq): the integer dot product is
 * exact, the scaling is float32, so the result equals the float32 product of the two
 * dequantized operands up to rounding. Work: OpenMP over groups of NR output features; each
 * group runs every row of x in tiles of MR rows, the last of 1 .. MR rows (its weights stay
 * in L1), and prefetches the groups about 16 KiB ahead into L2 (prefetch.h). Needs AVX-512
 * BW + VNNI (the build fails without them, and the kernel is then not offered).
 */
#include <immintrin.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "k_quant_blocks.h"
#include "packed_blocks.h"
#include "prefetch.h"
#include "q8_rows.h"
#include "team.h"

#if !defined(__AVX512F__) || !defined(__AVX512BW__) || !defined(__AVX512VNNI__)
#error "linear_q8act needs AVX-512 F, BW and VNNI"
#endif

#define NR 4   /* output features per group */
#define MR 4   /* rows of x per tile */

/* The tiles' accumulators: acc[r][i] for weight row r and row i of x, 16 partial sums each. */
INLINE void acc_zero(__m512 acc[NR][MR]) {
    for (int r = 0; r < NR; r++)
        for (int i = 0; i < MR; i++) acc[r][i] = _mm512_setzero_ps();
}

/* res[r * MR + i] = the sum of acc[r][i]'s lanes, for the tile's nr x mr outputs. */
INLINE void acc_sums(__m512 acc[NR][MR], int nr, int mr, float *res) {
    for (int r = 0; r < nr; r++)
        for (int i = 0; i < mr; i++) res[r * MR + i] = _mm512_reduce_add_ps(acc[r][i]);
}

/* A group of 16 Q5_0 / Q5_1 blocks (g onward, lanes gm) of weight rows n0 .. n0 + nr - 1
 * against rows xr[0 .. mr - 1] of x: adds each block's offset term m dx sum(xq) into acc and
 * puts its scale d dx in s (block c of the group in lane c; q5_tile permutes it into its dot
 * products' lanes). */
INLINE void q5_group_scales(const QRow *xr, int mr, const uint8_t *w, int64_t row,
                            int qtype, int64_t n0, int nr, int64_t g, __mmask16 gm,
                            __m512 acc[NR][MR], __m512 s[NR][MR]) {
    const int64_t bb = block_bytes(qtype);
    for (int r = 0; r < nr; r++) {
        const __m512i heads = block_heads(w + (n0 + r) * row + g * bb, bb, gm);
        const __m512 d = half_lo(heads), m = block_offsets(heads, d, qtype);
        for (int i = 0; i < mr; i++) {
            acc[r][i] = _mm512_fmadd_ps(m, _mm512_loadu_ps(xr[i].sx + g), acc[r][i]);
            s[r][i] = _mm512_mul_ps(d, _mm512_loadu_ps(xr[i].dx + g));
        }
    }
}

/* Lane l of a dot product over `per`-lane blocks takes v[l / per]: a run's x scales (or sums)
 * in the lanes of its blocks (per 4: a quad of 4-bit blocks, v[0 .. 3]; per 8: a pair of Q8_0
 * blocks, v[0 .. 1]). */
INLINE __m512 block_lanes(const float *v, int per) {
    const __m512i lane = _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
    const __m512i idx = _mm512_srli_epi32(lane, per == 4 ? 2 : 3);
    return _mm512_permutexvar_ps(idx, _mm512_castps128_ps512(_mm_maskz_loadu_ps(per == 4 ? 0xf : 0x3, v)));
}

/* The bytes of a 64-byte line that lie within the first n bytes of a run. */
INLINE __mmask64 line_mask(int64_t n) {
    return n >= 64 ? ~(__mmask64)0 : n <= 0 ? (__mmask64)0 : ((__mmask64)1 << n) - 1;
}

/* The 16 bytes of nibbles of blocks a, a + bb, a + 2 bb, a + 3 bb as one vector; blocks from
 * the n-th on read as zero (never loaded: they may lie past the weights' end). */
INLINE __m512i four_blocks_nibbles(const uint8_t *a, int64_t bb, int64_t n) {
    __m512i q = _mm512_zextsi128_si512(_mm_loadu_si128((const __m128i *)a));
    if (n > 1) q = _mm512_inserti32x4(q, _mm_loadu_si128((const __m128i *)(a + bb)), 1);
    if (n > 2) q = _mm512_inserti32x4(q, _mm_loadu_si128((const __m128i *)(a + 2 * bb)), 2);
    if (n > 3) q = _mm512_inserti32x4(q, _mm_loadu_si128((const __m128i *)(a + 3 * bb)), 3);
    return q;
}

/* How a quad of Q4_0 / Q4_1 blocks (four of bb bytes, read as the 64-byte lines a and b from
 * its first byte) becomes vectors: `nibbles` (VBMI byte permute of a, b) puts block c's 16
 * bytes of nibbles in bytes 16c .. 16c + 15; `heads` (word permute of a, zeroing outside
 * `keep`) puts block c's d in words 4c .. 4c + 3 and, for Q4_1, its m in word 16 + 4c (words
 * 16 + 4c + 1 .. 3 zero), so the low and high 256 bits convert to the dot product's lanes. */
typedef struct {
    __m512i nibbles, heads;
    __mmask32 keep;
} QuadLayout;

INLINE QuadLayout quad_layout(int64_t bb, int64_t qoff, int with_m) {
    uint8_t nib[64];
    uint16_t head[32];
    for (int j = 0; j < 64; j++) nib[j] = (uint8_t)((j / 16) * bb + qoff + j % 16);
    for (int l = 0; l < 16; l++) {
        head[l] = (uint16_t)((l / 4) * bb / 2);
        head[16 + l] = (uint16_t)((l / 4) * bb / 2 + 1);
    }
    QuadLayout q;
    q.nibbles = _mm512_loadu_si512(nib);
    q.heads = _mm512_loadu_si512(head);
    q.keep = 0xffffu | (with_m ? 0x11110000u : 0u);
    return q;
}

/* Rows xr[0 .. mr - 1] of x (mr <= MR, Q8_NIBBLE_QUADS order) against Q4_0 / Q4_1 weight rows
 * n0 .. n0 + nr - 1 (blocks read in place): res[r * MR + i]. A quad of blocks is read from its
 * own lines: its nibbles are one vector (a byte permute with VBMI, else four 16-byte loads),
 * the low ones against x's first 64 bytes, the high ones against the next, both dot products
 * into the same lanes (4 a block), then one conversion and one FMA by the blocks' d dx; its
 * d and m come from the same first line by one word permute. (The scales of 16 blocks at once
 * by a gather cost more than the rest of the work on AMD Zen 4: a decode linear's Q4_1 rows
 * in L2 took 53 us with it, 35 without.) Q4_0's -8 d offset is taken in the integers (the
 * dot products start from -8 times the sums of x's bytes they cover); Q4_1's m dx sum(xq) is
 * one more FMA, on the block's first lane. Each unpacked quad serves all mr rows, so a
 * prefill reads and unpacks the weights once per MR rows. Per output the operations and their
 * order are those of mr = 1, so the result does not depend on how rows are tiled. */
INLINE void q4_tile(const QRow *xr, int mr, int64_t nb, const uint8_t *w, int64_t row, int qtype,
                    int64_t n0, int nr, float *res, SpreadPrefetch *pf) {
    const int64_t bb = block_bytes(qtype), qoff = qtype == Q4_0 ? 2 : 4;
    const int with_m = qtype == Q4_1;
    const QuadLayout lay = quad_layout(bb, qoff, with_m);
    __m512 acc[NR][MR];
    acc_zero(acc);
    const __m512i nib = _mm512_set1_epi8(0x0f), ones = _mm512_set1_epi8(1);
    const __m512i zero = _mm512_setzero_si512();
    for (int64_t q = 0; 4 * q < nb; q++) {
        spread_step(pf);
        spread_step(pf);
        const int64_t nq = nb - 4 * q < 4 ? nb - 4 * q : 4;
        const __mmask64 ma = line_mask(nq * bb);
        __m512i xlo[MR], xhi[MR], start[MR];
        __m512 dx[MR], sx[MR];
        for (int i = 0; i < mr; i++) {
            xlo[i] = _mm512_loadu_si512(xr[i].xq + 4 * q * QK);
            xhi[i] = _mm512_loadu_si512(xr[i].xq + 4 * q * QK + 64);
            dx[i] = block_lanes(xr[i].dx + 4 * q, 4);
            if (with_m) {
                sx[i] = block_lanes(xr[i].sx + 4 * q, 4);
                start[i] = zero;
            } else {   /* -8 times the sum of the 8 bytes of x each lane's products take */
                const __m512i sum =
                    _mm512_dpbusd_epi32(_mm512_dpbusd_epi32(zero, ones, xlo[i]), ones, xhi[i]);
                start[i] = _mm512_sub_epi32(zero, _mm512_slli_epi32(sum, 3));
            }
        }
        for (int r = 0; r < nr; r++) {
            const uint8_t *quad = w + (n0 + r) * row + 4 * q * bb;
            const __m512i a = _mm512_maskz_loadu_epi8(ma, quad);
#ifdef __AVX512VBMI__
            const __m512i qv = _mm512_permutex2var_epi8(
                a, lay.nibbles, _mm512_maskz_loadu_epi8(line_mask(nq * bb - 64), quad + 64));
#else
            const __m512i qv = four_blocks_nibbles(quad + qoff, bb, nq);
#endif
            const __m512i lo = _mm512_and_si512(qv, nib);
            const __m512i hi = _mm512_and_si512(_mm512_srli_epi16(qv, 4), nib);
            const __m512i heads = _mm512_maskz_permutexvar_epi16(lay.keep, lay.heads, a);
            const __m512 d = _mm512_cvtph_ps(_mm512_castsi512_si256(heads));
            const __m512 m = with_m ? _mm512_cvtph_ps(_mm512_extracti64x4_epi64(heads, 1))
                                    : _mm512_setzero_ps();
            for (int i = 0; i < mr; i++) {
                const __m512i dot = _mm512_dpbusd_epi32(
                    _mm512_dpbusd_epi32(start[i], lo, xlo[i]), hi, xhi[i]);
                if (with_m) acc[r][i] = _mm512_fmadd_ps(m, sx[i], acc[r][i]);
                acc[r][i] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(dot), _mm512_mul_ps(d, dx[i]),
                                            acc[r][i]);
            }
        }
    }
    acc_sums(acc, nr, mr, res);
}

/* Lanes 0-7 take block 2j's value, lanes 8-15 block 2j + 1's (of a 16-block group). */
INLINE __m512i pair_lanes(int j) {
    const int a = 2 * j, b = 2 * j + 1;
    return _mm512_setr_epi32(a, a, a, a, a, a, a, a, b, b, b, b, b, b, b, b);
}

/* As q4_tile for Q5_0 / Q5_1 rows (x in block order; the scales of 16 blocks at once from
 * q5_group_scales): a pair of blocks A, B from two 16-byte loads of nibbles, in order
 * (A0-31 B0-31), plus 16 where a block's qh says. */
INLINE void q5_tile(const QRow *xr, int mr, int64_t nb, const uint8_t *w, int64_t row, int qtype,
                    int64_t n0, int nr, float *res,
                    SpreadPrefetch *pf) {
    const int64_t bb = block_bytes(qtype);
    const int64_t qoff = qtype == Q5_0 ? 6 : 8;
    __m512 acc[NR][MR];
    acc_zero(acc);
    const __m256i nib = _mm256_set1_epi8(0x0f);
    for (int64_t g = 0; g < nb; g += 16) {
        const int64_t ng = nb - g < 16 ? nb - g : 16;
        const __mmask16 gm = group_mask(ng);
        __m512 s[NR][MR];
        q5_group_scales(xr, mr, w, row, qtype, n0, nr, g, gm, acc, s);
        for (int64_t p = 0; p < ng; p += 2) {
            spread_step(pf);
            const __m512i lanes = pair_lanes((int)(p / 2));
            const int has_b = p + 1 < ng;
            __m512i xv[MR];
            for (int i = 0; i < mr; i++) xv[i] = _mm512_loadu_si512(xr[i].xq + (g + p) * QK);
            for (int r = 0; r < nr; r++) {
                const uint8_t *a = w + (n0 + r) * row + (g + p) * bb + qoff;
                const __m128i qa = _mm_loadu_si128((const __m128i *)a);
                const __m128i qb = has_b ? _mm_loadu_si128((const __m128i *)(a + bb))
                                         : _mm_setzero_si128();
                const __m256i q = _mm256_inserti128_si256(_mm256_castsi128_si256(qa), qb, 1);
                const __m256i lo = _mm256_and_si256(q, nib);
                const __m256i hi = _mm256_and_si256(_mm256_srli_epi16(q, 4), nib);
                uint32_t ha, hb = 0;
                memcpy(&ha, a - 4, 4);
                if (has_b) memcpy(&hb, a + bb - 4, 4);
                __m512i wq = _mm512_inserti64x4(
                    _mm512_castsi256_si512(_mm256_permute2x128_si256(lo, hi, 0x20)),
                    _mm256_permute2x128_si256(lo, hi, 0x31), 1);
                wq = _mm512_mask_add_epi8(wq, (__mmask64)((uint64_t)ha | ((uint64_t)hb << 32)),
                                          wq, _mm512_set1_epi8(16));
                for (int i = 0; i < mr; i++) {
                    const __m512i dot = _mm512_dpbusd_epi32(_mm512_setzero_si512(), wq, xv[i]);
                    acc[r][i] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(dot),
                                                _mm512_permutexvar_ps(lanes, s[r][i]), acc[r][i]);
                }
            }
        }
    }
    acc_sums(acc, nr, mr, res);
}

/* As q4_tile for Q8_0 weights (x in block order), a pair of blocks A, B a vector, read from
 * the pair's own 68 bytes as lines a, b: the 64 int8 weights by a byte permute (VBMI; else two
 * 32-byte loads), A's d into lanes 0-7 and B's into lanes 8-15 by a word permute of a.
 * Signed x signed through u8 x s8: |w| times x with w's sign moved onto x. */
INLINE void q8_tile(const QRow *xr, int mr, int64_t nb, const uint8_t *w, int64_t row,
                    int64_t n0, int nr, float *res, SpreadPrefetch *pf) {
    const int64_t bb = 34;
    uint8_t take[64];
    uint16_t head[32] = {0};
    for (int j = 0; j < 64; j++) take[j] = (uint8_t)((j / 32) * bb + 2 + j % 32);
    for (int l = 8; l < 16; l++) head[l] = (uint16_t)(bb / 2);
    const __m512i weights = _mm512_loadu_si512(take), heads = _mm512_loadu_si512(head);
    __m512 acc[NR][MR];
    acc_zero(acc);
    const __m512i zero = _mm512_setzero_si512();
    for (int64_t p = 0; p < nb; p += 2) {
        spread_step(pf);
        const int has_b = p + 1 < nb;
        __m512i xv[MR];
        __m512 dx[MR];
        for (int i = 0; i < mr; i++) {
            xv[i] = _mm512_loadu_si512(xr[i].xq + p * QK);
            dx[i] = block_lanes(xr[i].dx + p, 8);
        }
        for (int r = 0; r < nr; r++) {
            const uint8_t *pair = w + (n0 + r) * row + p * bb;
            const __m512i a = _mm512_maskz_loadu_epi8(line_mask(has_b ? 2 * bb : bb), pair);
#ifdef __AVX512VBMI__
            const __m512i q = _mm512_permutex2var_epi8(
                a, weights, _mm512_maskz_loadu_epi8(line_mask(has_b ? 2 * bb - 64 : 0), pair + 64));
#else
            const __m512i q = _mm512_inserti64x4(
                _mm512_castsi256_si512(_mm256_loadu_si256((const __m256i *)(pair + 2))),
                has_b ? _mm256_loadu_si256((const __m256i *)(pair + bb + 2)) : _mm256_setzero_si256(), 1);
            (void)weights;
#endif
            const __m512 d = _mm512_cvtph_ps(_mm512_castsi512_si256(
                _mm512_maskz_permutexvar_epi16(has_b ? 0xffffu : 0xffu, heads, a)));
            const __mmask64 neg = _mm512_movepi8_mask(q);
            const __m512i aq = _mm512_abs_epi8(q);
            for (int i = 0; i < mr; i++) {
                const __m512i xs = _mm512_mask_sub_epi8(xv[i], neg, zero, xv[i]);
                const __m512i dot = _mm512_dpbusd_epi32(zero, aq, xs);
                acc[r][i] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(dot), _mm512_mul_ps(d, dx[i]),
                                            acc[r][i]);
            }
        }
    }
    acc_sums(acc, nr, mr, res);
}

/* Lanes 0-7 take block a's value, lanes 8-15 block b's (of a 16-block group). */
INLINE __m512i two_block_lanes(int a, int b) {
    return _mm512_mask_blend_epi32((__mmask16)0xff00, _mm512_set1_epi32(a), _mm512_set1_epi32(b));
}

/* As q4_tile for Q4_K / Q5_K rows (x in Q8_QUADS order): a group of 16 blocks is two
 * super-blocks, whose 8 blocks each have d_c = d sc and o_c = -dmin m (the offset term
 * o_c dx sum(xq), once per group). A quad of blocks 4q .. 4q + 3 is one 64-byte load of the
 * nibbles: the low ones are blocks 4q and 4q + 2, the high ones 4q + 1 and 4q + 3 (Q5_K: plus
 * those blocks' bits of qh as fifth bits), each against x's matching 64 bytes, so a quad
 * costs per row two dot products, two conversions and two FMAs, its scales d_c dx taken from
 * the group's products by one permute each. */
INLINE void kq_tile(const QRow *xr, int mr, int64_t nb, const uint8_t *w, int64_t row, int qtype,
                    int64_t n0, int nr, float *res,
                    SpreadPrefetch *pf) {
    const int64_t sbb = block_bytes(qtype), qoff = qtype == Q5_K ? 48 : 16;
    __m512 acc[NR][MR];
    acc_zero(acc);
    const __m512i nib = _mm512_set1_epi8(0x0f), one = _mm512_set1_epi8(1);
    for (int64_t g = 0; g < nb; g += 16) {
        const int64_t ng = nb - g < 16 ? nb - g : 16;   /* 8 or 16 */
        __m512 s[NR][MR];   /* d_c dx_c, block c of the group in lane c */
        for (int r = 0; r < nr; r++) {
            const uint8_t *sb = w + (n0 + r) * row + (g / 8) * sbb;
            __m256 d0, o0, d1 = _mm256_setzero_ps(), o1 = _mm256_setzero_ps();
            k_quant_scales8(sb, &d0, &o0);
            if (ng > 8) k_quant_scales8(sb + sbb, &d1, &o1);
            const __m512 d = _mm512_insertf32x8(_mm512_castps256_ps512(d0), d1, 1);
            const __m512 o = _mm512_insertf32x8(_mm512_castps256_ps512(o0), o1, 1);
            for (int i = 0; i < mr; i++) {
                acc[r][i] = _mm512_fmadd_ps(o, _mm512_loadu_ps(xr[i].sx + g), acc[r][i]);
                s[r][i] = _mm512_mul_ps(d, _mm512_loadu_ps(xr[i].dx + g));
            }
        }
        for (int q = 0; q < ng / 4; q++) {
            spread_step(pf);
            spread_step(pf);
            const __m512i lanes_lo = two_block_lanes(4 * q, 4 * q + 2);
            const __m512i lanes_hi = two_block_lanes(4 * q + 1, 4 * q + 3);
            const int pp = q & 1;   /* the quad's place in its super-block */
            __m512i xlo[MR], xhi[MR];
            for (int i = 0; i < mr; i++) {
                xlo[i] = _mm512_loadu_si512(xr[i].xq + (g + 4 * q) * QK);
                xhi[i] = _mm512_loadu_si512(xr[i].xq + (g + 4 * q + 2) * QK);
            }
            for (int r = 0; r < nr; r++) {
                const uint8_t *base = w + (n0 + r) * row + (g / 8 + q / 2) * sbb;
                const __m512i qv = _mm512_loadu_si512((const void *)(base + qoff + 64 * pp));
                __m512i lo = _mm512_and_si512(qv, nib);
                __m512i hi = _mm512_and_si512(_mm512_srli_epi16(qv, 4), nib);
                if (qtype == Q5_K) {   /* block c's fifth bits: bit c of qh[0..31] */
                    const __m256i qh = _mm256_loadu_si256((const __m256i *)(base + 16));
                    const __m512i qhv = _mm512_inserti64x4(_mm512_castsi256_si512(qh), qh, 1);
                    const __m512i shift = _mm512_mask_blend_epi16(
                        (__mmask32)0xffff0000u, _mm512_set1_epi16((short)(4 * pp)),
                        _mm512_set1_epi16((short)(4 * pp + 2)));
                    const __m512i one16 = _mm512_set1_epi16(1);
                    lo = _mm512_or_si512(lo, _mm512_slli_epi16(
                        _mm512_and_si512(_mm512_srlv_epi16(qhv, shift), one), 4));
                    hi = _mm512_or_si512(hi, _mm512_slli_epi16(
                        _mm512_and_si512(_mm512_srlv_epi16(qhv, _mm512_add_epi16(shift, one16)),
                                         one), 4));
                }
                for (int i = 0; i < mr; i++) {
                    const __m512i dlo = _mm512_dpbusd_epi32(_mm512_setzero_si512(), lo, xlo[i]);
                    acc[r][i] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(dlo),
                                                _mm512_permutexvar_ps(lanes_lo, s[r][i]), acc[r][i]);
                    const __m512i dhi = _mm512_dpbusd_epi32(_mm512_setzero_si512(), hi, xhi[i]);
                    acc[r][i] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(dhi),
                                                _mm512_permutexvar_ps(lanes_hi, s[r][i]), acc[r][i]);
                }
            }
        }
    }
    acc_sums(acc, nr, mr, res);
}

/* As q8_tile for Q6_K rows (x in block order): half h of a super-block (weights 128h ..
 * 128h + 127) is one 64-byte load of ql (low nibbles: weights 0-63, high: 64-127) and one
 * 32-byte load of qh (2 bits per weight), giving the unsigned levels q (0..63) of two 64-weight
 * halves. u8 x s8 dot products of q take (q - 32) . x exactly when they start from
 * -32 sum(x) per lane (one dot product of x with 32s, shared by the weight rows). Each 16
 * weights have their own d sc: lane k of a 64-weight half takes d sc of group k / 4 times its
 * block's dx. */
INLINE void q6k_tile(const QRow *xr, int mr, int64_t nb, const uint8_t *w, int64_t row,
                     int64_t n0, int nr, float *res,
                     SpreadPrefetch *pf) {
    const int64_t sbb = block_bytes(Q6_K);
    __m512 acc[NR][MR];
    acc_zero(acc);
    const __m512i zero = _mm512_setzero_si512(), m4 = _mm512_set1_epi8(0x0f);
    const __m512i m3 = _mm512_set1_epi8(0x03), k32 = _mm512_set1_epi8(32);
    const __m512i quarter = _mm512_srli_epi32(
        _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15), 2);
    for (int64_t g = 0; g < nb; g += 8) {   /* a super-block at a time */
        const int64_t sb = g / 8;
        __m512 dx[MR], dsc[NR];
        for (int i = 0; i < mr; i++) dx[i] = _mm512_maskz_loadu_ps(0xff, xr[i].dx + g);
        for (int r = 0; r < nr; r++) {
            float ds[16], unused[8];
            k_quant_block_scales(w + (n0 + r) * row + sb * sbb, Q6_K, ds, unused);
            dsc[r] = _mm512_loadu_ps(ds);
        }
        for (int h = 0; h < 2; h++) {
            spread_step(pf);
            spread_step(pf);
            __m512i x0[MR], x1[MR], neg0[MR], neg1[MR];
            __m512 sdx0[MR], sdx1[MR];
            for (int i = 0; i < mr; i++) {
                x0[i] = _mm512_loadu_si512(xr[i].xq + (g + 4 * h) * QK);
                x1[i] = _mm512_loadu_si512(xr[i].xq + (g + 4 * h + 2) * QK);
                neg0[i] = _mm512_sub_epi32(zero, _mm512_dpbusd_epi32(zero, k32, x0[i]));
                neg1[i] = _mm512_sub_epi32(zero, _mm512_dpbusd_epi32(zero, k32, x1[i]));
                sdx0[i] = _mm512_permutexvar_ps(two_block_lanes(4 * h, 4 * h + 1), dx[i]);
                sdx1[i] = _mm512_permutexvar_ps(two_block_lanes(4 * h + 2, 4 * h + 3), dx[i]);
            }
            const __m512i groups0 = _mm512_add_epi32(quarter, _mm512_set1_epi32(8 * h));
            const __m512i groups1 = _mm512_add_epi32(quarter, _mm512_set1_epi32(8 * h + 4));
            for (int r = 0; r < nr; r++) {
                const uint8_t *base = w + (n0 + r) * row + sb * sbb;
                const __m512i ql = _mm512_loadu_si512((const void *)(base + 64 * h));
                const __m256i qh = _mm256_loadu_si256((const __m256i *)(base + 128 + 32 * h));
                /* qh's bits 0-1 for weights 0-31, 2-3 for 32-63; shifted by 4: 64-95, 96-127 */
                const __m512i qhv = _mm512_inserti64x4(_mm512_castsi256_si512(qh),
                                                       _mm256_srli_epi16(qh, 2), 1);
                const __m512i q0 = _mm512_or_si512(
                    _mm512_and_si512(ql, m4), _mm512_slli_epi16(_mm512_and_si512(qhv, m3), 4));
                const __m512i q1 = _mm512_or_si512(
                    _mm512_and_si512(_mm512_srli_epi16(ql, 4), m4),
                    _mm512_slli_epi16(_mm512_and_si512(_mm512_srli_epi16(qhv, 4), m3), 4));
                const __m512 sc0 = _mm512_permutexvar_ps(groups0, dsc[r]);
                const __m512 sc1 = _mm512_permutexvar_ps(groups1, dsc[r]);
                for (int i = 0; i < mr; i++) {
                    acc[r][i] = _mm512_fmadd_ps(
                        _mm512_cvtepi32_ps(_mm512_dpbusd_epi32(neg0[i], q0, x0[i])),
                        _mm512_mul_ps(sc0, sdx0[i]), acc[r][i]);
                    acc[r][i] = _mm512_fmadd_ps(
                        _mm512_cvtepi32_ps(_mm512_dpbusd_epi32(neg1[i], q1, x1[i])),
                        _mm512_mul_ps(sc1, sdx1[i]), acc[r][i]);
                }
            }
        }
    }
    acc_sums(acc, nr, mr, res);
}

/* Rows i0 .. i0 + mr - 1 of x against weight rows n0 .. n0 + nr - 1, into out (+ bias). */
INLINE void tile_out(const QRow *rows, int64_t i0, int mr, int64_t nb, const uint8_t *w,
                     int64_t row, int qtype, int64_t n0, int nr, const float *bias, float *out,
                     int64_t N, SpreadPrefetch *pf) {
    float res[NR * MR];
    switch (qtype) {
    case Q8_0: q8_tile(rows + i0, mr, nb, w, row, n0, nr, res, pf); break;
    case Q4_K: kq_tile(rows + i0, mr, nb, w, row, Q4_K, n0, nr, res, pf); break;
    case Q5_K: kq_tile(rows + i0, mr, nb, w, row, Q5_K, n0, nr, res, pf); break;
    case Q6_K: q6k_tile(rows + i0, mr, nb, w, row, n0, nr, res, pf); break;
    case Q5_0: q5_tile(rows + i0, mr, nb, w, row, Q5_0, n0, nr, res, pf); break;
    case Q5_1: q5_tile(rows + i0, mr, nb, w, row, Q5_1, n0, nr, res, pf); break;
    case Q4_0: q4_tile(rows + i0, mr, nb, w, row, Q4_0, n0, nr, res, pf); break;
    default: q4_tile(rows + i0, mr, nb, w, row, Q4_1, n0, nr, res, pf); break;
    }
    for (int i = 0; i < mr; i++)
        for (int r = 0; r < nr; r++)
            out[(i0 + i) * N + n0 + r] = res[r * MR + i] + (bias ? bias[n0 + r] : 0.f);
}

/* All M rows of x against weight rows n0 .. n0 + nr - 1: tiles of MR rows, the last 1 .. MR
 * rows as one tile (constant sizes: kept in registers); the first tile advances `pf`. */
INLINE void group_tiles(const QRow *rows, int64_t M, int64_t nb, const uint8_t *w, int64_t row,
                        int qtype, int64_t n0, int nr, const float *bias, float *out, int64_t N,
                        SpreadPrefetch *pf) {
    int64_t i = 0;
    for (; i + MR <= M; i += MR, pf = NULL)
        tile_out(rows, i, MR, nb, w, row, qtype, n0, nr, bias, out, N, pf);
    switch (M - i) {
    case 3: tile_out(rows, i, 3, nb, w, row, qtype, n0, nr, bias, out, N, pf); break;
    case 2: tile_out(rows, i, 2, nb, w, row, qtype, n0, nr, bias, out, N, pf); break;
    case 1: tile_out(rows, i, 1, nb, w, row, qtype, n0, nr, bias, out, N, pf); break;
    default: break;
    }
}

/* group_tiles for a group of nr <= NR weight rows, compiled for nr = NR apart: with a constant
 * count the tiles' accumulators stay in registers (with nr read at run time they were indexed
 * on the stack: W4's 121 decode linears 4.7 -> 3.9 ms). */
INLINE void feature_group(const QRow *rows, int64_t M, int64_t nb, const uint8_t *w, int64_t row,
                          int qtype, int64_t n0, int nr, const float *bias, float *out, int64_t N,
                          SpreadPrefetch *pf) {
    if (nr == NR)
        group_tiles(rows, M, nb, w, row, qtype, n0, NR, bias, out, N, pf);
    else
        group_tiles(rows, M, nb, w, row, qtype, n0, nr, bias, out, N, pf);
}

/* The order a row of x is quantized in for weights of `qtype` (q8_rows.h). */
INLINE int q8_layout(int qtype) {
    return qtype == Q4_0 || qtype == Q4_1 ? Q8_NIBBLE_QUADS
           : qtype == Q4_K || qtype == Q5_K ? Q8_QUADS : Q8_ORDER;
}

/* The linear's arguments (team.h, linear_packed.c's layout). scratch: linear_q8act_scratch
 * bytes (the rounded rows of x, then their QRow records). */
typedef struct {
    const float *x;
    int64_t M, K;
    const uint8_t *w;
    int64_t N;
    int qtype;
    const float *bias;
    float *out;
    void *scratch;
} LinearQ8ActArgs;

int64_t linear_q8act_scratch(const LinearQ8ActArgs *a) {
    if (a->M <= 0 || a->K <= 0) return 0;
    return (int64_t)((q8_row_stride(a->K / QK) + sizeof(QRow)) * (size_t)a->M);
}

/* Returns 0, or 1 on a bad format or K. */
int linear_q8act_team(const LinearQ8ActArgs *a) {
    const int qtype = a->qtype;
    const int64_t M = a->M, K = a->K, N = a->N;
    if (block_bytes(qtype) == 0 || K <= 0 || K % block_weights(qtype) != 0 || M < 0 || N < 0)
        return 1;
    if (M == 0 || N == 0) return 0;
    const int64_t nb = K / QK;
    const int64_t row = K / block_weights(qtype) * block_bytes(qtype);
    const int layout = q8_layout(qtype);
    const size_t stride = q8_row_stride(nb);
    uint8_t *base = a->scratch;
    QRow *rows = (QRow *)(base + stride * (size_t)M);
    const uint8_t *w = a->w;
#pragma omp for schedule(static)
    for (int64_t i = 0; i < M; i++) {
        rows[i] = q8_row_at(base, nb, i);
        quantize_row(a->x + i * K, nb, layout, rows[i]);
    }
    const int64_t groups = (N + NR - 1) / NR;
#pragma omp for schedule(static) nowait
    for (int64_t grp = 0; grp < groups; grp++) {
        const int64_t n0 = grp * NR;
        const int nr = (int)(N - n0 < NR ? N - n0 : NR);
        /* each thread reads its groups in order; the first tile of a group asks for a later one */
        SpreadPrefetch ahead = spread_ahead(w, grp, groups, NR * row, N * row, (nb + 1) / 2);
        feature_group(rows, M, nb, w, row, qtype, n0, nr, a->bias, a->out, N, &ahead);
    }
    return 0;
}

/* An eager call: 0; 1 on a bad format or K; 2 when scratch memory cannot be allocated. */
int linear_q8act_run(LinearQ8ActArgs *a) {
    return TEAM_RUN_WITH_SCRATCH(linear_q8act_team, a, linear_q8act_scratch(a), team_threads(),
                                 0, 2);
}
