/* The register tile of the fp32 GEMM on blocked weights (linear.c), shared with the quantized
 * kernels (quant_linear.c), which dequantize weights into the same [K, 32] block layout.
 *
 * A tile of R rows of x keeps its accumulators (32 columns each) in registers across the whole K
 * loop: per k, 32 floats of W feed R x 32 multiply-adds. Tiles of 12 rows with AVX-512 (24 of
 * its 32 vector registers); with 256-bit vectors 6 rows over each half of the block (12 of 16),
 * then 3, 2, 1 rows for the rest. With AVX-512 a block's rows go in passes of at most 12, evened
 * out (8 rows: one pass of 8, not 4 + 4), so a decode step's few rows per weight block read it
 * once. With `accumulate` the tile adds to y instead of starting from the bias, so K may be
 * covered in several passes.
 *
 * Each k step prefetches the weight row PF_K steps ahead (2 KB): a [512, 32] block is 64 KB
 * over 16 pages, at each of which the hardware streamer restarts, and a decode step's weights
 * come from memory (offline-mixed's MoE experts 3.8 -> 2.6 ms a layer at 64 tokens out of
 * cache; the 49152 x 512 output projection with argmax 12.4 -> 9.6 ms at 64 rows; AVX-512 box).
 * Neither the passes nor the prefetch change a result: each output is the same FMA chain over k.
 */
#ifndef ENGINE_GEMM_TILE_H
#define ENGINE_GEMM_TILE_H

#include <stdint.h>

#include "vec.h"

#define NV (32 / VW) /* vectors per block row */
#ifndef PF_K
#define PF_K 16
#endif

#define DEFINE_TILE(R)                                                                             \
static inline void tile_##R(const float *x, int64_t ldx, const float *w, const float *bias,       \
                            int accumulate, float *y, int64_t ldy, int32_t K)                      \
{                                                                                                  \
    vf acc[R][NV];                                                                                 \
    if (accumulate) {                                                                              \
        _Pragma("GCC unroll 16") for (int m = 0; m < R; m++)                                       \
            _Pragma("GCC unroll 16") for (int j = 0; j < NV; j++)                                  \
                acc[m][j] = loadv(y + m * ldy + j * VW);                                           \
    } else {                                                                                       \
        _Pragma("GCC unroll 16") for (int j = 0; j < NV; j++) {                                    \
            const vf b = bias ? loadv(bias + j * VW) : (vf){0};                                    \
            _Pragma("GCC unroll 16") for (int m = 0; m < R; m++) acc[m][j] = b;                    \
        }                                                                                          \
    }                                                                                              \
    for (int32_t k = 0; k < K; k++) {                                                              \
        vf wk[NV];                                                                                 \
        __builtin_prefetch(w + (int64_t)(k + PF_K) * 32);                                          \
        __builtin_prefetch(w + (int64_t)(k + PF_K) * 32 + 16);                                     \
        _Pragma("GCC unroll 16") for (int j = 0; j < NV; j++)                                      \
            wk[j] = loadv(w + (int64_t)k * 32 + j * VW);                                           \
        _Pragma("GCC unroll 16") for (int m = 0; m < R; m++) {                                     \
            const float xv = x[m * ldx + k];                                                       \
            _Pragma("GCC unroll 16") for (int j = 0; j < NV; j++) acc[m][j] += xv * wk[j];         \
        }                                                                                          \
    }                                                                                              \
    _Pragma("GCC unroll 16") for (int m = 0; m < R; m++)                                           \
        _Pragma("GCC unroll 16") for (int j = 0; j < NV; j++)                                      \
            storev(y + m * ldy + j * VW, acc[m][j]);                                               \
}

#if VW == 16
DEFINE_TILE(12)
DEFINE_TILE(11)
DEFINE_TILE(10)
DEFINE_TILE(9)
DEFINE_TILE(8)
DEFINE_TILE(7)
DEFINE_TILE(6)
DEFINE_TILE(5)
DEFINE_TILE(4)
DEFINE_TILE(3)
#else
DEFINE_TILE(3)
#endif
DEFINE_TILE(2)
DEFINE_TILE(1)

