/* The residual add fused with RMSNorm for fp32 CPU tensors: one pass over memory in place of
 * several torch ops and their temporaries. Rows are split across threads. */
#include <stdint.h>

#include "rows.h"

/* In place: residual[r] += x[r]; out[r] = residual[r] / rms(residual[r]) * weight. */
void add_rms_norm_f32(const float *x, float *residual, float *out, const float *weight,
                      int64_t rows, int64_t width, float eps, int32_t num_threads)
{
    #pragma omp parallel for num_threads(num_threads) schedule(static) if (rows * width > 16384)
    for (int64_t r = 0; r < rows; r++)
        add_rms_norm_row(x + r * width, residual + r * width, out + r * width, weight, width, eps);
}
