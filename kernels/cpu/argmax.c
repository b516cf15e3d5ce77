/* Row-wise argmax of fp32 rows: the first index of each row's maximum, as torch.argmax gives it
 * for rows without NaN (greedy sampling over a step's logits). torch's CPU argmax reads a
 * 49152-wide row at a fraction of the memory bandwidth; here each row is read once, in chunks
 * whose maxima are kept (a vectorized max per chunk), then only the first chunk holding the
 * row's maximum is scanned again. Rows are split over the threads. */
#include <math.h>
#include <stdint.h>

#define CHUNK 512

void argmax_rows_f32(const float *x, int64_t stride, int64_t rows, int64_t cols, int64_t *out,
                     int32_t num_threads)
{
    #pragma omp parallel for num_threads(num_threads) schedule(static) if (rows > 1)
    for (int64_t r = 0; r < rows; r++) {
        const float *row = x + r * stride;
        float best = -INFINITY;
        int64_t best_chunk = 0;
        for (int64_t c = 0; c < cols; c += CHUNK) {
            const int64_t end = c + CHUNK < cols ? c + CHUNK : cols;
            float m = -INFINITY;
            for (int64_t i = c; i < end; i++)
                m = row[i] > m ? row[i] : m;
            if (m > best) {  /* strictly greater: an earlier chunk with the same maximum wins */
                best = m;
                best_chunk = c;
            }
        }
        int64_t index = best_chunk;
        for (int64_t i = best_chunk; i < cols; i++) {
            if (row[i] == best) {
                index = i;
                break;
            }
        }
        out[r] = index;
    }
}
