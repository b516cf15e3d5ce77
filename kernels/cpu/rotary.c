/* The rotate-half rotary embedding for fp32 CPU tensors: one pass over memory in place of
 * several torch ops and their temporaries. Tokens are split across threads. */
#include <stdint.h>

#include "rows.h"

/* Rotate-half rotary embedding in place on heads [T, H, D] (rows token_stride apart, heads
 * packed): the first rotary_dim (R) dims of each head turn, the rest pass through (Phi's
 * partial rotary). cos/sin: [T, R] per-token tables, sin's first half already negated. */
void rotary_f32(float *x, int64_t token_stride, int64_t tokens, int32_t heads, int32_t head_dim,
                int32_t rotary_dim, const float *cos, const float *sin, int32_t num_threads)
{
    #pragma omp parallel for num_threads(num_threads) schedule(static) if (tokens * heads > 512)
    for (int64_t t = 0; t < tokens; t++)
        for (int32_t h = 0; h < heads; h++)
            rotate_head(x + t * token_stride + (int64_t)h * head_dim, cos + t * rotary_dim,
                        sin + t * rotary_dim, rotary_dim);
}

/* Qwen3's per-head q/k RMSNorm then the rotary embedding, in place on x [T, q_heads + k_heads, D]
 * (rows token_stride apart, heads packed): q heads scaled by q_weight [D], k heads by k_weight.
 * One pass where torch runs two norms and two rotations with their temporaries (a 2048-token
 * prefill step of 8 + 2 heads of 64: 10 ms a layer). */
void qk_norm_rotary_f32(float *x, int64_t token_stride, int64_t tokens, int32_t q_heads,
                        int32_t k_heads, int32_t head_dim, const float *q_weight,
                        const float *k_weight, float eps, const float *cos, const float *sin,
                        int32_t num_threads)
{
    const int32_t heads = q_heads + k_heads;
    #pragma omp parallel for num_threads(num_threads) schedule(static) if (tokens * heads > 512)
    for (int64_t t = 0; t < tokens; t++)
        for (int32_t h = 0; h < heads; h++) {
            float *v = x + t * token_stride + (int64_t)h * head_dim;
            add_rms_norm_row(0, v, v, h < q_heads ? q_weight : k_weight, head_dim, eps);
            rotate_head(v, cos + t * head_dim, sin + t * head_dim, head_dim);
        }
}
