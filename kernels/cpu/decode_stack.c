/* A whole decode step of a Llama-family decoder in one call: every layer's norms, projections,
 * rotary embedding, KV write, paged attention and SwiGLU for a few rows (one new token per
 * request), inside one OpenMP parallel region.
 *
 * Decode of a small model at batch 1 reads ~100 MB of weights per step, ~3 ms at this machine's
 * bandwidth; the same step as one Python call per op (~12 a layer) spent three times that in
 * dispatch and thread wake-ups. Here the threads stay up for the whole step and meet at a
 * barrier between ops (about a microsecond with 2 threads), so the step costs what its weight
 * reads cost. The math is that of the one-op kernels (the same row functions, the few-rows
 * quantized product of quant_linear.c, the fp32 blocked GEMM tiles, the paged attention of
 * paged_attention.c), so results equal the layer-by-layer path up to summation order.
 *
 * Weights: GGUF-quantized (packed by kernels/gguf_quant.py) or fp32 in the blocked
 * [N/32, K, 32] layout (type 0); the gate/up projection may also be fp32 blocked in pairs
 * ([I/32, 2, K, 32], type -1). Gate and up blocks j go to the same thread, which applies
 * silu * mul on them at once, so the [M, 2I] intermediate never exists.
 */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <omp.h>

#include "gemm_tile.h"
#include "rows.h"

enum { F32_BLOCKED = 0, F32_PAIRS = -1 };
#define MAX_ROWS 16

/* quant_linear.c and paged_attention.c */
int64_t quant_block_bytes(int32_t type, int32_t K);
int32_t quant_group(int32_t type);
void quant_row_sums(int32_t type, const float *x, int64_t ldx, int64_t M, int32_t K, float *xsum);
void quant_few_block(int32_t type, const float *x, int64_t ldx, const float *xsum,
                     const uint8_t *w, const float *bias, float *y, int64_t ldy, int64_t M,
                     int32_t K, int32_t N, int32_t nb);
size_t paged_attention_scratch_floats(int32_t group, int32_t head_dim);
void paged_attention_decode_head(const float *q, float *out, const float *k_cache,
                                 const float *v_cache, const int32_t *block_table, int32_t seq_len,
                                 int32_t group, int32_t num_kv_heads, int32_t kv_head,
                                 int32_t head_dim, int32_t block_size, float scale, float *scratch);

typedef struct {
    int64_t type, n, k;  /* GGML type (or F32_BLOCKED / F32_PAIRS); [n, k] */
    const void *data;
    const float *bias;   /* [n] or NULL */
} dweight_t;

typedef struct {
    const float *input_norm, *post_norm;  /* [hidden] */
    dweight_t qkv, o, gate_up, down;
    float *k_cache, *v_cache;             /* the CPU backend's layout (paged_attention.c) */
} dlayer_t;

typedef struct {
    int64_t num_layers, hidden, heads, kv_heads, head_dim, intermediate, block_size;
    double eps, scale;
    const dlayer_t *layers;
    const float *final_norm;
} dmodel_t;

static int64_t max3(int64_t a, int64_t b, int64_t c) { return a > b ? (a > c ? a : c) : (b > c ? b : c); }

/* Floats of the work buffer for M rows (see the layout in decode_stack_f32). */
int64_t decode_stack_work_floats(const dmodel_t *m, int64_t M)
{
    const int64_t q = m->heads * m->head_dim, kv = m->kv_heads * m->head_dim;
    return M * (2 * m->hidden + q + 2 * kv + q + m->intermediate
                + max3(m->hidden, q, m->intermediate)); /* xsum: groups of at least 1 */
}

/* Block nb's 32 columns of x @ W^T + bias for M rows, into y (the block's first column). */
static void project_block(const dweight_t *w, const float *x, int64_t ldx, const float *xsum,
                          float *y, int64_t ldy, int64_t M, int64_t nb)
{
    if (w->type == F32_BLOCKED)
        block_tiles(x, ldx, (const float *)w->data + nb * w->k * 32, w->bias ? w->bias + nb * 32 : 0,
                    0, y, ldy, M, (int32_t)w->k);
    else
        quant_few_block((int32_t)w->type, x, ldx, xsum, w->data, w->bias, y, ldy, M,
                        (int32_t)w->k, (int32_t)w->n, (int32_t)nb);
}

/* The gate (g) and up (u) blocks j of the fused gate/up projection, [M, 32] each. */
static void gate_up_blocks(const dweight_t *w, const float *x, int64_t ldx, const float *xsum,
                           float *g, float *u, int64_t M, int64_t j, int64_t inter)
{
    if (w->type == F32_PAIRS) {
        const float *wg = (const float *)w->data + j * 2 * w->k * 32;
        block_tiles(x, ldx, wg, 0, 0, g, 32, M, (int32_t)w->k);
        block_tiles(x, ldx, wg + w->k * 32, 0, 0, u, 32, M, (int32_t)w->k);
        return;
    }
    project_block(w, x, ldx, xsum, g, 32, M, j);
    project_block(w, x, ldx, xsum, u, 32, M, j + inter / 32);
}

static void row_sums(const dweight_t *w, const float *x, int64_t ldx, int64_t M, float *xsum)
{
    if (w->type > 0) quant_row_sums((int32_t)w->type, x, ldx, M, (int32_t)w->k, xsum);
}

static int64_t blocks(const dweight_t *w) { return (w->n + 31) / 32; }

