/* The register tile of the fp32 GEMM on blocked weights (linear.c), shared with the quantized
 * kernels (quant_linear.c), which dequantize weights into the same [K, 32] block layout.
 *
 * A tile of R rows of x keeps its accumulators (32 columns each) in registers across the whole K
 * loop: per k, 32 floats of W feed R x 32 multiply-adds. Tiles of 12 rows with AVX-512 (24 of
 * its 32 vector registers); with 256-bit vectors 6 rows over each half of the block (12 of 16),
 * then 3, 2, 1 rows for the rest. With `accumulate` the tile adds to y instead of starting from
 * the bias, so K may be covered in several passes. */
#ifndef ENGINE_GEMM_TILE_H
#define ENGINE_GEMM_TILE_H

#include <stdint.h>

#include "vec.h"

#define NV (32 / VW) /* vectors per block row */

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
DEFINE_TILE(4)
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
    for (; m + 12 <= M; m += 12) tile_12(x + m * ldx, ldx, w, bias, accumulate, y + m * ldy, ldy, K);
    for (; m + 4 <= M; m += 4) tile_4(x + m * ldx, ldx, w, bias, accumulate, y + m * ldy, ldy, K);
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
