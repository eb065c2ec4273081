/* Small per-token kernels for the tessellm CPU plugin, where torch's per-op overhead (tens of
 * microseconds for a handful of tiny ops) costs more than the arithmetic:
 *
 * rotary_*: half-split (NeoX / HF) rotary embedding of q [T, HQ * D] and k [T, HK * D] (rows
 *   of any stride, heads contiguous) into new contiguous outputs; cos_sin [P, D] float32, cos
 *   in the first half, sin in the second; cos and sin are rounded to the activation dtype
 *   first, as the reference does, then the math runs in float32 and rounds once.
 * rms_norm_*: y = weight * round(x * rsqrt(mean(x^2) + eps)) per row of H, optionally after
 *   x = round(x + residual) (written to `summed`): the reference's rounding points.
 * write_kv_*: each token's K and V rows [HK * D] (rows of any stride) to its slot of a
 *   contiguous cache [2, NB, HK, BS, D]; slot < 0 is a padding token (skipped).
 *
 * Every index is checked before use; the functions return 0, or a nonzero code naming the
 * problem (no write happens then). bf16 is stored as uint16 (round to nearest even).
 */
#include <stdint.h>
#include <math.h>
#include <string.h>

enum { RK_OK = 0, RK_ERR_POSITION = 1, RK_ERR_SLOT = 2, RK_ERR_SHAPE = 3 };

static inline float bf16_to_f32(uint16_t h) {
    uint32_t u = (uint32_t)h << 16;
    float f;
    memcpy(&f, &u, 4);
    return f;
}

static inline uint16_t f32_to_bf16(float f) {
    uint32_t u;
    memcpy(&u, &f, 4);
    if ((u & 0x7f800000u) == 0x7f800000u && (u & 0x7fffffu))  /* NaN stays NaN */
        return (uint16_t)((u >> 16) | 0x40);
    u += 0x7fffu + ((u >> 16) & 1u);
    return (uint16_t)(u >> 16);
}

static int check_positions(const int64_t *pos, int64_t T, int64_t P) {
    for (int64_t t = 0; t < T; t++)
        if (pos[t] < 0 || pos[t] >= P) return RK_ERR_POSITION;
    return RK_OK;
}

#define ROTARY(NAME, TYPE, LOAD, STORE, ROUND)                                                \
int NAME(const int64_t *pos, int64_t T, const TYPE *q, int64_t q_stride, int64_t HQ,         \
         const TYPE *k, int64_t k_stride, int64_t HK, const float *cos_sin, int64_t P,        \
         int64_t D, TYPE *q_out, TYPE *k_out) {                                               \
    if (D <= 0 || D % 2) return RK_ERR_SHAPE;                                                 \
    if (check_positions(pos, T, P)) return RK_ERR_POSITION;                                   \
    const int64_t half = D / 2;                                                               \
    for (int64_t t = 0; t < T; t++) {                                                         \
        const float *cs = cos_sin + pos[t] * D;                                               \
        for (int which = 0; which < 2; which++) {                                             \
            const TYPE *src = which ? k + t * k_stride : q + t * q_stride;                    \
            TYPE *dst = which ? k_out + t * HK * D : q_out + t * HQ * D;                      \
            const int64_t heads = which ? HK : HQ;                                            \
            for (int64_t h = 0; h < heads; h++) {                                             \
                const TYPE *x = src + h * D;                                                  \
                TYPE *y = dst + h * D;                                                        \
                for (int64_t j = 0; j < half; j++) {                                          \
                    const float c = ROUND(cs[j]), s = ROUND(cs[half + j]);                    \
                    const float x1 = LOAD(x[j]), x2 = LOAD(x[half + j]);                      \
                    y[j] = STORE(x1 * c - x2 * s);                                            \
                    y[half + j] = STORE(x2 * c + x1 * s);                                     \
                }                                                                             \
            }                                                                                 \
        }                                                                                     \
    }                                                                                         \
    return RK_OK;                                                                             \
}

#define ID(x) (x)
#define BF16_ROUND(x) bf16_to_f32(f32_to_bf16(x))
ROTARY(rotary_f32, float, ID, ID, ID)
ROTARY(rotary_bf16, uint16_t, bf16_to_f32, f32_to_bf16, BF16_ROUND)

/* elem: bytes per element (4 or 2: the cache has the activations' dtype) */
int write_kv(const uint8_t *k, int64_t k_stride, const uint8_t *v, int64_t v_stride,
             const int64_t *slots, int64_t T, uint8_t *cache, int64_t NB, int64_t HK,
             int64_t BS, int64_t D, int64_t elem) {
    if (elem != 2 && elem != 4) return RK_ERR_SHAPE;
    for (int64_t t = 0; t < T; t++)
        if (slots[t] >= NB * BS) return RK_ERR_SLOT;
    const int64_t row = D * elem, half = NB * HK * BS * D * elem;
    for (int64_t t = 0; t < T; t++) {
        const int64_t s = slots[t];
        if (s < 0) continue;
        const int64_t blk = s / BS, off = s % BS;
        for (int64_t h = 0; h < HK; h++) {
            const int64_t dst = ((blk * HK + h) * BS + off) * row;
            memcpy(cache + dst, k + t * k_stride * elem + h * row, (size_t)row);
            memcpy(cache + half + dst, v + t * v_stride * elem + h * row, (size_t)row);
        }
    }
    return RK_OK;
}

#define RMS_NORM(NAME, TYPE, LOAD, STORE, ROUND)                                             \
int NAME(const TYPE *x, int64_t x_stride, const TYPE *res, int64_t res_stride,              \
         const TYPE *w, int64_t T, int64_t H, float eps, TYPE *out, TYPE *summed) {          \
    if (H <= 0) return RK_ERR_SHAPE;                                                         \
    for (int64_t t = 0; t < T; t++) {                                                        \
        const TYPE *xr = x + t * x_stride;                                                   \
        TYPE *sr = summed ? summed + t * H : 0;                                              \
        float ss = 0.f;                                                                      \
        for (int64_t j = 0; j < H; j++) {                                                    \
            float v = LOAD(xr[j]);                                                           \
            if (res) { v = ROUND(v + LOAD(res[t * res_stride + j])); sr[j] = STORE(v); }     \
            ss += v * v;                                                                     \
        }                                                                                    \
        const float inv = 1.0f / sqrtf(ss / (float)H + eps);                                 \
        TYPE *o = out + t * H;                                                               \
        const TYPE *src = res ? sr : xr;                                                     \
        for (int64_t j = 0; j < H; j++)                                                      \
            o[j] = STORE(LOAD(w[j]) * ROUND(LOAD(src[j]) * inv));                            \
    }                                                                                        \
    return RK_OK;                                                                            \
}

RMS_NORM(rms_norm_f32, float, ID, ID, ID)
RMS_NORM(rms_norm_bf16, uint16_t, bf16_to_f32, f32_to_bf16, BF16_ROUND)
