/* A whole decode step of a Llama-family decoder in one call: every layer's norms, projections,
 * rotary embedding, KV write, paged attention and SwiGLU for a few rows (one new token per
 * request), inside one OpenMP parallel region.
 *
 * Decode of a small model at batch 1 reads ~100 MB of weights per step, ~3 ms at this machine's
 * bandwidth; the same step as one Python call per op (~12 a layer) spent three times that in
 * dispatch and thread wake-ups. Here the threads stay up for the whole step and meet at five
 * barriers a layer (under a microsecond each with 2 threads), so the step costs about what its
 * weight and KV reads cost. The math is that of the one-op kernels (the same row functions, the
 * few-rows quantized product of quant_linear.c, the fp32 blocked GEMM tiles; the attention is
 * paged_attention.c's online softmax over the same cache layout, its context cut into parts
 * where that spreads the work over the threads, merged by their maxima and sums), so results
 * equal the layer-by-layer path up to summation order.
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

/* quant_linear.c */
int64_t quant_block_bytes(int32_t type, int32_t K);
int32_t quant_group(int32_t type);
void quant_row_sums(int32_t type, const float *x, int64_t ldx, int64_t M, int32_t K, float *xsum);
void quant_few_block(int32_t type, const float *x, int64_t ldx, const float *xsum,
                     const uint8_t *w, const float *bias, float *y, int64_t ldy, int64_t M,
                     int32_t K, int32_t N, int32_t nb);

typedef struct {
    int64_t type, n, k;  /* GGML type (or F32_BLOCKED / F32_PAIRS); [n, k] */
    const void *data;
    const float *bias;   /* [n] or NULL */
} dweight_t;

typedef struct {
    const float *input_norm, *post_norm;  /* [hidden] */
    dweight_t qkv, o, gate_up, down;
    float *k_cache, *v_cache;             /* the CPU backend's layout (paged_attention.c) */
    int64_t window;                       /* > 0: attend to the last `window` positions only */
} dlayer_t;

typedef struct {
    int64_t num_layers, hidden, heads, kv_heads, head_dim, intermediate, block_size;
    double eps, scale;
    const dlayer_t *layers;
    const float *final_norm;
} dmodel_t;

/* Per-part timing (build with -DDECODE_STACK_PROFILE; `python -m bench.single_stream --parts`):
 * seconds per thread and part, summed over calls, read with decode_stack_profile(). Parts, as
 * the MARK()s in decode_stack_f32 end them: 0 input norm, 1 qkv, 2 wait, 3 attention, 4 wait,
 * 5 merge of the attention parts, 6 o, 7 wait, 8 post-attention norm, 9 gate/up, 10 wait,
 * 11 down's sums, 12 down, 13 wait (kernels/decode_stack.py PROFILE_PARTS names them). */
#define PROFILE_THREADS 8
#define PROFILE_PARTS 16
#ifdef DECODE_STACK_PROFILE
static double profile[PROFILE_THREADS][PROFILE_PARTS];
#define MARK(part)                                                                                 \
    do {                                                                                           \
        const double now_ = omp_get_wtime();                                                       \
        if (tid_ < PROFILE_THREADS) profile[tid_][part] += now_ - last_;                           \
        last_ = now_;                                                                              \
    } while (0)
#define MARK_START const int tid_ = omp_get_thread_num(); double last_ = omp_get_wtime()
#else
#define MARK(part) ((void)0)
#define MARK_START ((void)0)
#endif

/* Copies the per-part seconds into out [PROFILE_THREADS, PROFILE_PARTS] and clears them; returns
 * 0, or -1 in a build without the timing. */
int32_t decode_stack_profile(double *out)
{
#ifdef DECODE_STACK_PROFILE
    memcpy(out, profile, sizeof profile);
    memset(profile, 0, sizeof profile);
    return 0;
#else
    (void)out;
    return -1;
#endif
}

static int64_t max3(int64_t a, int64_t b, int64_t c) { return a > b ? (a > c ? a : c) : (b > c ? b : c); }