/* One decode step. x: [M, hidden] the rows' embeddings; out: [M, hidden] the final norm's output;
 * cos, sin: [M, head_dim] rotary tables (sin's first half negated); slots: [M] KV cache slots
 * (negative: not written); block_tables: [M, bt_stride]; seq_lens: [M] context lengths with the
 * new token; work: decode_stack_work_floats(m, M) floats. Returns 0; -1 for M outside
 * [1, MAX_ROWS] or a gate/up size that is not a multiple of 32; -2 when scratch memory ran out. */
int32_t decode_stack_f32(const dmodel_t *m, const float *x, float *out, int64_t M, const float *cos,
                         const float *sin, const int64_t *slots, const int32_t *block_tables,
                         int64_t bt_stride, const int32_t *seq_lens, float *work,
                         int32_t num_threads)
{
    if (M < 1 || M > MAX_ROWS || m->intermediate % 32) return -1;
    const int64_t H = m->hidden, D = m->head_dim, I = m->intermediate;
    const int64_t q_size = m->heads * D, kv_size = m->kv_heads * D, qkv_size = q_size + 2 * kv_size;
    const int32_t group = (int32_t)(m->heads / m->kv_heads), bs = (int32_t)m->block_size;
    const float eps = (float)m->eps;
    float *residual = work, *xn = residual + M * H, *qkv = xn + M * H, *attn = qkv + M * qkv_size;
    float *h = attn + M * q_size, *xsum = h + M * I, *layer_out = out;
    const size_t scratch_floats = paged_attention_scratch_floats(group, (int32_t)D);
    int failed = 0;
    memcpy(residual, x, sizeof(float) * M * H);

    #pragma omp parallel num_threads(num_threads)
    {
        const unsigned csr = ftz_enter();
        float *scratch = malloc(sizeof(float) * (scratch_floats + 2 * MAX_ROWS * 32));
        if (!scratch) {
            #pragma omp atomic write
            failed = 1;
        }
        #pragma omp barrier
        for (int64_t l = 0; l < m->num_layers && !failed; l++) {
            const dlayer_t *ly = &m->layers[l];
            #pragma omp single
            {
                for (int64_t r = 0; r < M; r++)
                    add_rms_norm_row(l ? layer_out + r * H : 0, residual + r * H, xn + r * H,
                                     ly->input_norm, H, eps);
                row_sums(&ly->qkv, xn, H, M, xsum);
            }
            #pragma omp for schedule(static)
            for (int64_t nb = 0; nb < blocks(&ly->qkv); nb++)
                project_block(&ly->qkv, xn, H, xsum, qkv + nb * 32, qkv_size, M, nb);
            /* Per (row, KV head): rotate its query heads and key, store key and value, attend. */
            #pragma omp for schedule(dynamic, 1)
            for (int64_t item = 0; item < M * m->kv_heads; item++) {
                const int64_t r = item / m->kv_heads, kvh = item % m->kv_heads;
                float *row = qkv + r * qkv_size;
                float *k = row + q_size + kvh * D, *v = k + kv_size;
                for (int64_t g = 0; g < group; g++)
                    rotate_head(row + (kvh * group + g) * D, cos + r * D, sin + r * D, (int32_t)D);
                rotate_head(k, cos + r * D, sin + r * D, (int32_t)D);
                if (slots[r] >= 0) {
                    const int64_t block = slots[r] / bs, off = slots[r] % bs;
                    const int64_t base = (block * m->kv_heads + kvh) * D * bs;
                    for (int64_t d = 0; d < D; d++) {
                        ly->k_cache[base + d * bs + off] = k[d];
                        ly->v_cache[base + off * D + d] = v[d];
                    }
                }
                paged_attention_decode_head(row, attn + r * q_size, ly->k_cache, ly->v_cache,
                                            block_tables + r * bt_stride, seq_lens[r], group,
                                            (int32_t)m->kv_heads, (int32_t)kvh, (int32_t)D, bs,
                                            (float)m->scale, scratch);
            }
            #pragma omp single
            row_sums(&ly->o, attn, q_size, M, xsum);
            #pragma omp for schedule(static)
            for (int64_t nb = 0; nb < blocks(&ly->o); nb++)
                project_block(&ly->o, attn, q_size, xsum, layer_out + nb * 32, H, M, nb);
            #pragma omp single
            {
                for (int64_t r = 0; r < M; r++)
                    add_rms_norm_row(layer_out + r * H, residual + r * H, xn + r * H,
                                     ly->post_norm, H, eps);
                row_sums(&ly->gate_up, xn, H, M, xsum);
            }
            #pragma omp for schedule(static)
            for (int64_t j = 0; j < I / 32; j++) {
                float *g = scratch + scratch_floats, *u = g + MAX_ROWS * 32;
                gate_up_blocks(&ly->gate_up, xn, H, xsum, g, u, M, j, I);
                for (int64_t r = 0; r < M; r++) silu_mul_row(g + r * 32, u + r * 32, h + r * I + j * 32, 32);
            }
            #pragma omp single
            row_sums(&ly->down, h, I, M, xsum);
            #pragma omp for schedule(static)
            for (int64_t nb = 0; nb < blocks(&ly->down); nb++)
                project_block(&ly->down, h, I, xsum, layer_out + nb * 32, H, M, nb);
        }
        free(scratch);
        ftz_leave(csr);
    }
    if (failed) return -2;
    for (int64_t r = 0; r < M; r++)
        add_rms_norm_row(out + r * H, residual + r * H, out + r * H, m->final_norm, H, eps);
    return 0;
}
