/* Software prefetch for the CPU plugin's C kernels. The hardware stream prefetcher follows a
 * sequential read only inside one 4 KiB page; kernels whose threads walk long runs of weights
 * (the packed linears) or scattered blocks (paged attention) ask for what they will read about
 * PREFETCH_BYTES ahead. */
#ifndef TESSELLM_PREFETCH_H
#define TESSELLM_PREFETCH_H

#include <stdint.h>

#define PREFETCH_BYTES 4096

/* Every cache line of [p, p + bytes). */
static inline void prefetch_bytes(const void *p, int64_t bytes) {
    const char *c = (const char *)p;
    for (int64_t i = 0; i < bytes; i += 64) __builtin_prefetch(c + i, 0, 3);
}

/* Every cache line of [p, p + bytes), into L2 only (for data wanted a block of work later,
 * which asking for it in L1 would push out what is read now). */
static inline void prefetch_bytes_l2(const void *p, int64_t bytes) {
    const char *c = (const char *)p;
    for (int64_t i = 0; i < bytes; i += 64) __builtin_prefetch(c + i, 0, 2);
}

/* Work split into `groups` consecutive groups of `group_bytes` each (`total` bytes in all),
 * each group's work done in `steps` steps: while on group g, the group SPREAD_BYTES ahead is
 * asked for into L2 a few cache lines per step (spread_step), clipped at the end. Spread
 * rather than asked for at once: a group's worth of prefetches in a burst fills the line
 * fill buffers and stalls the loads of the work (Q4_K int8 decode linears streaming from
 * DRAM: 12.3 GB/s with a 4 KiB burst into L1, 14.0-14.3 spread 16 KiB ahead). */
#define SPREAD_BYTES 16384

typedef struct {
    const char *p;
    int64_t left, per_step;   /* cache lines */
} SpreadPrefetch;

static inline SpreadPrefetch spread_ahead(const uint8_t *base, int64_t g, int64_t groups,
                                          int64_t group_bytes, int64_t total, int64_t steps) {
    SpreadPrefetch s = {0};
    const int64_t ahead = group_bytes >= SPREAD_BYTES ? 1 : SPREAD_BYTES / group_bytes;
    if (g + ahead >= groups || steps <= 0) return s;
    const int64_t start = (g + ahead) * group_bytes;
    const int64_t bytes = start + group_bytes < total ? group_bytes : total - start;
    s.p = (const char *)base + start;
    s.left = (bytes + 63) / 64;
    s.per_step = (s.left + steps - 1) / steps;
    return s;
}

/* The next few lines of `s` (nothing when s is NULL or done). */
static inline void spread_step(SpreadPrefetch *s) {
    if (!s) return;
    const int64_t n = s->per_step < s->left ? s->per_step : s->left;
    for (int64_t i = 0; i < n; i++) __builtin_prefetch(s->p + 64 * i, 0, 2);
    s->p += 64 * n;
    s->left -= n;
}

#endif
