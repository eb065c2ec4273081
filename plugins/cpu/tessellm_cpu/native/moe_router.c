/* The mixture-of-experts router for the tessellm CPU plugin (op moe_router,
 * tessellm.kernels.reference_moe): per token, the top K of E experts by probability (a softmax
 * over the token's E logits, or a sigmoid per expert), largest first (ties: the lower id),
 * with the chosen weights divided by their sum when `renormalize`. Float32 throughout; one
 * team kernel, so a decode step's router is a node of its native program.
 * Layouts: logits float32 [T, E] (row stride `stride`), weights float32 [T, K], ids int64
 * [T, K]. */
#include <math.h>
#include <stdint.h>

#include "team.h"

#define MAX_EXPERTS 1024

typedef struct {
    const float *logits;
    int64_t stride, T, E, K;
    int renormalize, sigmoid;
    float *weights;
    int64_t *ids;
} MoeRouterArgs;

/* Returns 0, or 1 when K is not in 1..E or E exceeds MAX_EXPERTS. */
int moe_router_team(const MoeRouterArgs *a) {
    const int64_t E = a->E, K = a->K;
    if (E < 1 || E > MAX_EXPERTS || K < 1 || K > E) return 1;
#pragma omp for schedule(static) nowait
    for (int64_t t = 0; t < a->T; t++) {
        const float *l = a->logits + t * a->stride;
        float p[MAX_EXPERTS];
        unsigned char taken[MAX_EXPERTS];
        if (a->sigmoid) {
            for (int64_t e = 0; e < E; e++) p[e] = 1.f / (1.f + expf(-l[e]));
        } else {
            float m = l[0], s = 0.f;
            for (int64_t e = 1; e < E; e++) m = l[e] > m ? l[e] : m;
            for (int64_t e = 0; e < E; e++) s += (p[e] = expf(l[e] - m));
            for (int64_t e = 0; e < E; e++) p[e] /= s;
        }
        for (int64_t e = 0; e < E; e++) taken[e] = 0;
        float *w = a->weights + t * K, sum = 0.f;
        int64_t *ids = a->ids + t * K;
        for (int64_t j = 0; j < K; j++) {
            int64_t best = -1;
            for (int64_t e = 0; e < E; e++)
                if (!taken[e] && (best < 0 || p[e] > p[best])) best = e;
            taken[best] = 1;
            ids[j] = best;
            sum += (w[j] = p[best]);
        }
        if (a->renormalize)
            for (int64_t j = 0; j < K; j++) w[j] /= sum;
    }
    return 0;
}

int moe_router_run(const MoeRouterArgs *a) {
    return team_run((TeamKernel)moe_router_team, a, team_threads(), a->T * a->E < 16384);
}
