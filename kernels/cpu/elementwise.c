/* Fused elementwise kernels of the decoder layers for fp32 CPU tensors: each replaces several
 * torch ops (and their temporaries) with one pass over memory. Rows are split across threads. */
#include <stdint.h>
#include <math.h>

/* out[r, :w] = silu(x[r, :w]) * x[r, w:2w]; x rows x_stride apart, out rows out_stride apart. */
void silu_and_mul_f32(const float *x, int64_t x_stride, float *out, int64_t out_stride,
                      int64_t rows, int64_t width, int32_t num_threads)
{
    #pragma omp parallel for num_threads(num_threads) schedule(static) if (rows * width > 16384)
    for (int64_t r = 0; r < rows; r++) {
        const float *gate = x + r * x_stride, *up = gate + width;
        float *o = out + r * out_stride;
        for (int64_t i = 0; i < width; i++) o[i] = gate[i] / (1.0f + expf(-gate[i])) * up[i];
    }
}

/* In place: residual[r] += x[r]; out[r] = residual[r] / rms(residual[r]) * weight. */
void add_rms_norm_f32(const float *x, float *residual, float *out, const float *weight,
                      int64_t rows, int64_t width, float eps, int32_t num_threads)
{
    #pragma omp parallel for num_threads(num_threads) schedule(static) if (rows * width > 16384)
    for (int64_t r = 0; r < rows; r++) {
        const float *xr = x + r * width;
        float *res = residual + r * width, *o = out + r * width;
        float ss = 0.0f;
        for (int64_t i = 0; i < width; i++) {
            res[i] += xr[i];
            ss += res[i] * res[i];
        }
        const float inv = 1.0f / sqrtf(ss / (float)width + eps);
        for (int64_t i = 0; i < width; i++) o[i] = res[i] * inv * weight[i];
    }
}

/* Rotate-half rotary embedding in place on heads [T, H, D] (rows token_stride apart, heads
 * packed). cos/sin: [T, D] per-token tables, sin's first half already negated. */
void rotary_f32(float *x, int64_t token_stride, int64_t tokens, int32_t heads, int32_t head_dim,
                const float *cos, const float *sin, int32_t num_threads)
{
    const int32_t half = head_dim / 2;
    #pragma omp parallel for num_threads(num_threads) schedule(static) if (tokens * heads > 512)
    for (int64_t t = 0; t < tokens; t++) {
        const float *c = cos + t * head_dim, *s = sin + t * head_dim;
        for (int32_t h = 0; h < heads; h++) {
            float *v = x + t * token_stride + (int64_t)h * head_dim;
            for (int32_t i = 0; i < half; i++) {
                const float a = v[i], b = v[i + half];
                v[i] = a * c[i] + b * s[i];
                v[i + half] = b * c[i + half] + a * s[i + half];
            }
        }
    }
}
