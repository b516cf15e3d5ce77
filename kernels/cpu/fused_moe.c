/* A mixture of experts' gated MLPs for all tokens of a step, fp32 on the CPU, in one call: the
 * (token, k) pairs counted and sorted by local expert, each expert's tokens gathered, then
 * h = act(x @ W_gate^T + b, x @ W_up^T + b) and out[token] += weight * (h @ W_down^T + b).
 *
 * Weights blocked per expert as linear.c's GEMM reads them: w13 [E, I/32, 2, H, 32] (gate block
 * j, then up block j) and w2 [E, H/32, I, 32]. Each active expert's weights are read once per
 * step: gate and up as one work item per (active expert, 32 columns of I), so every thread has
 * work even at one token (a decode step's 8 experts x I/32 blocks); the down projection with
 * threads owning 32-column blocks of out and looping over the experts, so each adds into its own
 * columns without atomics. Per-pair scratch (the gathered x, h) is small beside the weights:
 * rows x (H + I) floats.
 */
#include <math.h>
#include <omp.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "gemm_tile.h"

enum { ACT_SILU = 0, ACT_SWIGLUOAI = 1 };

static inline float activate(float g, float u, int32_t activation, int32_t has_limit, float limit)
{
    if (activation == ACT_SILU)
        return g / (1.0f + expf(-g)) * u;
    if (has_limit) {
        g = fminf(g, limit);
        u = fminf(fmaxf(u, -limit), limit);
    }
    return (u + 1.0f) * (g / (1.0f + expf(-1.702f * g)));
}

/* x: [T, H] rows ldx apart; topk_ids [T, top_k] (global ids < num_global), topk_weights [T, top_k];
 * expert_map [num_global] -> local id or -1 (another rank's), or NULL (ids are local); b13 [E, 2I]
 * and b2 [E, H] or NULL; out: [T, H] rows ldo apart, overwritten. H and I multiples of 32.
 * Returns 0, 1 for an expert id out of range, 2 when scratch cannot be allocated. */
int32_t fused_moe_f32(const float *x, int64_t ldx, int64_t T, int32_t H, const int64_t *topk_ids,
                      const float *topk_weights, int32_t top_k, const int64_t *expert_map,
                      int64_t num_global, const float *w13, const float *b13, const float *w2,
                      const float *b2, int32_t E, int32_t I, int32_t activation, int32_t has_limit,
                      float limit, float *out, int64_t ldo, int32_t num_threads)
{
    const int64_t P = T * top_k;
    int64_t *start = calloc((size_t)E + 1, sizeof(int64_t));
    int64_t *local = malloc(sizeof(int64_t) * (size_t)(P > 0 ? P : 1));
    if (!start || !local) {
        free(start);
        free(local);
        return 2;
    }
    /* Counting sort by local expert: start[e] .. start[e + 1] are expert e's rows. */
    for (int64_t p = 0; p < P; p++) {
        int64_t e = topk_ids[p];
        if (e < 0 || e >= num_global) {
            free(start);
            free(local);
            return 1;
        }
        if (expert_map)
            e = expert_map[e];
        if (e >= E) {
            free(start);
            free(local);
            return 1;
        }
        local[p] = e;
        if (e >= 0)
            start[e + 1]++;
    }
    int64_t most = 0;
    for (int32_t e = 0; e < E; e++) {
        most = start[e + 1] > most ? start[e + 1] : most;
        start[e + 1] += start[e];
    }
    const int64_t rows = start[E];
    int64_t *pair_of = malloc(sizeof(int64_t) * (size_t)(rows > 0 ? rows : 1));
    int64_t *next = malloc(sizeof(int64_t) * ((size_t)E + 1));
    float *xs = malloc(sizeof(float) * (size_t)(rows * H + 1));
    float *hs = malloc(sizeof(float) * (size_t)(rows * I + 1));
    float *scratch = malloc(sizeof(float) * (size_t)(num_threads * 2 * (most * 32 + 1)));
    int32_t *active = malloc(sizeof(int32_t) * ((size_t)E + 1));
    if (!pair_of || !next || !xs || !hs || !scratch || !active) {
        free(pair_of), free(next), free(xs), free(hs), free(scratch), free(active);
        free(start), free(local);
        return 2;
    }
    int32_t n_active = 0; /* the experts with pairs, in order */
    for (int32_t e = 0; e < E; e++)
        if (start[e + 1] > start[e])
            active[n_active++] = e;
    memcpy(next, start, sizeof(int64_t) * (size_t)E);
    for (int64_t p = 0; p < P; p++)
        if (local[p] >= 0)
            pair_of[next[local[p]]++] = p;

    const int32_t iblocks = I / 32, hblocks = H / 32;
    #pragma omp parallel num_threads(num_threads)
    {
        const unsigned csr = ftz_enter();
        float *g = scratch + (int64_t)omp_get_thread_num() * 2 * (most * 32 + 1);
        float *u = g + most * 32 + 1;
        #pragma omp for schedule(static)
        for (int64_t r = 0; r < rows; r++)
            memcpy(xs + r * H, x + pair_of[r] / top_k * ldx, sizeof(float) * (size_t)H);
        /* Gate and up: one work item per (active expert, column block), so many threads share
         * out a decode step's few experts evenly; each item writes its own part of h. */
        #pragma omp for schedule(static)
        for (int64_t item = 0; item < (int64_t)n_active * iblocks; item++) {
            const int32_t e = active[item / iblocks], jb = (int32_t)(item % iblocks);
            const int64_t m0 = start[e], M = start[e + 1] - m0;
            const float *wg = w13 + ((int64_t)e * iblocks + jb) * 2 * H * 32;
            const float *bg = b13 ? b13 + (int64_t)e * 2 * I + jb * 32 : 0;
            block_tiles(xs + m0 * H, H, wg, bg, 0, g, 32, M, H);
            block_tiles(xs + m0 * H, H, wg + (int64_t)H * 32, bg ? bg + I : 0, 0, u, 32, M, H);
            for (int64_t m = 0; m < M; m++) {
                float *h = hs + (m0 + m) * I + jb * 32;
                for (int c = 0; c < 32; c++)
                    h[c] = activate(g[m * 32 + c], u[m * 32 + c], activation, has_limit, limit);
            }
        }
        /* Each thread zeroes its own columns of out here: one barrier fewer than a pass of its
         * own (a barrier costs a scheduler slice when another process holds a core). */
        #pragma omp for schedule(static)
        for (int32_t nb = 0; nb < hblocks; nb++) {
            for (int64_t t = 0; t < T; t++)
                memset(out + t * ldo + nb * 32, 0, sizeof(float) * 32);
            for (int32_t i = 0; i < n_active; i++) {
                const int32_t e = active[i];
                const int64_t m0 = start[e], M = start[e + 1] - m0;
                const float *wd = w2 + ((int64_t)e * hblocks + nb) * I * 32;
                const float *bd = b2 ? b2 + (int64_t)e * H + nb * 32 : 0;
                block_tiles(hs + m0 * I, I, wd, bd, 0, g, 32, M, I);
                for (int64_t m = 0; m < M; m++) {
                    const int64_t p = pair_of[m0 + m];
                    const float w = topk_weights[p];
                    float *o = out + p / top_k * ldo + nb * 32;
                    for (int c = 0; c < 32; c++)
                        o[c] += w * g[m * 32 + c];
                }
            }
        }
        ftz_leave(csr);
    }
    free(pair_of), free(next), free(xs), free(hs), free(scratch), free(active);
    free(start), free(local);
    return 0;
}
