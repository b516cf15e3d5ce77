/* Paged attention for fp32 CPU tensors, reading K/V where they lie in the block cache.
 *
 * One work item is (request, KV head, tile of query tokens): the tile's query vectors (its
 * tokens x the query heads sharing that KV head) walk the request's context once, 16 positions
 * at a time, with an online softmax (running max and sum per vector), so nothing is gathered
 * and nothing of size seq_len is materialised. Scores come from one of two loops: with few
 * vectors (decode) each K row is dotted with each query; with many (prefill tiles) the 16 K rows
 * are transposed once and each vector's 16 scores are one vector FMA per dimension. head_dim is
 * a compile-time constant (64 or 128) so accumulators stay in registers; GCC vector extensions
 * keep the code portable across x86 widths.
 * Queries are causal: query j of a request with q_len queries and seq_len tokens sits at position
 * seq_len - q_len + j and sees positions 0..itself.
 */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <math.h>

#define CHUNK 16          /* context positions per step of the online softmax */
#define TILE_VECTORS 32   /* query vectors per work item in prefill tiles */
#define FEW_VECTORS 6     /* at most this many: dot-product loop (decode); more: transposed loop */
#define MASKED (-1e30f)   /* finite: the library is built with -ffast-math */

typedef float v16 __attribute__((vector_size(64), aligned(4)));

static inline v16 load16(const float *p) { v16 v; memcpy(&v, p, sizeof v); return v; }
static inline void store16(float *p, v16 v) { memcpy(p, &v, sizeof v); }
static inline float hsum16(v16 v)
{
    float s = 0.0f;
    for (int i = 0; i < 16; i++) s += v[i];
    return s;
}

typedef struct {
    int32_t req;
    int32_t first_query; /* index of the tile's first query token within its request */
} tile_t;

typedef struct {
    const float *q; int64_t q_stride;
    float *out; int64_t out_stride;
    const float *k_cache, *v_cache;
    int32_t group, num_kv_heads, block_size;
    float scale;
} params_t;

