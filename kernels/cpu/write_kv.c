/* Writing new tokens' keys and values into the paged KV cache for fp32 CPU tensors. */
#include <stdint.h>

#include "fp8.h"

/* Writes token t's key and value (k, v: [T, Hkv, D], rows k_stride / v_stride apart, heads
 * packed) into cache slot slots[t] (block slot / block_size, offset slot % block_size) in the
 * CPU backend's cache layout (paged_attention.c): per block and KV head, keys transposed as
 * [D, block_size] and values as [block_size, D]; negative slots are skipped. */
void write_kv_f32(const float *k, int64_t k_stride, const float *v, int64_t v_stride,
                  const int64_t *slots, int64_t tokens, float *k_cache, float *v_cache,
                  int32_t num_kv_heads, int32_t head_dim, int32_t block_size, int32_t num_threads)
{
    const int64_t head_elems = (int64_t)head_dim * block_size;
    #pragma omp parallel for num_threads(num_threads) schedule(static) if (tokens > 64)
    for (int64_t t = 0; t < tokens; t++) {
        const int64_t slot = slots[t];
        if (slot < 0) continue;
        const int64_t block = slot / block_size, off = slot % block_size;
        for (int32_t h = 0; h < num_kv_heads; h++) {
            const float *kh = k + t * k_stride + (int64_t)h * head_dim;
            const float *vh = v + t * v_stride + (int64_t)h * head_dim;
            float *kc = k_cache + (block * num_kv_heads + h) * head_elems + off;
            float *vc = v_cache + (block * num_kv_heads + h) * head_elems + off * head_dim;
            for (int32_t d = 0; d < head_dim; d++) {
                kc[(int64_t)d * block_size] = kh[d];
                vc[d] = vh[d];
            }
        }
    }
}

/* write_kv_f32 into an fp8 cache (--kv-cache-dtype fp8, bytes in float8_e4m3fn): each key is
 * stored as k / k_scale and each value as v / v_scale, rounded to the nearest e4m3 (ties to
 * even) and saturated at +-448, as torch's x.div(scale).to(torch.float8_e4m3fn). The division
 * is IEEE (not -ffast-math's reciprocal) so the bytes equal torch's. */
__attribute__((optimize("no-fast-math")))
void write_kv_fp8(const float *k, int64_t k_stride, const float *v, int64_t v_stride,
                  const int64_t *slots, int64_t tokens, uint8_t *k_cache, uint8_t *v_cache,
                  int32_t num_kv_heads, int32_t head_dim, int32_t block_size, float k_scale,
                  float v_scale, int32_t num_threads)
{
    const int64_t head_elems = (int64_t)head_dim * block_size;
    #pragma omp parallel for num_threads(num_threads) schedule(static) if (tokens > 64)
    for (int64_t t = 0; t < tokens; t++) {
        const int64_t slot = slots[t];
        if (slot < 0) continue;
        const int64_t block = slot / block_size, off = slot % block_size;
        for (int32_t h = 0; h < num_kv_heads; h++) {
            const float *kh = k + t * k_stride + (int64_t)h * head_dim;
            const float *vh = v + t * v_stride + (int64_t)h * head_dim;
            uint8_t *kc = k_cache + (block * num_kv_heads + h) * head_elems + off;
            uint8_t *vc = v_cache + (block * num_kv_heads + h) * head_elems + off * head_dim;
            for (int32_t d = 0; d < head_dim; d++) {
                kc[(int64_t)d * block_size] = e4m3_from_float(kh[d] / k_scale);
                vc[d] = e4m3_from_float(vh[d] / v_scale);
            }
        }
    }
}
