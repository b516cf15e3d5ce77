/* A step's model inputs gathered from the model runner's persistent request state in one pass:
 * the CPU twin of kernels/prepare_inputs.py (Triton), and of the torch ops in
 * gpu_worker/input_batch.py that both replace. Request i of the step computes tokens
 * qsl[i]..qsl[i+1] of the packed batch, at positions num_computed[slot] onward of slot slots[i];
 * a decode's input id is the token the previous step's post-update wrote into token_ids.
 * Single-threaded: a step has at most a few thousand tokens, a microsecond's work. */
#include <stdint.h>
#include <string.h>

void prepare_inputs_i64(const int64_t *slots, const int32_t *qsl, int64_t num_reqs,
                        const int64_t *num_computed, const int64_t *token_ids,
                        int64_t token_stride, const int32_t *block_table, int64_t block_stride,
                        int64_t block_size, int64_t max_blocks, const int64_t *sample_rows,
                        int64_t num_samples, int64_t *input_ids, int64_t *positions,
                        int32_t *seq_lens, int64_t *slot_mapping, int32_t *block_table_out,
                        int64_t *logits_indices, int64_t *sample_slots)
{
    for (int64_t i = 0; i < num_reqs; i++) {
        const int64_t slot = slots[i], q0 = qsl[i], q1 = qsl[i + 1];
        const int64_t computed = num_computed[slot];
        const int64_t *tokens = token_ids + slot * token_stride;
        const int32_t *blocks = block_table + slot * block_stride;
        seq_lens[i] = (int32_t)(computed + q1 - q0);
        for (int64_t t = q0; t < q1; t++) {
            const int64_t pos = computed + t - q0;
            positions[t] = pos;
            input_ids[t] = tokens[pos];
            slot_mapping[t] = (int64_t)blocks[pos / block_size] * block_size + pos % block_size;
        }
        memcpy(block_table_out + i * max_blocks, blocks, (size_t)max_blocks * sizeof(int32_t));
    }
    for (int64_t j = 0; j < num_samples; j++) {
        const int64_t row = sample_rows[j];
        logits_indices[j] = (int64_t)qsl[row + 1] - 1;
        sample_slots[j] = slots[row];
    }
}