#define DEFINE_TILE(D)                                                                             \
static void attend_tile_##D(const params_t *p, const int32_t *block_table, int32_t q_start,       \
                            int32_t q_len, int32_t seq_len, int32_t first, int32_t ntok,           \
                            int32_t kv_head, float *scratch)                                       \
{                                                                                                  \
    enum { V = D / 16 };                                                                           \
    const int32_t group = p->group, nvec = ntok * group;                                           \
    const int64_t row = (int64_t)p->num_kv_heads * D; /* cache stride between positions */        \
    float *restrict qs = scratch;                 /* [nvec, D] scaled queries */                   \
    float *restrict acc = qs + nvec * D;          /* [nvec, D] */                                  \
    float *restrict kt = acc + nvec * D;          /* [D, CHUNK] transposed keys */                 \
    float *restrict s = kt + D * CHUNK;           /* [nvec, CHUNK] scores, then probabilities */  \
    float *restrict m = s + nvec * CHUNK;         /* [nvec] running max */                         \
    float *restrict l = m + nvec;                 /* [nvec] running sum */                         \
    int32_t *restrict pos = (int32_t *)(l + nvec);/* [nvec] position of each vector */             \
    const float *krow[CHUNK], *vrow[CHUNK];                                                        \
    for (int32_t t = 0; t < ntok; t++) {                                                           \
        const float *src = p->q + (int64_t)(q_start + first + t) * p->q_stride                     \
                           + (int64_t)kv_head * group * D;                                         \
        for (int32_t g = 0; g < group; g++) {                                                      \
            const int32_t vi = t * group + g;                                                      \
            for (int32_t d = 0; d < D; d++) qs[vi * D + d] = src[g * D + d] * p->scale;           \
            pos[vi] = seq_len - q_len + first + t;                                                 \
            m[vi] = MASKED;                                                                        \
            l[vi] = 0.0f;                                                                          \
        }                                                                                          \
    }                                                                                              \
    memset(acc, 0, sizeof(float) * nvec * D);                                                      \
    const int32_t last = pos[nvec - 1];                                                            \
    for (int32_t start = 0; start <= last; start += CHUNK) {                                       \
        const int32_t n = (last + 1 - start) < CHUNK ? (last + 1 - start) : CHUNK;                 \
        for (int32_t t = 0; t < n; t++) {                                                          \
            const int32_t at = start + t, bs = p->block_size;                                      \
            const int64_t off = ((int64_t)block_table[at / bs] * bs + at % bs) * row               \
                                + (int64_t)kv_head * D;                                            \
            krow[t] = p->k_cache + off;                                                            \
            vrow[t] = p->v_cache + off;                                                            \
        }                                                                                          \
        if (nvec <= FEW_VECTORS) {                                                                 \
            for (int32_t vi = 0; vi < nvec; vi++) {                                                \
                v16 qv[V];                                                                         \
                for (int j = 0; j < V; j++) qv[j] = load16(qs + vi * D + 16 * j);                  \
                for (int32_t t = 0; t < n; t++) {                                                  \
                    v16 prod = qv[0] * load16(krow[t]);                                            \
                    for (int j = 1; j < V; j++) prod += qv[j] * load16(krow[t] + 16 * j);          \
                    s[vi * CHUNK + t] = hsum16(prod);                                              \
                }                                                                                  \
            }                                                                                      \
        } else {                                                                                   \
            for (int32_t t = 0; t < CHUNK; t++)                                                    \
                for (int32_t d = 0; d < D; d++) kt[d * CHUNK + t] = t < n ? krow[t][d] : 0.0f;     \
            for (int32_t vi = 0; vi < nvec; vi++) {                                                \
                const float *qv = qs + vi * D;                                                     \
                v16 a0 = {0}, a1 = {0};                                                            \
                for (int32_t d = 0; d < D; d += 2) {                                               \
                    a0 += qv[d] * load16(kt + d * CHUNK);                                          \
                    a1 += qv[d + 1] * load16(kt + (d + 1) * CHUNK);                                \
                }                                                                                  \
                store16(s + vi * CHUNK, a0 + a1);                                                  \
            }                                                                                      \
        }                                                                                          \
        for (int32_t vi = 0; vi < nvec; vi++) {                                                    \
            const int32_t visible = pos[vi] - start + 1;                                           \
            if (visible <= 0) continue;                                                            \
            const int32_t nv = visible < n ? visible : n;                                          \
            float *sv = s + vi * CHUNK;                                                            \
            float mx = m[vi];                                                                      \
            for (int32_t t = 0; t < nv; t++) mx = sv[t] > mx ? sv[t] : mx;                         \
            const float alpha = expf(m[vi] - mx);                                                  \
            float sum = 0.0f;                                                                      \
            for (int32_t t = 0; t < nv; t++) {                                                     \
                sv[t] = expf(sv[t] - mx);                                                          \
                sum += sv[t];                                                                      \
            }                                                                                      \
            m[vi] = mx;                                                                            \
            l[vi] = l[vi] * alpha + sum;                                                           \
            v16 av[V];                                                                             \
            for (int j = 0; j < V; j++) av[j] = load16(acc + vi * D + 16 * j) * alpha;             \
            for (int32_t t = 0; t < nv; t++)                                                       \
                for (int j = 0; j < V; j++) av[j] += sv[t] * load16(vrow[t] + 16 * j);             \
            for (int j = 0; j < V; j++) store16(acc + vi * D + 16 * j, av[j]);                     \
        }                                                                                          \
    }                                                                                              \
    for (int32_t t = 0; t < ntok; t++) {                                                           \
        float *dst = p->out + (int64_t)(q_start + first + t) * p->out_stride                       \
                     + (int64_t)kv_head * group * D;                                               \
        for (int32_t g = 0; g < group; g++) {                                                      \
            const int32_t vi = t * group + g;                                                      \
            const float inv = 1.0f / l[vi];                                                        \
            for (int32_t d = 0; d < D; d++) dst[g * D + d] = acc[vi * D + d] * inv;                \
        }                                                                                          \
    }                                                                                              \
}

