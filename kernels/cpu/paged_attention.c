/* Paged attention for fp32 CPU tensors, reading K/V where they lie in the block cache.
 *
 * Cache layout (the CPU backend's): per block and KV head, keys transposed as [D, block_size] and
 * values as [block_size, D]; block_size a multiple of 16. Then the scores of one query vector
 * against 16 consecutive positions are D vector FMAs (no transposes, no horizontal sums), and
 * each value row is one contiguous read.
 *
 * One work item is (request, KV head, tile of query tokens): the tile's query vectors (its
 * tokens x the query heads sharing that KV head) walk the request's context once, 16 positions
 * at a time, with an online softmax (running max and sum per vector), so nothing is gathered
 * and nothing of size seq_len is materialised. Vectors go through the score loop four at a time
 * so each key load feeds four FMAs. head_dim is a compile-time constant (64 or 128) so the
 * accumulators stay in registers; vec.h's vectors keep the code portable across x86 widths.
 * Queries are causal: query j of a request with q_len queries and seq_len tokens sits at position
 * seq_len - q_len + j and sees positions 0..itself, or with a sliding window W only positions
 * itself - W + 1..itself: the walk then starts at the tile's first query's window (rounded down
 * to a vector), so blocks before it are never read. Sinks (a logit per query head, gpt-oss) join
 * each softmax's denominator as its initial running max and sum, and attend to nothing. A soft
 * cap c (Gemma 2) turns each visible scaled score s into c * tanh(s / c) before its softmax step.
 *
 * An fp8 cache (--kv-cache-dtype fp8: bytes in float8_e4m3fn, the same layout) is converted
 * chunk by chunk into per-thread float buffers (two: the next chunk's is filled while this one
 * computes), which the walk then reads as it reads an fp32 cache. Its scales fold into the
 * arithmetic: k_scale into the query's scale, v_scale into the output's normalisation.
 */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <math.h>

#include "fp8.h"
#include "vec.h"

#define NC 4              /* vectors of positions per step of the online softmax */
#define CHUNK (NC * VW)   /* positions per step: 64 with AVX-512, 32 with 256-bit vectors */
#define LANES 4           /* query vectors sharing each key load */
#define TILE_VECTORS 32   /* query vectors per work item, at most (a multiple of LANES) */
#define MASKED (-1e30f)   /* finite: the library is built with -ffast-math */

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
    int32_t window;     /* > 0: a query at p sees keys p - window + 1..p; 0: every key before it */
    const float *sinks; /* [Hq] natural-log sink per query head, or NULL */
    float soft_cap;     /* > 0: scores become soft_cap * tanh(score / soft_cap); 0: none */
    const uint8_t *k8, *v8; /* an fp8 cache (then k_cache / v_cache are unused), or NULL */
    float out_scale;        /* the output's factor: an fp8 cache's v_scale, else 1 */
} params_t;

/* Gemma 2's attention logits soft-capping on the scores sv[t0..nv). */
static inline void soft_cap_scores(float *restrict sv, int32_t t0, int32_t nv, float cap)
{
    const float inv = 1.0f / cap;
    for (int32_t t = t0; t < nv; t++) sv[t] = cap * tanhf(sv[t] * inv);
}

/* K and V base pointers of the NC position vectors of the chunk starting at `start` (a multiple
 * of VW, so vectors never straddle blocks: block_size is a multiple of 16); vectors past `last`
 * repeat the chunk's first vector's block, or the walk's first (`first`) past the end, so nothing
 * outside the blocks the walk covers is ever read. An fp8 cache's vectors are converted into buf
 * (keys [NC][D][VW], then values [NC][VW][D]: key rows VW apart instead of block_size), unless
 * the chunk lies past the end (its pointers are never read). */
static inline void chunk_pointers(const params_t *p, const int32_t *block_table, int32_t kv_head,
                                  int32_t start, int32_t first, int32_t last, int32_t head_dim,
                                  float *buf, const float **kp, const float **vp)
{
    const int32_t bs = p->block_size;
    const int64_t head_elems = (int64_t)head_dim * bs;
    for (int c = 0; c < NC; c++) {
        int32_t at = start + c * VW;
        if (at > last) at = start <= last ? start : first;
        const int64_t block = (int64_t)block_table[at / bs] * p->num_kv_heads + kv_head;
        const int64_t k_off = block * head_elems + at % bs;
        const int64_t v_off = block * head_elems + (int64_t)(at % bs) * head_dim;
        if (!p->k8) {
            kp[c] = p->k_cache + k_off;
            vp[c] = p->v_cache + v_off;
            continue;
        }
        float *kb = buf + (int64_t)c * VW * head_dim, *vb = kb + (int64_t)CHUNK * head_dim;
        if (start <= last) {
            for (int32_t d = 0; d < head_dim; d++)
                storev(kb + (int64_t)d * VW, load_e4m3(p->k8 + k_off + (int64_t)d * bs));
            for (int32_t i = 0; i < VW * head_dim; i += VW)
                storev(vb + i, load_e4m3(p->v8 + v_off + i));
        }
        kp[c] = kb;
        vp[c] = vb;
    }
}

