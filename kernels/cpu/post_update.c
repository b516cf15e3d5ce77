/* After a step, in the model runner's persistent request state: each request of the step has
 * computed up to seq_lens[i], and each request that sampled gains its sampled token (appended to
 * its row of token_ids) and counts one more output. The CPU twin of kernels/post_update.py's
 * Triton kernel. Slots within a step are distinct, so the order of the writes does not matter. */
#include <stdint.h>

void post_update_i64(const int64_t *slots, const int32_t *seq_lens, int64_t num_reqs,
                     const int64_t *sample_slots, const int64_t *sampled, int64_t num_samples,
                     int64_t *num_computed, int64_t *num_tokens, int64_t *token_ids,
                     int64_t token_stride, int64_t *num_output)
{
    for (int64_t i = 0; i < num_reqs; i++)
        num_computed[slots[i]] = seq_lens[i];
    for (int64_t j = 0; j < num_samples; j++) {
        const int64_t slot = sample_slots[j];
        token_ids[slot * token_stride + num_tokens[slot]] = sampled[j];
        num_tokens[slot] += 1;
        num_output[slot] += 1;
    }
}