#define MAX_THREADS 4096 /* a sanity bound on the threads asked for */
#define MAX_GROUP 16   /* query heads per KV head */
#define MAX_SPLITS 16  /* parts of one row's context attended by different threads */
#define MIN_SPLIT 32   /* positions a part covers at least */

/* Parts each (row, KV head)'s context is cut into: enough that the items spread evenly over
 * the threads (3 KV heads on 2 threads: 2 parts each, 3 items a thread, where whole heads gave
 * one thread twice the other's), none shorter than MIN_SPLIT positions. */
static int32_t attention_splits(int64_t heads, int32_t threads, int32_t max_len)
{
    int32_t splits = 1;
    while (splits < MAX_SPLITS && (heads * splits) % threads && (int64_t)max_len >= 2 * MIN_SPLIT * splits)
        splits++;
    while (splits < MAX_SPLITS && heads * splits < threads && max_len >= 2 * MIN_SPLIT * splits)
        splits *= 2;
    return splits < MAX_SPLITS ? splits : MAX_SPLITS;
}

/* The first position of part `part` of `splits` over len positions: a multiple of 16, so a part's
 * 16-position pieces never straddle cache blocks. */
static int32_t split_point(int32_t len, int64_t part, int32_t splits)
{
    return part >= splits ? len : (int32_t)((int64_t)len * part / splits) & ~15;
}

/* Thread t's share [lo, hi) of n items, contiguous. */
static void span(int64_t n, int t, int nt, int64_t *lo, int64_t *hi)
{
    *lo = n * t / nt;
    *hi = n * (t + 1) / nt;
}

/* Floats of one thread's own buffers for M rows: residual, normed rows, attention output, the
 * groups' sums, gate and up blocks. */
static int64_t thread_floats(const dmodel_t *m, int64_t M)
{
    const int64_t q = m->heads * m->head_dim;
    return M * (2 * m->hidden + q + max3(m->hidden, q, m->intermediate)) + 2 * MAX_ROWS * 32 + 16;
}

/* Floats of the work buffer for M rows and `threads` threads (see decode_stack_f32). */
int64_t decode_stack_work_floats(const dmodel_t *m, int64_t M, int32_t threads)
{
    const int64_t q = m->heads * m->head_dim, kv = m->kv_heads * m->head_dim;
    const int64_t group = m->heads / m->kv_heads;
    return M * (q + 2 * kv + m->intermediate)
           + M * m->kv_heads * MAX_SPLITS * group * (m->head_dim + 2)
           + (int64_t)threads * thread_floats(m, M);
}

/* Attention of one token's `group` query vectors q [group, D] (rotated, not yet scaled) over
 * positions [max(p0, lo), p1) of one KV head (p0 a multiple of 16; lo the sliding window's first
 * position, whose piece is read but not counted), in 16-position pieces (one cache
 * block's keys [D, bs] give 16 scores per query in D vector FMAs) and 64-position chunks of the
 * online softmax. Writes the part, per query: its running max, its sum of exponentials and its
 * unnormalised output [D]. */
