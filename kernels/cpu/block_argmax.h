/* The argmax of an output projection kept per thread, 32 columns at a time, for the kernels that
 * fuse greedy decoding's argmax into the projection (linear.c, quant_linear.c): the logits are
 * never written whole. Equal maxima give the first column, as torch.argmax does; a row with no
 * number in it gives column 0. */
#pragma once

#include <math.h>
#include <stdint.h>

/* Rows y [M, 32] hold columns [first, first + cols) of the logits: fold them into each row's
 * best value bv[m] and its column bi[m] (bv starts at -INFINITY). */
static inline void block_argmax_update(const float *y, int64_t M, int32_t cols, int64_t first,
                                       float *bv, int64_t *bi)
{
    for (int64_t m = 0; m < M; m++) {
        const float *row = y + m * 32;
        float mx = -INFINITY;
        for (int32_t c = 0; c < cols; c++)  /* vectorized: most blocks stop here */
            mx = row[c] > mx ? row[c] : mx;
        if (mx > bv[m]) {
            int32_t c = 0;
            while (row[c] != mx)
                c++;
            bv[m] = mx;
            bi[m] = first + c;
        }
    }
}

/* out[m]: the best of the threads' bests for row m, threads in column order, their values and
 * columns `stride` apart (thread t's row m at t * stride + m). */
static inline void block_argmax_merge(const float *best, const int64_t *where, int64_t stride,
                                      int threads, int64_t M, int64_t *out)
{
    for (int64_t m = 0; m < M; m++) {
        float b = best[m];
        int64_t i = where[m];
        for (int t = 1; t < threads; t++)
            if (best[t * stride + m] > b) {
                b = best[t * stride + m];
                i = where[t * stride + m];
            }
        out[m] = b == -INFINITY ? 0 : i;
    }
}
