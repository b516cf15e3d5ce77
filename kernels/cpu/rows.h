/* Row operations of the decoder layers, shared by the one-op kernels (elementwise.c) and the
 * fused decode step (decode_stack.c). */
#ifndef ENGINE_ROWS_H
#define ENGINE_ROWS_H

#include <math.h>
#include <stdint.h>

/* residual += x (x may be NULL: residual as it is); out = residual / rms(residual) * weight. */
static inline void add_rms_norm_row(const float *x, float *residual, float *out, const float *weight,
                                    int64_t width, float eps)
{
    float ss = 0.0f;
    for (int64_t i = 0; i < width; i++) {
        if (x) residual[i] += x[i];
        ss += residual[i] * residual[i];
    }
    const float inv = 1.0f / sqrtf(ss / (float)width + eps);
    for (int64_t i = 0; i < width; i++) out[i] = residual[i] * inv * weight[i];
}

/* Rotate-half rotary embedding of one head in place; sin's first half already negated. */
static inline void rotate_head(float *v, const float *cos, const float *sin, int32_t head_dim)
{
    const int32_t half = head_dim / 2;
    for (int32_t i = 0; i < half; i++) {
        const float a = v[i], b = v[i + half];
        v[i] = a * cos[i] + b * sin[i];
        v[i + half] = b * cos[i + half] + a * sin[i + half];
    }
}

/* out[i] = silu(gate[i]) * up[i]. */
static inline void silu_mul_row(const float *gate, const float *up, float *out, int64_t width)
{
    for (int64_t i = 0; i < width; i++) out[i] = gate[i] / (1.0f + expf(-gate[i])) * up[i];
}

#endif
