/* y = x @ W^T (+ bias) for fp32 activations and GGUF-quantized weights (Q4_0, Q4_1, Q5_0, Q5_1,
 * Q8_0, Q4_K, Q5_K, Q6_K), dequantizing inside the kernel: the result is the dequantized fp32
 * model's up to the order of the sums.
 *
 * Layout (written by kernels/quant_pack.py): W's output rows in blocks of 32 columns, as the fp32
 * GEMM's [N/32, K, 32], each block a run of records of SB input rows (k). A record holds its
 * scales for all 32 columns, then its codes k by k: 4-bit codes as 16 bytes a k (byte j: column j
 * in the low nibble, column j + 16 in the high one), 5-bit codes as those 16 bytes and 4 of high
 * bits (bit c: column c), 8-bit codes as 32 bytes. Per type:
 *   Q4_0 (SB 32):  d[32] f16 | codes        w = d * (q - 8)
 *   Q4_1 (SB 32):  d[32] f16 | m[32] f16 | codes            w = d * q + m
 *   Q5_0, Q5_1:    as Q4_0 (q - 16) and Q4_1, with 5-bit codes
 *   Q8_0 (SB 32):  d[32] f16 | int8 codes   w = d * q
 *   Q4_K (SB 256): d[32] f16 | dmin[32] f16 | sc[8][32] | mn[8][32] | codes
 *                  w = (d * sc[g]) * q - dmin * mn[g] for group g = k / 32
 *   Q5_K:          as Q4_K with 5-bit codes
 *   Q6_K (SB 256): d[32] f16 | sc[16][32] int8 | per k: 16 bytes of low nibbles, 8 bytes of high
 *                  bit pairs (byte j, bits 2i: column j + 8i)   w = (d * sc[k / 16]) * (q - 32)
 * The same bytes per weight as the GGUF file (the K-types' 6-bit scales take a byte each: +2-3%).
 *
 * Few rows (decode): the weights stream once; a group's codes are multiplied with x as integers
 * turned float, and the group's scale (and offset and zero point, through the group's sum of x)
 * is applied once per group: y += s * sum(x q) + (o - s z) * sum(x). Many rows (prefill, batched decode): each 32-column
 * block is dequantized into an L2-resident [K, 32] fp32 tile (up to 2048 k at a time) and the
 * fp32 GEMM's register tiles (gemm_tile.h) run every row of x over it in one pass, so each
 * weight is dequantized once per call and the multiply runs at the fp32 GEMM's speed.
 */
#include <math.h>
#include <omp.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "block_argmax.h"
#include "gemm_tile.h"

enum { Q4_0 = 2, Q4_1 = 3, Q5_0 = 6, Q5_1 = 7, Q8_0 = 8, Q4_K = 12, Q5_K = 13, Q6_K = 14 }; /* GGML's */

/* Rows up to which the scaled-group path (weights streamed once per row tile) beats
 * dequantizing into the fp32 tile. */
#if VW == 16
#define FEW_ROWS 4
#else
#define FEW_ROWS 2
#endif

#define KC_MAX 2048 /* rows of k per dequantized tile: at most 256 KiB, within L2 */
#define KC 256     /* rows of k per step of quant_dequantize_f32 */
#define PREFETCH 4096 /* bytes ahead of the weight stream the few-rows path prefetches */

/* The 32 columns' 4-bit codes of one k, as ints: q[j] covers columns j*VW .. j*VW + VW-1. */
static inline __attribute__((always_inline)) void nibbles(const uint8_t *p, vi q[NV])
{
    _Pragma("GCC unroll 4") for (int h = 0; h < NV / 2; h++) {
        const vi w = widen_u8(p + h * VW);
        q[h] = w & 15;
        q[h + NV / 2] = w >> 4;
    }
}

/* The few-rows path's view of one k's 4-bit codes: the low nibbles (columns 0-15), then the
 * whole bytes (16 * high + low: columns 16-31 after few_T's fix-up), as floats. One op a vector
 * fewer than nibble_floats (no shift): the kernel's inner loop is bound by its vector ops. */
