/* The native program runner of the tessellm CPU plugin (tessellm_cpu/native_program.py): a
 * decode step's kernels as a flat array of (team kernel, argument block) nodes, run by one
 * call on one OpenMP team -- the CPU analogue of a CUDA graph's replay.
 *
 * program_run: one parallel region of `nthreads` threads (libgomp keeps its threads between
 * regions; they spin a while, then sleep, at barriers and between regions). Every thread runs
 * every node in order (team.h's contract: the node's worksharing splits its work), then all
 * meet at a barrier, so a node reads only what earlier nodes finished writing. A node that
 * returns nonzero stops the run after that node's barrier, on every thread alike: the
 * failure is recorded as the lowest failing index (a later node's failure, from a thread
 * already past the barrier, never makes a slower thread stop one node early and strand the
 * others at the next barrier). Returns 0, or the failing node's code with its index in
 * *failed (else -1).
 *
 * With `seconds` (NULL normally), thread t of node i adds its time in the kernel to
 * seconds[2 * (i * nthreads + t)] and its wait at the barrier after it to the next entry
 * (`tessellm bench latency --profile`).
 */
#include <stdint.h>

#include "team.h"

typedef struct {
    TeamKernel fn;
    const void *args;
} ProgramNode;

int program_run(const ProgramNode *nodes, int64_t count, int nthreads, int64_t *failed,
                double *seconds) {
    int rc = 0;
    int64_t fail_at = INT64_MAX;
#pragma omp parallel num_threads(nthreads)
    {
        const int tid = omp_get_thread_num(), nt = omp_get_num_threads();
        for (int64_t i = 0; i < count; i++) {
            const double t0 = seconds ? omp_get_wtime() : 0.0;
            const int r = nodes[i].fn(nodes[i].args);
            if (r) {
#pragma omp critical(tessellm_program_failure)
                if (i < __atomic_load_n(&fail_at, __ATOMIC_RELAXED)) {
                    __atomic_store_n(&fail_at, i, __ATOMIC_RELAXED);
                    rc = r;
                }
            }
            const double t1 = seconds ? omp_get_wtime() : 0.0;
#pragma omp barrier
            if (seconds && nt == nthreads) {
                seconds[2 * (i * nthreads + tid)] += t1 - t0;
                seconds[2 * (i * nthreads + tid) + 1] += omp_get_wtime() - t1;
            }
            if (__atomic_load_n(&fail_at, __ATOMIC_RELAXED) <= i) break;
        }
    }
    *failed = rc ? fail_at : -1;
    return rc;
}

/* The threads a program region gets by default (omp_get_max_threads of the caller). */
int program_default_threads(void) { return team_threads(); }
