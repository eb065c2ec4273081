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

/* Work split into `groups` consecutive groups of `group_bytes` each (`total` bytes in all):
 * while on group g, prefetch the group about PREFETCH_BYTES ahead (the next one if a group is
 * larger), clipped at the end. */
static inline void prefetch_group_ahead(const uint8_t *base, int64_t g, int64_t groups,
                                        int64_t group_bytes, int64_t total) {
    const int64_t ahead = group_bytes >= PREFETCH_BYTES ? 1 : PREFETCH_BYTES / group_bytes;
    if (g + ahead >= groups) return;
    const int64_t start = (g + ahead) * group_bytes;
    prefetch_bytes(base + start, start + group_bytes < total ? group_bytes : total - start);
}

#endif