static inline __attribute__((always_inline)) void nibble_bytes(const uint8_t *p, int zero, vf q[NV])
{
    (void)zero;
    _Pragma("GCC unroll 4") for (int h = 0; h < NV / 2; h++) {
        const vi w = widen_u8(p + h * VW);
        q[h] = to_float(w & 15);
        q[h + NV / 2] = to_float(w);
    }
}

/* The 32 columns' 4-bit codes of one k minus `zero`, as floats. */
static inline __attribute__((always_inline)) void nibble_floats(const uint8_t *p, int zero, vf q[NV])
{
    vi n[NV];
    nibbles(p, n);
    _Pragma("GCC unroll 4") for (int j = 0; j < NV; j++) q[j] = to_float(n[j] - zero);
}

/* The 32 columns' 5-bit codes of one k (16 bytes of nibbles, then 4 of high bits) minus `zero`. */
static inline __attribute__((always_inline)) void five_bit_floats(const uint8_t *p, int zero, vf q[NV])
{
#if VW == 16
    const vi lane = {0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15};
#else
    const vi lane = {0, 1, 2, 3, 4, 5, 6, 7};
#endif
    int32_t bits;
    memcpy(&bits, p + 16, 4);
    const vi high = (vi){0} + bits;
    vi n[NV];
    nibbles(p, n);
    _Pragma("GCC unroll 4") for (int j = 0; j < NV; j++)
        q[j] = to_float((n[j] | (((high >> (lane + j * VW)) & 1) << 4)) - zero);
}

/* Q6_K's high bit pairs of the 32 columns (byte j, bits 2i: column j + 8i), shifted into place. */
static inline __attribute__((always_inline)) void high_pairs(const uint8_t *p, vi q[NV])
{
#if VW == 16
    uint8_t twice[16];
    memcpy(twice, p, 8);
    memcpy(twice + 8, p, 8);
    const vi w = widen_u8(twice);
    const vi shift = {0, 0, 0, 0, 0, 0, 0, 0, 2, 2, 2, 2, 2, 2, 2, 2};
    q[0] = ((w >> shift) & 3) << 4;
    q[1] = ((w >> (shift + 4)) & 3) << 4;
#else
    const vi w = widen_u8(p);
    _Pragma("GCC unroll 4") for (int j = 0; j < NV; j++) q[j] = ((w >> (2 * j)) & 3) << 4;
#endif
}

/* Per type: SB, G (k per scale group), REC (record bytes), OFFSET (whether w has an additive
 * term), ZERO (subtracted from the codes), scales(rec, g, s, o), and codes(rec, k, q) (minus
 * ZERO) and raw(rec, k, q) (as stored, or for BYTES types as nibble_bytes gives them), k within
 * the record. */

/* The per-type constants, and codes read by `decode` from `at` bytes into the record, `step`
 * bytes a k. */