DEFINE_TILE(64)
DEFINE_TILE(128)

/* q: [T, Hq, D] rows q_stride apart (heads packed); out: [T, Hq, D] rows out_stride apart;
 * caches: [num_blocks, block_size, Hkv, D]; block_tables: [R, bt_stride]; query_start_loc:
 * [R + 1]; seq_lens: [R]. Returns 0; -1 when scratch memory ran out; -2 for a head_dim other
 * than 64 or 128. */
int paged_attention_f32(const float *q, int64_t q_stride, float *out, int64_t out_stride,
                        const float *k_cache, const float *v_cache, const int32_t *block_tables,
                        int64_t bt_stride, const int32_t *query_start_loc, const int32_t *seq_lens,
                        int32_t num_reqs, int32_t num_q_heads, int32_t num_kv_heads,
                        int32_t head_dim, int32_t block_size, float scale, int32_t num_threads)
{
    if (head_dim != 64 && head_dim != 128) return -2;
    const params_t p = {q, q_stride, out, out_stride, k_cache, v_cache,
                        num_q_heads / num_kv_heads, num_kv_heads, block_size, scale};
    const int32_t tile_tokens = p.group >= TILE_VECTORS ? 1 : TILE_VECTORS / p.group;
    int64_t num_tiles = 0;
    for (int32_t r = 0; r < num_reqs; r++) {
        const int32_t q_len = query_start_loc[r + 1] - query_start_loc[r];
        num_tiles += (q_len + tile_tokens - 1) / tile_tokens;
    }
    tile_t *tiles = malloc(sizeof(tile_t) * (num_tiles ? num_tiles : 1));
    if (!tiles) return -1;
    int64_t k = 0;
    for (int32_t r = 0; r < num_reqs; r++) {
        const int32_t q_len = query_start_loc[r + 1] - query_start_loc[r];
        for (int32_t f = 0; f < q_len; f += tile_tokens) tiles[k++] = (tile_t){r, f};
    }
    const int32_t max_vec = tile_tokens * p.group;
    const size_t scratch_floats = (size_t)max_vec * (2 * head_dim + CHUNK + 3)
                                  + (size_t)head_dim * CHUNK;
    const int64_t num_items = num_tiles * num_kv_heads;
    int failed = 0;
    #pragma omp parallel num_threads(num_threads)
    {
        float *scratch = malloc(sizeof(float) * scratch_floats);
        if (!scratch) {
            #pragma omp atomic write
            failed = 1;
        }
        #pragma omp for schedule(dynamic, 1)
        for (int64_t item = 0; item < num_items; item++) {
            if (!scratch) continue;
            const tile_t tile = tiles[item / num_kv_heads];
            const int32_t h = (int32_t)(item % num_kv_heads);
            const int32_t q_start = query_start_loc[tile.req];
            const int32_t q_len = query_start_loc[tile.req + 1] - q_start;
            const int32_t ntok = (q_len - tile.first_query) < tile_tokens
                                     ? (q_len - tile.first_query) : tile_tokens;
            const int32_t *bt = block_tables + (int64_t)tile.req * bt_stride;
            if (head_dim == 64)
                attend_tile_64(&p, bt, q_start, q_len, seq_lens[tile.req], tile.first_query, ntok,
                               h, scratch);
            else
                attend_tile_128(&p, bt, q_start, q_len, seq_lens[tile.req], tile.first_query, ntok,
                                h, scratch);
        }
        free(scratch);
    }
    free(tiles);
    return failed ? -1 : 0;
}
