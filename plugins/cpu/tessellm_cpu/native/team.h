/* Team kernels: the form in which the CPU plugin's C kernels run inside a native program
 * (native/program.c, one OpenMP parallel region for a whole decode step) and alone.
 *
 * A team kernel is `int NAME_team(const NAME_args *a)`. Contract:
 * - every thread of the team calls it with the same arguments; its worksharing constructs
 *   (omp for, single, barrier) are orphaned, so they split the work over whichever team
 *   runs it: the program's, or the one TEAM_RUN opens for an eager call;
 * - it returns the same code on every thread: its checks read only the arguments and the
 *   inputs, and every thread makes them before any barrier (an early return never strands
 *   a thread at a barrier);
 * - it allocates nothing: scratch memory comes in the arguments (`NAME_scratch` says how
 *   many bytes for how many threads), so a program never fails on memory mid-step;
 * - it may end in a `nowait` loop: the caller's barrier (the program's after every kernel,
 *   the end of TEAM_RUN's region) orders its writes before any reader.
 */
#ifndef TESSELLM_TEAM_H
#define TESSELLM_TEAM_H

#include <omp.h>
#include <stdint.h>
#include <stdlib.h>

typedef int (*TeamKernel)(const void *args);

/* The threads a team of the default size has (what an eager call's region gets). */
static inline int team_threads(void) {
    const int nt = omp_get_max_threads();
    return nt > 0 ? nt : 1;
}

/* Run team kernel `fn` on `args` in a region of `nt` threads (one when `alone`); returns its
 * code. */
static inline int team_run(int (*fn)(const void *), const void *args, int nt, int alone) {
    int rc = 0;
#pragma omp parallel num_threads(alone ? 1 : nt)
    {
        const int r = fn(args);
        if (omp_get_thread_num() == 0) rc = r;
    }
    return rc;
}

/* An eager call of a team kernel with `bytes` of scratch (a->scratch set here, freed after):
 * its code, or `alloc_error` when the scratch cannot be had (bytes < 0: a size that
 * overflowed). */
#define TEAM_RUN_WITH_SCRATCH(fn, args_ptr, bytes, nt, alone, alloc_error)                   \
    ({                                                                                       \
        int rc_ = (alloc_error);                                                             \
        const int64_t b_ = (bytes);                                                          \
        void *s_ = b_ > 0 && b_ < INT64_MAX - 64                                             \
                       ? aligned_alloc(64, (size_t)(b_ + 63) / 64 * 64) : NULL;              \
        if (b_ == 0 || s_) {                                                                 \
            (args_ptr)->scratch = s_;                                                        \
            rc_ = team_run((int (*)(const void *))(fn), (args_ptr), (nt), (alone));          \
            free(s_);                                                                        \
        }                                                                                    \
        rc_;                                                                                 \
    })

#endif
