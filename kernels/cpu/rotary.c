/* The rotate-half rotary embedding for fp32 CPU tensors: one pass over memory in place of
 * several torch ops and their temporaries. Tokens are split across threads. */
#include <stdint.h>

#include "rows.h"

/* Rotate-half rotary embedding in place on heads [T, H, D] (rows token_stride apart, heads
 * packed). cos/sin: [T, D] per-token tables, sin's first half already negated. */
void rotary_f32(float *x, int64_t token_stride, int64_t tokens, int32_t heads, int32_t head_dim,
                const float *cos, const float *sin, int32_t num_threads)
{
    #pragma omp parallel for num_threads(num_threads) schedule(static) if (tokens * heads > 512)
    for (int64_t t = 0; t < tokens; t++)
        for (int32_t h = 0; h < heads; h++)
            rotate_head(x + t * token_stride + (int64_t)h * head_dim, cos + t * head_dim,
                        sin + t * head_dim, head_dim);
}
