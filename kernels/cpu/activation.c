/* SwiGLU's activation, silu(gate) * up, for fp32 CPU tensors: one pass over memory in place of
 * several torch ops and their temporaries. Rows are split across threads. */
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