#define ATT_Q 4      /* query vectors per pass over the keys */
#define ATT_CHUNK 64 /* positions per softmax step */
#define MASKED (-1e30f) /* finite: the library is built with -ffast-math */
#define DEFINE_ATTEND(D)                                                                           \
static void attend_range_##D(const float *q, int32_t group, const float *k_cache,                 \
                             const float *v_cache, const int32_t *bt, int64_t kv_heads,            \
                             int64_t kvh, int32_t bs, float scale, int32_t p0, int32_t p1,         \
                             int32_t lo, float *part)                                              \
{                                                                                                  \
    enum { NP = 16 / VW, V = D / VW };                                                             \
    const int64_t head_elems = (int64_t)D * bs;                                                    \
    for (int32_t g0 = 0; g0 < group; g0 += ATT_Q) {                                                \
        const int nq = group - g0 < ATT_Q ? group - g0 : ATT_Q;                                    \
        float qs[ATT_Q][D], s[ATT_Q][ATT_CHUNK], mx[ATT_Q], sum[ATT_Q];                            \
        vf acc[ATT_Q][V];                                                                          \
        for (int gq = 0; gq < ATT_Q; gq++) {                                                       \
            for (int d = 0; d < D; d++) qs[gq][d] = gq < nq ? q[(g0 + gq) * D + d] * scale : 0.0f; \
            mx[gq] = MASKED;                                                                       \
            sum[gq] = 0.0f;                                                                        \
            for (int j = 0; j < V; j++) acc[gq][j] = (vf){0};                                      \
        }                                                                                          \
        for (int32_t c0 = p0; c0 < p1; c0 += ATT_CHUNK) {                                          \
            const int32_t n = p1 - c0 < ATT_CHUNK ? p1 - c0 : ATT_CHUNK;                           \
            const float *vb[ATT_CHUNK / 16]; /* each piece's first value row */                    \
            for (int32_t t0 = 0; t0 < n; t0 += 16) {                                               \
                const int32_t at = c0 + t0;                                                        \
                const int64_t block = ((int64_t)bt[at / bs] * kv_heads + kvh) * head_elems;        \
                const float *kb = k_cache + block + at % bs;                                       \
                vb[t0 / 16] = v_cache + block + (int64_t)(at % bs) * D;                            \
                /* The next piece lies in another block, where the hardware prefetcher does not \
                 * follow: its keys (a line per d) and values (D lines) are fetched meanwhile. */ \
                const int32_t next = at + 16 < p1 ? at + 16 : at;                                  \
                const int64_t next_block = ((int64_t)bt[next / bs] * kv_heads + kvh) * head_elems; \
                const float *kn = k_cache + next_block + next % bs;                                \
                const float *vn = v_cache + next_block + (int64_t)(next % bs) * D;                 \
                vf a[ATT_Q][NP];                                                                   \
                _Pragma("GCC unroll 8") for (int gq = 0; gq < ATT_Q; gq++)                         \
                    _Pragma("GCC unroll 4") for (int c = 0; c < NP; c++) a[gq][c] = (vf){0};       \
                for (int d = 0; d < D; d++) {                                                      \
                    __builtin_prefetch(kn + (int64_t)d * bs);                                      \
                    __builtin_prefetch(vn + d * 16);                                               \
                    vf kv[NP];                                                                     \
                    _Pragma("GCC unroll 4") for (int c = 0; c < NP; c++)                           \
                        kv[c] = loadv(kb + (int64_t)d * bs + c * VW);                              \
                    _Pragma("GCC unroll 8") for (int gq = 0; gq < ATT_Q; gq++)                     \
                        _Pragma("GCC unroll 4") for (int c = 0; c < NP; c++)                       \
                            a[gq][c] += qs[gq][d] * kv[c];                                         \
                }                                                                                  \
                _Pragma("GCC unroll 8") for (int gq = 0; gq < ATT_Q; gq++)                         \
                    _Pragma("GCC unroll 4") for (int c = 0; c < NP; c++)                           \
                        storev(&s[gq][t0 + c * VW], a[gq][c]);                                     \
            }                                                                                      \
            /* Positions before the window (in its first piece) are not counted. */               \
            const int32_t t_lo = lo > c0 ? lo - c0 : 0;                                            \
            for (int gq = 0; gq < nq && t_lo < n; gq++) {                                          \
                float top = mx[gq];                                                                \
                for (int32_t t = t_lo; t < n; t++) top = s[gq][t] > top ? s[gq][t] : top;          \
                const float alpha = expf(mx[gq] - top);                                            \
                float total = 0.0f;                                                                \
                for (int32_t t = t_lo; t < n; t++) {                                               \
                    s[gq][t] = expf(s[gq][t] - top);                                               \
                    total += s[gq][t];                                                             \
                }                                                                                  \
                mx[gq] = top;                                                                      \
                sum[gq] = sum[gq] * alpha + total;                                                 \
                vf av[V];                                                                          \
                _Pragma("GCC unroll 16") for (int j = 0; j < V; j++) av[j] = acc[gq][j] * alpha;   \
                for (int32_t t = t_lo; t < n; t++) {                                               \
                    const float *vrow = vb[t / 16] + (t % 16) * D;                                 \
                    _Pragma("GCC unroll 16") for (int j = 0; j < V; j++)                           \
                        av[j] += s[gq][t] * loadv(vrow + j * VW);                                  \
                }                                                                                  \
                _Pragma("GCC unroll 16") for (int j = 0; j < V; j++) acc[gq][j] = av[j];           \
            }                                                                                      \
        }                                                                                          \
        for (int gq = 0; gq < nq; gq++) {                                                          \
            float *dst = part + (int64_t)(g0 + gq) * (D + 2);                                      \
            dst[0] = mx[gq];                                                                       \
            dst[1] = sum[gq];                                                                      \
            for (int j = 0; j < V; j++) storev(dst + 2 + j * VW, acc[gq][j]);                      \
        }                                                                                          \
    }                                                                                              \
}