/* One query vector's online-softmax step over the chunk's positions [t0, nv): scores sv (turned
 * into probabilities), the running max *m and sum *l, the output acc [D] rescaled and added to;
 * vp: the chunk's value vectors. Inlined twice per tile: with t0 = 0 (no window), and not. */
#define DEFINE_SOFTMAX_STEP(D)                                                                     \
static inline __attribute__((always_inline)) void softmax_step_##D(                               \
    float *restrict sv, int32_t t0, int32_t nv, const float *const *vp, float *restrict m,       \
    float *restrict l, float *restrict acc)                                                        \
{                                                                                                  \
    enum { V = D / VW };                                                                           \
    float mx = *m;                                                                                 \
    for (int32_t t = t0; t < nv; t++) mx = sv[t] > mx ? sv[t] : mx;                                \
    const float alpha = expf(*m - mx);                                                             \
    float sum = 0.0f;                                                                              \
    for (int32_t t = t0; t < nv; t++) {                                                            \
        sv[t] = expf(sv[t] - mx);                                                                  \
        sum += sv[t];                                                                              \
    }                                                                                              \
    *m = mx;                                                                                       \
    *l = *l * alpha + sum;                                                                         \
    vf av[V];                                                                                      \
    _Pragma("GCC unroll 16") for (int j = 0; j < V; j++) av[j] = loadv(acc + VW * j) * alpha;      \
    for (int32_t t = t0; t < nv; t++) {                                                            \
        const float *vrow = vp[t / VW] + (int64_t)(t % VW) * D;                                    \
        _Pragma("GCC unroll 16") for (int j = 0; j < V; j++) av[j] += sv[t] * loadv(vrow + VW * j);\
    }                                                                                              \
    _Pragma("GCC unroll 16") for (int j = 0; j < V; j++) storev(acc + VW * j, av[j]);              \
}

DEFINE_SOFTMAX_STEP(64)
DEFINE_SOFTMAX_STEP(128)

