/* Structured outputs: set to -inf every logit a grammar's token bitmask forbids. Bit b of word w
 * of a bitmask row allows token 32 * w + b (xgrammar's layout). Most words of a row are all-zero
 * (a stretch of 32 forbidden tokens, filled like a memset) or all-ones (left alone). */
#include <stdint.h>
#include <math.h>

void apply_token_bitmask_f32(float *logits, int64_t logits_stride, const int32_t *bitmask,
                             int64_t bitmask_stride, const int64_t *rows, int64_t num_rows,
                             int64_t vocab_size, int32_t num_threads)
{
    const int64_t full_words = vocab_size / 32, tail = vocab_size % 32;
    #pragma omp parallel for num_threads(num_threads) schedule(static) if (num_rows > 8)
    for (int64_t i = 0; i < num_rows; i++) {
        float *row = logits + rows[i] * logits_stride;
        const int32_t *mask = bitmask + i * bitmask_stride;
        for (int64_t w = 0; w < full_words; w++) {
            const uint32_t bits = (uint32_t)mask[w];
            float *x = row + 32 * w;
            if (bits == 0xFFFFFFFFu)
                continue;
            if (bits == 0) {
                for (int b = 0; b < 32; b++) x[b] = -INFINITY;
                continue;
            }
            for (int b = 0; b < 32; b++) x[b] = (bits >> b) & 1u ? x[b] : -INFINITY;
        }
        if (tail) {
            const uint32_t bits = (uint32_t)mask[full_words];
            float *x = row + 32 * full_words;
            for (int b = 0; b < tail; b++) x[b] = (bits >> b) & 1u ? x[b] : -INFINITY;
        }
    }
}