DEFINE_ATTEND(64)
DEFINE_ATTEND(128)

/* The parts of one (row, KV head) [splits][group][D + 2] merged into out [group, D]: each part
 * weighed by exp(its max - the overall max). */
static void merge_parts(const float *parts, int32_t splits, int32_t group, int64_t D, float *out)
{
    for (int32_t gq = 0; gq < group; gq++) {
        float top = MASKED;
        for (int32_t sp = 0; sp < splits; sp++) {
            const float mx = parts[((int64_t)sp * group + gq) * (D + 2)];
            top = mx > top ? mx : top;
        }
        float total = 0.0f, w[MAX_SPLITS];
        for (int32_t sp = 0; sp < splits; sp++) {
            const float *pt = parts + ((int64_t)sp * group + gq) * (D + 2);
            w[sp] = splits == 1 ? 1.0f : expf(pt[0] - top);
            total += w[sp] * pt[1];
        }
        const float inv = 1.0f / total;
        float *o = out + gq * D;
        for (int32_t sp = 0; sp < splits; sp++) {
            const float *acc = parts + ((int64_t)sp * group + gq) * (D + 2) + 2, ws = w[sp] * inv;
            if (sp == 0)
                for (int64_t d = 0; d < D; d++) o[d] = ws * acc[d];
            else
                for (int64_t d = 0; d < D; d++) o[d] += ws * acc[d];
        }
    }
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

/* Row r's new key (rotated) and value of KV head kvh into layer ly's cache. */
static void write_kv_head(const dmodel_t *m, const dlayer_t *ly, const float *qkv,
                          const float *cos, const float *sin, const int64_t *slots, int64_t r,
                          int64_t kvh)
{
    const int64_t D = m->head_dim, KV = m->kv_heads;
    const int64_t q_size = m->heads * D, kv_size = KV * D, qkv_size = q_size + 2 * kv_size;
    const int32_t bs = (int32_t)m->block_size;
    const float *row = qkv + r * qkv_size;
    if (slots[r] < 0) return;
    float k[128];
    memcpy(k, row + q_size + kvh * D, sizeof(float) * D);
    rotate_head(k, cos + r * D, sin + r * D, (int32_t)D);
    const float *v = row + q_size + kv_size + kvh * D;
    const int64_t block = slots[r] / bs, off = slots[r] % bs;
    const int64_t base = (block * KV + kvh) * D * bs;
    for (int64_t d = 0; d < D; d++) {
        ly->k_cache[base + d * bs + off] = k[d];
        ly->v_cache[base + off * D + d] = v[d];
    }
}

/* One attention item (row, KV head, part of the context) of layer ly: the part's queries
 * rotated, attended over the part's positions into parts. With one row the last part writes
 * the new token's key and value before reading them (write); with several, every row's are
 * written before any is read (rows of one sequence, a speculative step's positions, attend to
 * each other's). */
static void attend_item(const dmodel_t *m, const dlayer_t *ly, const float *qkv, float *parts,
                        const float *cos, const float *sin, const int64_t *slots,
                        const int32_t *block_tables, int64_t bt_stride, const int32_t *seq_lens,
                        int32_t splits, int64_t item, int write)
{
    const int64_t D = m->head_dim, KV = m->kv_heads;
    const int64_t q_size = m->heads * D, kv_size = KV * D, qkv_size = q_size + 2 * kv_size;
    const int32_t group = (int32_t)(m->heads / KV), bs = (int32_t)m->block_size;
    const int64_t part_floats = group * (D + 2);
    const int64_t r = item / (KV * splits), kvh = item / splits % KV, part = item % splits;
    const float *row = qkv + r * qkv_size;
    const int32_t len = seq_lens[r];
    if (write && part == splits - 1) write_kv_head(m, ly, qkv, cos, sin, slots, r, kvh);
    float q[MAX_GROUP * 128];
    for (int32_t gq = 0; gq < group; gq++) {
        memcpy(q + gq * D, row + (kvh * group + gq) * D, sizeof(float) * D);
        rotate_head(q + gq * D, cos + r * D, sin + r * D, (int32_t)D);
    }
    /* The parts split the window (from its first position's 16-position piece), not the whole
     * context: nothing before the window is read. */
    const int32_t lo = ly->window > 0 && len > ly->window ? len - (int32_t)ly->window : 0;
    const int32_t from = lo & ~15;
    const int32_t p0 = from + split_point(len - from, part, splits);
    const int32_t p1 = from + split_point(len - from, part + 1, splits);
    (D == 64 ? attend_range_64 : attend_range_128)(
        q, group, ly->k_cache, ly->v_cache, block_tables + r * bt_stride, KV, kvh, bs,
        (float)m->scale, p0, p1, lo, parts + item * part_floats);
}

/* One decode step. x: [M, hidden] the rows' embeddings; out: [M, hidden] the final norm's output;
 * cos, sin: [M, head_dim] rotary tables (sin's first half negated); slots: [M] KV cache slots
 * (negative: not written); block_tables: [M, bt_stride]; seq_lens: [M] context lengths with the
 * new token; work: decode_stack_work_floats(m, M, num_threads) floats. Returns 0; -1 for M
 * outside [1, MAX_ROWS], a gate/up size that is not a multiple of 32, a head_dim other than 64
 * or 128, more than MAX_GROUP query heads per KV head or more than MAX_THREADS threads.
 *
 * Each thread keeps its own copy of the residual stream, of the normed rows and of the
 * attention output, and computes the norms, the groups' sums and the merge of the attention
 * parts itself (a few microseconds of redundant work): the threads meet only where one needs
 * what the other wrote, five barriers a layer (after qkv, attention, o, gate/up and down; with
 * several rows a sixth, after their keys and values are written: rows may share a sequence). */
int32_t decode_stack_f32(const dmodel_t *m, const float *x, float *out, int64_t M, const float *cos,
                         const float *sin, const int64_t *slots, const int32_t *block_tables,
                         int64_t bt_stride, const int32_t *seq_lens, float *work,
                         int32_t num_threads)
{
    if (M < 1 || M > MAX_ROWS || m->intermediate % 32 || (m->head_dim != 64 && m->head_dim != 128)
        || num_threads < 1 || num_threads > MAX_THREADS || m->heads % m->kv_heads
        || m->heads / m->kv_heads > MAX_GROUP)
        return -1;
    const int64_t H = m->hidden, D = m->head_dim, I = m->intermediate, KV = m->kv_heads;
    const int64_t q_size = m->heads * D, kv_size = KV * D, qkv_size = q_size + 2 * kv_size;
    const int32_t group = (int32_t)(m->heads / KV);
    const float eps = (float)m->eps;
    int32_t max_len = 0;
    for (int64_t r = 0; r < M; r++) max_len = seq_lens[r] > max_len ? seq_lens[r] : max_len;
    const int32_t splits = attention_splits(M * KV, num_threads, max_len);
    const int64_t items = M * KV * splits, part_floats = group * (D + 2);
    /* Shared: the qkv rows, the attention parts, the SwiGLU output, the projections' output. */
    float *qkv = work, *parts = qkv + M * qkv_size, *h = parts + items * part_floats;
    float *layer_out = out;
    float *own_base = h + M * I;
    const int64_t own = thread_floats(m, M);

    #pragma omp parallel num_threads(num_threads)
    {
        const unsigned csr = ftz_enter();
        const int t = omp_get_thread_num(), nt = omp_get_num_threads();
        float *residual = own_base + t * own, *xn = residual + M * H, *attn = xn + M * H;
        float *xsum = attn + M * q_size, *g = xsum + M * max3(H, q_size, I), *u = g + MAX_ROWS * 32;
        memcpy(residual, x, sizeof(float) * M * H);
        int64_t lo, hi;
        MARK_START;
        for (int64_t l = 0; l < m->num_layers; l++) {
            const dlayer_t *ly = &m->layers[l];
            for (int64_t r = 0; r < M; r++)
                add_rms_norm_row(l ? layer_out + r * H : 0, residual + r * H, xn + r * H,
                                 ly->input_norm, H, eps);
            row_sums(&ly->qkv, xn, H, M, xsum);
            MARK(0);
            span(blocks(&ly->qkv), t, nt, &lo, &hi);
            for (int64_t nb = lo; nb < hi; nb++)
                project_block(&ly->qkv, xn, H, xsum, qkv + nb * 32, qkv_size, M, nb);
            MARK(1);
            #pragma omp barrier
            MARK(2);
            /* Items (row, KV head, part of the context): one row's equal parts in contiguous
             * shares (a thread attends the parts of neighbouring heads); several rows' items,
             * whose lengths differ from row to row, one at a time. */
            if (M == 1) {
                span(items, t, nt, &lo, &hi);
                for (int64_t item = lo; item < hi; item++)
                    attend_item(m, ly, qkv, parts, cos, sin, slots, block_tables, bt_stride,
                                seq_lens, splits, item, 1);
            } else {
                span(M * KV, t, nt, &lo, &hi);
                for (int64_t w = lo; w < hi; w++)
                    write_kv_head(m, ly, qkv, cos, sin, slots, w / KV, w % KV);
                #pragma omp barrier
                #pragma omp for schedule(dynamic, 1) nowait
                for (int64_t item = 0; item < items; item++)
                    attend_item(m, ly, qkv, parts, cos, sin, slots, block_tables, bt_stride,
                                seq_lens, splits, item, 0);
            }
            MARK(3);
            #pragma omp barrier
            MARK(4);
            for (int64_t r = 0; r < M; r++)
                for (int64_t kvh = 0; kvh < KV; kvh++)
                    merge_parts(parts + (r * KV + kvh) * splits * part_floats, splits, group, D,
                                attn + r * q_size + kvh * group * D);
            row_sums(&ly->o, attn, q_size, M, xsum);
            MARK(5);
            span(blocks(&ly->o), t, nt, &lo, &hi);
            for (int64_t nb = lo; nb < hi; nb++)
                project_block(&ly->o, attn, q_size, xsum, layer_out + nb * 32, H, M, nb);
            MARK(6);
            #pragma omp barrier
            MARK(7);
            for (int64_t r = 0; r < M; r++)
                add_rms_norm_row(layer_out + r * H, residual + r * H, xn + r * H, ly->post_norm, H,
                                 eps);
            row_sums(&ly->gate_up, xn, H, M, xsum);
            MARK(8);
            span(I / 32, t, nt, &lo, &hi);
            for (int64_t j = lo; j < hi; j++) {
                gate_up_blocks(&ly->gate_up, xn, H, xsum, g, u, M, j, I);
                for (int64_t r = 0; r < M; r++) silu_mul_row(g + r * 32, u + r * 32, h + r * I + j * 32, 32);
            }
            MARK(9);
            #pragma omp barrier
            MARK(10);
            row_sums(&ly->down, h, I, M, xsum);
            MARK(11);
            /* layer_out is free: every thread took it into its residual before gate/up. */
            span(blocks(&ly->down), t, nt, &lo, &hi);
            for (int64_t nb = lo; nb < hi; nb++)
                project_block(&ly->down, h, I, xsum, layer_out + nb * 32, H, M, nb);
            MARK(12);
            #pragma omp barrier
            MARK(13);
        }
        if (t == 0)
            for (int64_t r = 0; r < M; r++)
                add_rms_norm_row(out + r * H, residual + r * H, out + r * H, m->final_norm, H, eps);
        ftz_leave(csr);
    }
    return 0;
}