#define QUANT_TYPE(T, sb, g, rec, offset, decode, at, step, zero, few_decode, bytes)              \
    enum { T##_SB = sb, T##_G = g, T##_REC = rec, T##_OFFSET = offset, T##_ZERO = zero,           \
           T##_BYTES = bytes };                                                                    \
    static inline __attribute__((always_inline)) void T##_codes(const uint8_t *r, int k, vf q[NV]) \
    {                                                                                              \
        decode(r + at + k * step, zero, q);                                                        \
    }                                                                                              \
    static inline __attribute__((always_inline)) void T##_raw(const uint8_t *r, int k, vf q[NV])   \
    {                                                                                              \
        few_decode(r + at + k * step, 0, q);                                                       \
    }

/* d[32] f16 per record. */
static inline __attribute__((always_inline)) void scale_only(const uint8_t *r, int g, vf s[NV], vf o[NV])
{
    (void)g, (void)o;
    _Pragma("GCC unroll 4") for (int j = 0; j < NV; j++) s[j] = load_f16(r + j * VW * 2);
}

/* d[32] f16, m[32] f16 per record. */
static inline __attribute__((always_inline)) void scale_and_min(const uint8_t *r, int g, vf s[NV], vf o[NV])
{
    (void)g;
    _Pragma("GCC unroll 4") for (int j = 0; j < NV; j++) {
        s[j] = load_f16(r + j * VW * 2);
        o[j] = load_f16(r + 64 + j * VW * 2);
    }
}

/* d[32] f16, dmin[32] f16, then per group of 32 k the 6-bit scales and mins as bytes. */
static inline __attribute__((always_inline)) void k_scale_and_min(const uint8_t *r, int g, vf s[NV], vf o[NV])
{
    _Pragma("GCC unroll 4") for (int j = 0; j < NV; j++) {
        s[j] = load_f16(r + j * VW * 2) * to_float(widen_u8(r + 128 + g * 32 + j * VW));
        o[j] = -load_f16(r + 64 + j * VW * 2) * to_float(widen_u8(r + 384 + g * 32 + j * VW));
    }
}

/* Q6_K: d[32] f16, then per group of 16 k the int8 scales. */
static inline __attribute__((always_inline)) void k6_scale(const uint8_t *r, int g, vf s[NV], vf o[NV])
{
    (void)o;
    _Pragma("GCC unroll 4") for (int j = 0; j < NV; j++)
        s[j] = load_f16(r + j * VW * 2) * to_float(widen_i8(r + 64 + g * 32 + j * VW));
}

static inline __attribute__((always_inline)) void int8_floats(const uint8_t *p, int zero, vf q[NV])
{
    (void)zero;
    _Pragma("GCC unroll 4") for (int j = 0; j < NV; j++) q[j] = to_float(widen_i8(p + j * VW));
}

static inline __attribute__((always_inline)) void six_bit_floats(const uint8_t *p, int zero, vf q[NV])
{
    vi lo[NV], hi[NV];
    nibbles(p, lo);
    high_pairs(p + 16, hi);
    _Pragma("GCC unroll 4") for (int j = 0; j < NV; j++) q[j] = to_float((lo[j] | hi[j]) - zero);
}

QUANT_TYPE(Q4_0, 32, 32, 64 + 32 * 16, 0, nibble_floats, 64, 16, 8, nibble_bytes, 1)
QUANT_TYPE(Q4_1, 32, 32, 128 + 32 * 16, 1, nibble_floats, 128, 16, 0, nibble_bytes, 1)
QUANT_TYPE(Q5_0, 32, 32, 64 + 32 * 20, 0, five_bit_floats, 64, 20, 16, five_bit_floats, 0)
QUANT_TYPE(Q5_1, 32, 32, 128 + 32 * 20, 1, five_bit_floats, 128, 20, 0, five_bit_floats, 0)
QUANT_TYPE(Q8_0, 32, 32, 64 + 32 * 32, 0, int8_floats, 64, 32, 0, int8_floats, 0)
QUANT_TYPE(Q4_K, 256, 32, 640 + 256 * 16, 1, nibble_floats, 640, 16, 0, nibble_bytes, 1)
QUANT_TYPE(Q5_K, 256, 32, 640 + 256 * 20, 1, five_bit_floats, 640, 20, 0, five_bit_floats, 0)
QUANT_TYPE(Q6_K, 256, 16, 576 + 256 * 24, 0, six_bit_floats, 576, 24, 32, six_bit_floats, 0)
#define Q4_0_scales scale_only
#define Q4_1_scales scale_and_min
#define Q5_0_scales scale_only
#define Q5_1_scales scale_and_min
#define Q8_0_scales scale_only
#define Q4_K_scales k_scale_and_min
#define Q5_K_scales k_scale_and_min
#define Q6_K_scales k6_scale

/* Per type T, two ways through one 32-column block w (K/SB records):
 * few_T_R: R rows of x; xsum [R, K/G] the rows' sums per group (used by offset types).
 * tile_T: k rows [k0, k0 + kc) dequantized into buf [kc, 32]. */
/* Sets of partial sums the few-rows path keeps for R rows: at least 8 independent FMA chains
 * (an FMA's latency over its throughput on current x86 cores). */
#ifndef MIN_CHAINS
#define MIN_CHAINS 8
#endif
#define CHAINS(R) ((R) * NV >= MIN_CHAINS ? 1 : MIN_CHAINS / ((R) * NV))

#define DEFINE_FEW(T, R)                                                                           \
static void few_##T##_##R(const float *x, int64_t ldx, const float *xsum, const uint8_t *w,       \
                          const float *bias, float *y, int64_t ldy, int32_t K)                     \
{                                                                                                  \
    vf acc[R][NV];                                                                                 \
    _Pragma("GCC unroll 16") for (int j = 0; j < NV; j++) {                                        \
        const vf b = bias ? loadv(bias + j * VW) : (vf){0};                                        \
        _Pragma("GCC unroll 16") for (int m = 0; m < R; m++) acc[m][j] = b;                        \
    }                                                                                              \
    const int32_t groups = K / T##_G;                                                              \
    for (int32_t gi = 0; gi < groups; gi++) {                                                      \
        const uint8_t *rec = w + (int64_t)(gi / (T##_SB / T##_G)) * T##_REC;                       \
        const int g = gi % (T##_SB / T##_G);                                                       \
        /* The hardware prefetcher alone left ~30% of the bandwidth unused at 2 threads. */        \
        for (int line = 0; line < T##_REC * T##_G / T##_SB; line += 64)                            \
            __builtin_prefetch(rec + g * (T##_REC * T##_G / T##_SB) + PREFETCH + line);            \
        /* CHAINS(R) sets of partial sums over interleaved k: one set of R * NV accumulators   \
         * left each FMA waiting on the previous one's latency at one row (4 chains, 4 cycles). */ \
        enum { P = CHAINS(R) };                                                                    \
        vf part[P][R][NV];                                                                         \
        _Pragma("GCC unroll 16") for (int p = 0; p < P; p++)                                       \
            _Pragma("GCC unroll 16") for (int m = 0; m < R; m++)                                   \
                _Pragma("GCC unroll 16") for (int j = 0; j < NV; j++) part[p][m][j] = (vf){0};     \
        const float *xg = x + (int64_t)gi * T##_G;                                                 \
        _Pragma("GCC unroll 2") for (int kk = 0; kk < T##_G; kk += P) {                            \
            _Pragma("GCC unroll 4") for (int p = 0; p < P; p++) {                                  \
                vf q[NV];                                                                          \
                T##_raw(rec, g * T##_G + kk + p, q);                                               \
                _Pragma("GCC unroll 16") for (int m = 0; m < R; m++) {                             \
                    const float xv = xg[m * ldx + kk + p];                                         \
                    _Pragma("GCC unroll 16") for (int j = 0; j < NV; j++)                          \
                        part[p][m][j] += xv * q[j];                                                \
                }                                                                                  \
            }                                                                                      \
        }                                                                                          \
        _Pragma("GCC unroll 4") for (int p = 1; p < P; p++)                                        \
            _Pragma("GCC unroll 16") for (int m = 0; m < R; m++)                                   \
                _Pragma("GCC unroll 16") for (int j = 0; j < NV; j++) part[0][m][j] += part[p][m][j]; \
        if (T##_BYTES) /* columns 16-31 summed whole bytes: take the low nibbles' sums off */   \
            _Pragma("GCC unroll 16") for (int m = 0; m < R; m++)                                   \
                _Pragma("GCC unroll 16") for (int j = 0; j < NV / 2; j++)                          \
                    part[0][m][j + NV / 2] = (part[0][m][j + NV / 2] - part[0][m][j]) * 0.0625f;   \
        vf s[NV], o[NV];                                                                           \
        T##_scales(rec, g, s, o);                                                                  \
        _Pragma("GCC unroll 16") for (int m = 0; m < R; m++)                                       \
            _Pragma("GCC unroll 16") for (int j = 0; j < NV; j++) {                                \
                acc[m][j] += s[j] * part[0][m][j];                                                    \
                /* The codes' zero point comes off once per group, with the offset. */          \
                if (T##_OFFSET) acc[m][j] += o[j] * xsum[m * groups + gi];                         \
                if (T##_ZERO) acc[m][j] -= (float)T##_ZERO * s[j] * xsum[m * groups + gi];         \
            }                                                                                      \
    }                                                                                              \
    _Pragma("GCC unroll 16") for (int m = 0; m < R; m++)                                           \
        _Pragma("GCC unroll 16") for (int j = 0; j < NV; j++)                                      \
            storev(y + m * ldy + j * VW, acc[m][j]);                                               \
}

#define DEFINE_TILE_DEQUANT(T)                                                                     \
static void tile_##T(const uint8_t *w, int32_t k0, int32_t kc, float *buf)                        \
{                                                                                                  \
    for (int32_t gi = k0 / T##_G; gi < (k0 + kc) / T##_G; gi++) {                                  \
        const uint8_t *rec = w + (int64_t)(gi / (T##_SB / T##_G)) * T##_REC;                       \
        const int g = gi % (T##_SB / T##_G);                                                       \
        vf s[NV], o[NV];                                                                           \
        T##_scales(rec, g, s, o);                                                                  \
        float *out = buf + (int64_t)(gi * T##_G - k0) * 32;                                        \
        for (int kk = 0; kk < T##_G; kk++) {                                                       \
            vf q[NV];                                                                              \
            T##_codes(rec, g * T##_G + kk, q);                                                     \
            _Pragma("GCC unroll 16") for (int j = 0; j < NV; j++)                                  \
                storev(out + kk * 32 + j * VW, T##_OFFSET ? s[j] * q[j] + o[j] : s[j] * q[j]);     \
        }                                                                                          \
    }                                                                                              \
}

#if FEW_ROWS == 4
#define DEFINE_QUANT(T)                                                                            \
    DEFINE_FEW(T, 1) DEFINE_FEW(T, 2) DEFINE_FEW(T, 3) DEFINE_FEW(T, 4) DEFINE_TILE_DEQUANT(T)     \
    static const few_fn few_##T[] = {few_##T##_1, few_##T##_2, few_##T##_3, few_##T##_4};
#else
#define DEFINE_QUANT(T)                                                                            \
    DEFINE_FEW(T, 1) DEFINE_FEW(T, 2) DEFINE_TILE_DEQUANT(T)                                       \
    static const few_fn few_##T[] = {few_##T##_1, few_##T##_2};
#endif

typedef void (*few_fn)(const float *, int64_t, const float *, const uint8_t *, const float *,
                       float *, int64_t, int32_t);

DEFINE_QUANT(Q4_0)
DEFINE_QUANT(Q4_1)
DEFINE_QUANT(Q5_0)
DEFINE_QUANT(Q5_1)
DEFINE_QUANT(Q8_0)
DEFINE_QUANT(Q4_K)
DEFINE_QUANT(Q5_K)
DEFINE_QUANT(Q6_K)

typedef struct {
    int32_t sb, g, rec;
    const few_fn *few; /* by rows - 1 */
    void (*tile)(const uint8_t *, int32_t, int32_t, float *);
} qtype_t;

#define QTYPE(T) {T##_SB, T##_G, T##_REC, few_##T, tile_##T}

static const qtype_t *qtype(int32_t type)
{
    static const qtype_t q4_0 = QTYPE(Q4_0), q4_1 = QTYPE(Q4_1), q5_0 = QTYPE(Q5_0),
                         q5_1 = QTYPE(Q5_1), q8_0 = QTYPE(Q8_0), q4_k = QTYPE(Q4_K),
                         q5_k = QTYPE(Q5_K), q6_k = QTYPE(Q6_K);
    switch (type) {
    case Q4_0: return &q4_0;
    case Q4_1: return &q4_1;
    case Q5_0: return &q5_0;
    case Q5_1: return &q5_1;
    case Q8_0: return &q8_0;
    case Q4_K: return &q4_k;
    case Q5_K: return &q5_k;
    case Q6_K: return &q6_k;
    default: return 0;
    }
}

/* Bytes of one 32-column block of a [N, K] weight of this type; 0 for an unknown type or a K
 * that is not a whole number of records. */
int64_t quant_block_bytes(int32_t type, int32_t K)
{
    const qtype_t *t = qtype(type);
    return t && K % t->sb == 0 ? (int64_t)(K / t->sb) * t->rec : 0;
}

/* One block's columns into y: a full block in place, the last, partial one (N % 32 columns)
 * through a [rows, 32] scratch. */
static void few_block(const qtype_t *t, const float *x, int64_t ldx, const float *xsum,
                      const uint8_t *w, const float *bias, float *y, int64_t ldy, int64_t M,
                      int32_t K, int32_t cols)
{
    for (int64_t m = 0; m < M; m += FEW_ROWS) {
        const int rows = M - m < FEW_ROWS ? (int)(M - m) : FEW_ROWS;
        const float *xs = xsum + m * (K / t->g);
        if (cols == 32) {
            t->few[rows - 1](x + m * ldx, ldx, xs, w, bias, y + m * ldy, ldy, K);
            continue;
        }
        float b[32] = {0}, out[FEW_ROWS * 32];
        if (bias) memcpy(b, bias, cols * sizeof(float));
        t->few[rows - 1](x + m * ldx, ldx, xs, w, b, out, 32, K);
        for (int r = 0; r < rows; r++) memcpy(y + (m + r) * ldy, out + r * 32, cols * sizeof(float));
    }
}

/* tile_T over rows [k0, k0 + kc) of every chunk of at most kc_max rows, then the GEMM tiles over
M rows: y = x @ W^T + bias for one full block, the partial last one through a scratch. */
static void tiled_block(const qtype_t *t, const float *x, int64_t ldx, const uint8_t *w,
                        const float *bias, float *y, int64_t ldy, int64_t M, int32_t K, int32_t cols,
                        float *buf, int32_t kc_max)
{
    if (cols == 32) {
        for (int32_t k0 = 0; k0 < K; k0 += kc_max) {
            const int32_t kc = K - k0 < kc_max ? K - k0 : kc_max;
            t->tile(w, k0, kc, buf);
            block_tiles(x + k0, ldx, buf, bias, k0 > 0, y, ldy, M, kc);
        }
        return;
    }
    enum { ROWS = 64 };
    float b[32] = {0}, out[ROWS * 32];
    if (bias) memcpy(b, bias, cols * sizeof(float));
    for (int64_t m = 0; m < M; m += ROWS) {
        const int64_t rows = M - m < ROWS ? M - m : ROWS;
        for (int32_t k0 = 0; k0 < K; k0 += kc_max) {
            const int32_t kc = K - k0 < kc_max ? K - k0 : kc_max;
            t->tile(w, k0, kc, buf);
            block_tiles(x + m * ldx + k0, ldx, buf, b, k0 > 0, out, 32, rows, kc);
        }
        for (int64_t r = 0; r < rows; r++) memcpy(y + (m + r) * ldy, out + r * 32, cols * sizeof(float));
    }
}

/* The few-rows path in pieces, for callers that split the blocks across their own threads
 * (decode_stack.c): quant_group() is the inputs per scale group of `type` (0 for an unknown
 * type); quant_row_sums() fills xsum [M, K / group] with x's sums per group; quant_few_block()
 * writes block nb's columns of y = x @ W^T + bias for M rows (w and bias whole, y at the
 * block's first column). */
int32_t quant_group(int32_t type)
{
    const qtype_t *t = qtype(type);
    return t ? t->g : 0;
}

void quant_row_sums(int32_t type, const float *x, int64_t ldx, int64_t M, int32_t K, float *xsum)
{
    const int32_t g = quant_group(type), groups = K / g;
    for (int64_t m = 0; m < M; m++)
        for (int32_t gi = 0; gi < groups; gi++) {
            float sum = 0.0f;
            for (int kk = 0; kk < g; kk++) sum += x[m * ldx + gi * g + kk];
            xsum[m * groups + gi] = sum;
        }
}

void quant_few_block(int32_t type, const float *x, int64_t ldx, const float *xsum,
                     const uint8_t *w, const float *bias, float *y, int64_t ldy, int64_t M,
                     int32_t K, int32_t N, int32_t nb)
{
    const int32_t cols = N - nb * 32 < 32 ? N - nb * 32 : 32;
    few_block(qtype(type), x, ldx, xsum, w + nb * quant_block_bytes(type, K),
              bias ? bias + nb * 32 : 0, y, ldy, M, K, cols);
}

/* x: [M, K] rows ldx apart; w: the packed weight of `type`, [ceil(N/32)] blocks; bias: [N] or
 * NULL; y: [M, N] rows ldy apart. Returns -1 for an unknown type or a K that is not a whole
 * number of records, -2 when a thread cannot allocate its dequantized tile. */
int32_t quant_linear_f32(int32_t type, const float *x, int64_t ldx, const uint8_t *w,
                         const float *bias, float *y, int64_t ldy, int64_t M, int32_t K, int32_t N,
                         int32_t num_threads)
{
    const qtype_t *t = qtype(type);
    const int64_t block_bytes = quant_block_bytes(type, K);
    if (!block_bytes) return -1;
    const int32_t blocks = (N + 31) / 32;
    if (M <= FEW_ROWS) {
        float xsum[FEW_ROWS * (K / t->g)];
        quant_row_sums(type, x, ldx, M, K, xsum);
        #pragma omp parallel for num_threads(num_threads) schedule(static)
        for (int32_t nb = 0; nb < blocks; nb++)
            quant_few_block(type, x, ldx, xsum, w, bias, y + nb * 32, ldy, M, K, N, nb);
        return 0;
    }
    /* Each thread dequantizes into its own tile of up to KC_MAX rows of k. */
    const int32_t kc_max = K < KC_MAX ? K : KC_MAX;
    int32_t failed = 0;
    #pragma omp parallel num_threads(num_threads)
    {
        float *buf = aligned_alloc(64, (size_t)kc_max * 32 * sizeof(float));
        if (!buf) {
            #pragma omp atomic write
            failed = 1;
        }
        #pragma omp for schedule(static)
        for (int32_t nb = 0; nb < blocks; nb++) {
            const int32_t cols = N - nb * 32 < 32 ? N - nb * 32 : 32;
            if (buf)
                tiled_block(t, x, ldx, w + nb * block_bytes, bias ? bias + nb * 32 : 0,
                            y + nb * 32, ldy, M, K, cols, buf, kc_max);
        }
        free(buf);
    }
    return failed ? -2 : 0;
}

/* Columns [first, first + count) of one packed block, dequantized into rows of out (ldo apart). */
static void block_columns(const qtype_t *t, const uint8_t *w, int32_t K, int32_t first,
                          int32_t count, float *out, int64_t ldo)
{
    float buf[KC * 32] __attribute__((aligned(64)));
    for (int32_t k0 = 0; k0 < K; k0 += KC) {
        const int32_t kc = K - k0 < KC ? K - k0 : KC;
        t->tile(w, k0, kc, buf);
        for (int32_t c = 0; c < count; c++)
            for (int32_t k = 0; k < kc; k++) out[c * ldo + k0 + k] = buf[k * 32 + first + c];
    }
}

/* The packed weight dequantized to fp32 rows: out [N, K] rows ldo apart. */
int32_t quant_dequantize_f32(int32_t type, const uint8_t *w, float *out, int64_t ldo, int32_t K,
                             int32_t N, int32_t num_threads)
{
    const qtype_t *t = qtype(type);
    const int64_t block_bytes = quant_block_bytes(type, K);
    if (!block_bytes) return -1;
    const int32_t blocks = (N + 31) / 32;
    #pragma omp parallel for num_threads(num_threads) schedule(static)
    for (int32_t nb = 0; nb < blocks; nb++)
        block_columns(t, w + nb * block_bytes, K, 0, N - nb * 32 < 32 ? N - nb * 32 : 32,
                      out + (int64_t)nb * 32 * ldo, ldo);
    return 0;
}

/* Rows ids[0..count) of the packed [N, K] weight as fp32: out [count, K] (an embedding lookup;
 * each row costs its block's dequantization). Returns -3 when an id is outside [0, N). */
int32_t quant_rows_f32(int32_t type, const uint8_t *w, int32_t K, int32_t N, const int64_t *ids,
                       int64_t count, float *out, int32_t num_threads)
{
    const qtype_t *t = qtype(type);
    const int64_t block_bytes = quant_block_bytes(type, K);
    if (!block_bytes) return -1;
    int32_t bad = 0;
    #pragma omp parallel for num_threads(num_threads) schedule(static) if (count > 1)
    for (int64_t i = 0; i < count; i++) {
        const int64_t n = ids[i];
        if (n < 0 || n >= N) {
            #pragma omp atomic write
            bad = 1;
            continue;
        }
        block_columns(t, w + (n / 32) * block_bytes, K, (int32_t)(n % 32), 1, out + i * K, K);
    }
    return bad ? -3 : 0;
}

/* The rows the few-rows path takes at once (and quant_linear_argmax_f32's limit). */
int32_t quant_few_rows(void) { return FEW_ROWS; }

/* Greedy decode's output projection: out[m] = the argmax over the first `vocab` columns of
 * x @ W^T for M <= FEW_ROWS rows, without writing the logits; the index quant_linear_f32 and an
 * argmax give (the first of equal maxima; 0 when no column is a number). Each thread runs the
 * few-rows path over its run of 32-column blocks into a block-sized buffer and keeps its rows'
 * best; the threads' bests merge in column order. Returns -1 for an unknown type or K, -4 for
 * M outside [1, FEW_ROWS] or vocab outside [1, N]. */
int32_t quant_linear_argmax_f32(int32_t type, const float *x, int64_t ldx, const uint8_t *w,
                                int64_t M, int32_t K, int32_t N, int32_t vocab, int64_t *out,
                                int32_t num_threads)
{
    const qtype_t *t = qtype(type);
    if (!t || !quant_block_bytes(type, K)) return -1;
    if (M < 1 || M > FEW_ROWS || vocab < 1 || vocab > N) return -4;
    const int32_t blocks = (vocab + 31) / 32;
    if (num_threads < 1) num_threads = 1;
    if (num_threads > blocks) num_threads = blocks;
    float xsum[FEW_ROWS * (K / t->g)];
    quant_row_sums(type, x, ldx, M, K, xsum);
    float best[num_threads * FEW_ROWS];
    int64_t where[num_threads * FEW_ROWS];
    for (int i = 0; i < num_threads * FEW_ROWS; i++) {
        best[i] = -INFINITY;
        where[i] = 0;
    }
    #pragma omp parallel num_threads(num_threads)
    {
        const int th = omp_get_thread_num(), nt = omp_get_num_threads();
        const int32_t lo = (int32_t)((int64_t)blocks * th / nt);
        const int32_t hi = (int32_t)((int64_t)blocks * (th + 1) / nt);
        float y[FEW_ROWS * 32];
        float *bv = best + th * FEW_ROWS;
        int64_t *bi = where + th * FEW_ROWS;
        for (int32_t nb = lo; nb < hi; nb++) {
            quant_few_block(type, x, ldx, xsum, w, 0, y, 32, M, K, N, nb);
            const int32_t cols = vocab - nb * 32 < 32 ? vocab - nb * 32 : 32;
            block_argmax_update(y, M, cols, (int64_t)nb * 32, bv, bi);
        }
    }
    block_argmax_merge(best, where, FEW_ROWS, num_threads, M, out);
    return 0;
}
