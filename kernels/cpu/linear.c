/* y = x @ W^T (+ bias) for fp32 on the CPU, with W pre-blocked as [N/32, K, 32].
 *
 * Each 32-column block of W is K rows of 32 contiguous floats, so a thread streams its blocks
 * front to back (one prefetch-friendly read of the weights for small batches) and a tile of R
 * rows of x keeps its accumulators (32 columns each) in registers across the whole K loop: per
 * k, 32 floats of W feed R x 32 multiply-adds. Tiles of 12 rows with AVX-512 (24 of its 32
 * vector registers), 3 rows with 256-bit vectors (12 of 16); the column blocks are split across
 * threads. On AMD CPUs MKL runs its AVX2 code, so with AVX-512 this is about twice torch's
 * matmul there.
 */
#include <stdint.h>

#include "vec.h"

#define NV (32 / VW) /* vectors per block row */

#define DEFINE_TILE(R)                                                                             \
static inline void tile_##R(const float *x, int64_t ldx, const float *w, const float *bias,       \
                            float *y, int64_t ldy, int32_t K)                                      \
{                                                                                                  \
    vf acc[R][NV];                                                                                 \
    _Pragma("GCC unroll 16") for (int j = 0; j < NV; j++) {                                        \
        const vf b = bias ? loadv(bias + j * VW) : (vf){0};                                        \
        _Pragma("GCC unroll 16") for (int m = 0; m < R; m++) acc[m][j] = b;                        \
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

/* x: [M, K] rows ldx apart; w_blocked: [N/32, K, 32]; bias: [N] or NULL; y: [M, N] rows ldy
 * apart. N must be a multiple of 32. */
void linear_f32(const float *x, int64_t ldx, const float *w_blocked, const float *bias, float *y,
                int64_t ldy, int64_t M, int32_t K, int32_t N, int32_t num_threads)
{
    const int32_t blocks = N / 32;
    #pragma omp parallel for num_threads(num_threads) schedule(static)
    for (int32_t nb = 0; nb < blocks; nb++) {
        const float *w = w_blocked + (int64_t)nb * K * 32;
        const float *b = bias ? bias + nb * 32 : 0;
        float *yb = y + nb * 32;
        int64_t m = 0;
#if VW == 16
        for (; m + 12 <= M; m += 12) tile_12(x + m * ldx, ldx, w, b, yb + m * ldy, ldy, K);
        for (; m + 4 <= M; m += 4) tile_4(x + m * ldx, ldx, w, b, yb + m * ldy, ldy, K);
#else
        for (; m + 3 <= M; m += 3) tile_3(x + m * ldx, ldx, w, b, yb + m * ldy, ldy, K);
#endif
        for (; m + 2 <= M; m += 2) tile_2(x + m * ldx, ldx, w, b, yb + m * ldy, ldy, K);
        for (; m < M; m++) tile_1(x + m * ldx, ldx, w, b, yb + m * ldy, ldy, K);
    }
}
