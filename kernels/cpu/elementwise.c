/* Fused elementwise kernels of the decoder layers for fp32 CPU tensors: each replaces several
 * torch ops (and their temporaries) with one pass over memory. Rows are split across threads. */
#include <stdint.h>

#include "rows.h"

/* out[r, :w] = silu(x[r, :w]) * x[r, w:2w]; x rows x_stride apart, out rows out_stride apart. */
void silu_and_mul_f32(const float *x, int64_t x_stride, float *out, int64_t out_stride,
                      int64_t rows, int64_t width, int32_t num_threads)
{
    #pragma omp parallel for num_threads(num_threads) schedule(static) if (rows * width > 16384)
    for (int64_t r = 0; r < rows; r++) {
        const float *gate = x + r * x_stride;
        silu_mul_row(gate, gate + width, out + r * out_stride, width);
    }
}

/* In place: residual[r] += x[r]; out[r] = residual[r] / rms(residual[r]) * weight. */
void add_rms_norm_f32(const float *x, float *residual, float *out, const float *weight,
                      int64_t rows, int64_t width, float eps, int32_t num_threads)
{
    #pragma omp parallel for num_threads(num_threads) schedule(static) if (rows * width > 16384)
    for (int64_t r = 0; r < rows; r++)
        add_rms_norm_row(x + r * width, residual + r * width, out + r * width, weight, width, eps);
}

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