#define DEFINE_TILE(D)                                                                             \
static void attend_tile_##D(const params_t *p, const int32_t *block_table, int32_t q_start,       \
                            int32_t q_len, int32_t seq_len, int32_t first, int32_t ntok,           \
                            int32_t kv_head, float *scratch)                                       \
{                                                                                                  \
    enum { V = D / VW };                                                                           \
    const int32_t group = p->group, nvec = ntok * group;                                           \
    const int32_t padded = (nvec + LANES - 1) / LANES * LANES;                                     \
    const int32_t bs = p->block_size;                                                              \
    float *restrict qs = scratch;                 /* [padded, D] scaled queries, zero padded */    \
    float *restrict acc = qs + padded * D;        /* [nvec, D] */                                  \
    float *restrict s = acc + padded * D;         /* [padded, CHUNK] scores, then probabilities */ \
    float *restrict m = s + padded * CHUNK;       /* [nvec] running max */                         \
    float *restrict l = m + padded;               /* [nvec] running sum */                         \
    int32_t *restrict pos = (int32_t *)(l + padded); /* [nvec] position of each vector */          \
    /* An fp8 cache's converted chunks: this one's and the next one's (2 * CHUNK * D each). */    \
    float *dq = (float *)(pos + padded), *dq_next = dq + 2 * CHUNK * D;                            \
    const int64_t ks = p->k8 ? VW : bs; /* apart: key rows of a position vector */               \
    memset(qs, 0, sizeof(float) * padded * D);                                                     \
    for (int32_t t = 0; t < ntok; t++) {                                                           \
        const float *src = p->q + (int64_t)(q_start + first + t) * p->q_stride                     \
                           + (int64_t)kv_head * group * D;                                         \
        for (int32_t g = 0; g < group; g++) {                                                      \
            const int32_t vi = t * group + g;                                                      \
            for (int32_t d = 0; d < D; d++) qs[vi * D + d] = src[g * D + d] * p->scale;           \
            pos[vi] = seq_len - q_len + first + t;                                                 \
            /* A sink is the softmax's first logit, with a zero value vector. */                   \
            m[vi] = p->sinks ? p->sinks[kv_head * group + g] : MASKED;                             \
            l[vi] = p->sinks ? 1.0f : 0.0f;                                                        \
        }                                                                                          \
    }                                                                                              \
    memset(acc, 0, sizeof(float) * nvec * D);                                                      \
    const int32_t last = pos[nvec - 1], win = p->window;                                           \
    /* The tile's first query has the oldest window; start at its vector. */                      \
    const int32_t oldest = win > 0 && pos[0] - win + 1 > 0 ? pos[0] - win + 1 : 0;                 \
    const int32_t walk = oldest / VW * VW;                                                         \
    const float *kp[NC], *vp[NC], *kp_next[NC], *vp_next[NC];                                      \
    chunk_pointers(p, block_table, kv_head, walk, walk, last, D, dq, kp, vp);                      \
    for (int32_t start = walk; start <= last; start += CHUNK) {                                    \
        const int32_t n = (last + 1 - start) < CHUNK ? (last + 1 - start) : CHUNK;                 \
        /* The next chunk lies in other blocks: fetch it while this one computes (the hardware  \
         * prefetcher stops at block boundaries, and one core keeps few misses in flight). */   \
        chunk_pointers(p, block_table, kv_head, start + CHUNK, walk, last, D, dq_next, kp_next,  \
                       vp_next);                                                                   \
        for (int32_t v0 = 0; v0 < padded; v0 += LANES) {                                           \
            vf a[LANES][NC];                                                                       \
            _Pragma("GCC unroll 8") for (int j = 0; j < LANES; j++)                                \
                _Pragma("GCC unroll 8") for (int c = 0; c < NC; c++) a[j][c] = (vf){0};            \
            for (int32_t d = 0; d < D; d++) {                                                      \
                if (v0 == 0 && start + CHUNK <= last) {                                            \
                    _Pragma("GCC unroll 8") for (int c = 0; c < NC; c++) {                         \
                        __builtin_prefetch(kp_next[c] + (int64_t)d * ks);                          \
                        if (d * 16 < VW * D) /* a line per d covers the vector's V rows */         \
                            __builtin_prefetch(vp_next[c] + (int64_t)d * 16);                      \
                    }                                                                              \
                }                                                                                  \
                vf kv[NC];                                                                         \
                _Pragma("GCC unroll 8") for (int c = 0; c < NC; c++)                               \
                    kv[c] = loadv(kp[c] + (int64_t)d * ks);                                        \
                _Pragma("GCC unroll 8") for (int j = 0; j < LANES; j++) {                          \
                    const float qd = qs[(v0 + j) * D + d];                                         \
                    _Pragma("GCC unroll 8") for (int c = 0; c < NC; c++) a[j][c] += qd * kv[c];    \
                }                                                                                  \
            }                                                                                      \
            _Pragma("GCC unroll 8") for (int j = 0; j < LANES; j++)                                \
                _Pragma("GCC unroll 8") for (int c = 0; c < NC; c++)                               \
                    storev(s + (v0 + j) * CHUNK + c * VW, a[j][c]);                                \
        }                                                                                          \
        for (int32_t vi = 0; vi < nvec; vi++) {                                                    \
            const int32_t visible = pos[vi] - start + 1;                                           \
            if (visible <= 0) continue;                                                            \
            const int32_t nv = visible < n ? visible : n;                                          \
            float *sv = s + vi * CHUNK, *av = acc + vi * D;                                        \
            if (win == 0) { /* a constant 0 start: this copy compiles as without windows */      \
                if (p->soft_cap > 0.0f) soft_cap_scores(sv, 0, nv, p->soft_cap);                   \
                softmax_step_##D(sv, 0, nv, vp, m + vi, l + vi, av);                               \
                continue;                                                                          \
            }                                                                                      \
            /* The window's first position in this chunk. */                                     \
            const int32_t t0 = pos[vi] - win + 1 - start;                                          \
            if (t0 >= nv) continue;                                                                \
            if (p->soft_cap > 0.0f) soft_cap_scores(sv, t0 > 0 ? t0 : 0, nv, p->soft_cap);         \
            softmax_step_##D(sv, t0 > 0 ? t0 : 0, nv, vp, m + vi, l + vi, av);                     \
        }                                                                                          \
        _Pragma("GCC unroll 8") for (int c = 0; c < NC; c++) {                                     \
            kp[c] = kp_next[c];                                                                    \
            vp[c] = vp_next[c];                                                                    \
        }                                                                                          \
        float *const dq_done = dq;                                                                 \
        dq = dq_next;                                                                              \
        dq_next = dq_done;                                                                         \
    }                                                                                              \
    for (int32_t t = 0; t < ntok; t++) {                                                           \
        float *dst = p->out + (int64_t)(q_start + first + t) * p->out_stride                       \
                     + (int64_t)kv_head * group * D;                                               \
        for (int32_t g = 0; g < group; g++) {                                                      \
            const int32_t vi = t * group + g;                                                      \
            const float inv = p->out_scale / l[vi];                                                \
            for (int32_t d = 0; d < D; d++) dst[g * D + d] = acc[vi * D + d] * inv;                \
        }                                                                                          \
    }                                                                                              \
}