#if VW == 8
/* 6 rows x 16 columns (half a block): 12 accumulators, and per k two weight vectors loaded once
 * for six broadcasts; tile_3 reloads each weight vector three times and is bound by loads. */
static inline void tile_6x16(const float *x, int64_t ldx, const float *w, const float *bias,
                             int accumulate, float *y, int64_t ldy, int32_t K)
{
    vf acc[6][2];
    _Pragma("GCC unroll 2") for (int j = 0; j < 2; j++) {
        const vf b = bias ? loadv(bias + j * VW) : (vf){0};
        _Pragma("GCC unroll 6") for (int m = 0; m < 6; m++)
            acc[m][j] = accumulate ? loadv(y + m * ldy + j * VW) : b;
    }
    for (int32_t k = 0; k < K; k++) {
        __builtin_prefetch(w + (int64_t)(k + PF_K) * 32);
        const vf w0 = loadv(w + (int64_t)k * 32), w1 = loadv(w + (int64_t)k * 32 + VW);
        _Pragma("GCC unroll 6") for (int m = 0; m < 6; m++) {
            const vf xv = (vf){0} + x[m * ldx + k];
            acc[m][0] += xv * w0;
            acc[m][1] += xv * w1;
        }
    }
    _Pragma("GCC unroll 6") for (int m = 0; m < 6; m++)
        _Pragma("GCC unroll 2") for (int j = 0; j < 2; j++) storev(y + m * ldy + j * VW, acc[m][j]);
}
#endif

/* y[:M, :32] (rows ldy apart) = x[:M, :K] @ w (one [K, 32] block) + bias, or += with accumulate. */
static inline void block_tiles(const float *x, int64_t ldx, const float *w, const float *bias,
                               int accumulate, float *y, int64_t ldy, int64_t M, int32_t K)
{
    int64_t m = 0;
#if VW == 16
    while (m < M) {
        const int64_t left = M - m, passes = (left + 11) / 12;
        const int r = (int)((left + passes - 1) / passes);
        const float *xm = x + m * ldx;
        float *ym = y + m * ldy;
        switch (r) {
        case 12: tile_12(xm, ldx, w, bias, accumulate, ym, ldy, K); break;
        case 11: tile_11(xm, ldx, w, bias, accumulate, ym, ldy, K); break;
        case 10: tile_10(xm, ldx, w, bias, accumulate, ym, ldy, K); break;
        case 9: tile_9(xm, ldx, w, bias, accumulate, ym, ldy, K); break;
        case 8: tile_8(xm, ldx, w, bias, accumulate, ym, ldy, K); break;
        case 7: tile_7(xm, ldx, w, bias, accumulate, ym, ldy, K); break;
        case 6: tile_6(xm, ldx, w, bias, accumulate, ym, ldy, K); break;
        case 5: tile_5(xm, ldx, w, bias, accumulate, ym, ldy, K); break;
        case 4: tile_4(xm, ldx, w, bias, accumulate, ym, ldy, K); break;
        case 3: tile_3(xm, ldx, w, bias, accumulate, ym, ldy, K); break;
        case 2: tile_2(xm, ldx, w, bias, accumulate, ym, ldy, K); break;
        default: tile_1(xm, ldx, w, bias, accumulate, ym, ldy, K); break;
        }
        m += r;
    }
#else
    for (; m + 6 <= M; m += 6)
        for (int h = 0; h < 32; h += 16)
            tile_6x16(x + m * ldx, ldx, w + h, bias ? bias + h : 0, accumulate, y + m * ldy + h, ldy, K);
    for (; m + 3 <= M; m += 3) tile_3(x + m * ldx, ldx, w, bias, accumulate, y + m * ldy, ldy, K);
#endif
    for (; m + 2 <= M; m += 2) tile_2(x + m * ldx, ldx, w, bias, accumulate, y + m * ldy, ldy, K);
    for (; m < M; m++) tile_1(x + m * ldx, ldx, w, bias, accumulate, y + m * ldy, ldy, K);
}

#endif