DEFINE_TILE(64)
DEFINE_TILE(128)

/* One decode token (the last of a request with seq_len tokens) against one KV head, for callers
 * that split the work across their own threads (decode_stack.c): q and out are the token's
 * [Hq, D] rows; scratch holds paged_attention_scratch_floats(group, head_dim) floats. */
size_t paged_attention_scratch_floats(int32_t group, int32_t head_dim)
{
    const int32_t padded = (group + LANES - 1) / LANES * LANES;
    return (size_t)padded * (2 * head_dim + CHUNK + 3);
}

void paged_attention_decode_head(const float *q, float *out, const float *k_cache,
                                 const float *v_cache, const int32_t *block_table, int32_t seq_len,
                                 int32_t group, int32_t num_kv_heads, int32_t kv_head,
                                 int32_t head_dim, int32_t block_size, float scale, float *scratch)
{
    const params_t p = {q, 0, out, 0, k_cache, v_cache, group, num_kv_heads, block_size, scale,
                        0, NULL, 0.0f, NULL, NULL, 1.0f};
    if (head_dim == 64)
        attend_tile_64(&p, block_table, 0, 1, seq_len, 0, 1, kv_head, scratch);
    else
        attend_tile_128(&p, block_table, 0, 1, seq_len, 0, 1, kv_head, scratch);
}

/* q: [T, Hq, D] rows q_stride apart (heads packed); out: [T, Hq, D] rows out_stride apart;
 * caches in the layout above; block_tables: [R, bt_stride]; query_start_loc: [R + 1];
 * seq_lens: [R]; window: the sliding window (0: none); sinks: [Hq] or NULL; soft_cap: the
 * attention logits soft cap (0: none); kv_fp8: the caches hold float8_e4m3fn bytes, read as
 * value * k_scale / v_scale (otherwise floats; the scales unused). Returns 0; -1 when
 * scratch memory ran out; -2 for a head_dim other than 64 or 128 or a block_size that is not a
 * multiple of 16. */
int paged_attention_f32(const float *q, int64_t q_stride, float *out, int64_t out_stride,
                        const void *k_cache, const void *v_cache, const int32_t *block_tables,
                        int64_t bt_stride, const int32_t *query_start_loc, const int32_t *seq_lens,
                        int32_t num_reqs, int32_t num_q_heads, int32_t num_kv_heads,
                        int32_t head_dim, int32_t block_size, float scale, int32_t window,
                        const float *sinks, float soft_cap, int32_t kv_fp8, float k_scale,
                        float v_scale, int32_t num_threads)
{
    if ((head_dim != 64 && head_dim != 128) || block_size % 16) return -2;
    const params_t p = {q, q_stride, out, out_stride, kv_fp8 ? NULL : k_cache,
                        kv_fp8 ? NULL : v_cache, num_q_heads / num_kv_heads, num_kv_heads,
                        block_size, kv_fp8 ? scale * k_scale : scale, window > 0 ? window : 0,
                        sinks, soft_cap > 0.0f ? soft_cap : 0.0f, kv_fp8 ? k_cache : NULL,
                        kv_fp8 ? v_cache : NULL, kv_fp8 ? v_scale : 1.0f};
    /* An fp8 cache's conversion is paid once per chunk and tile: longer tiles share it. */
    const int32_t tile_vectors = kv_fp8 ? 4 * TILE_VECTORS : TILE_VECTORS;
    const int32_t tile_tokens = p.group >= tile_vectors ? 1 : tile_vectors / p.group;
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
    const int32_t max_vec = (tile_tokens * p.group + LANES - 1) / LANES * LANES;
    const size_t scratch_floats = (size_t)max_vec * (2 * head_dim + CHUNK + 3)
                                  + (kv_fp8 ? (size_t)4 * CHUNK * head_dim : 0);
    const int64_t num_items = num_tiles * num_kv_heads;
    int failed = 0;
    #pragma omp parallel num_threads(num_threads)
    {
        const unsigned csr = ftz_enter();
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
        ftz_leave(csr);
    }
    free(tiles);
    return failed ? -1 : 0;
}
