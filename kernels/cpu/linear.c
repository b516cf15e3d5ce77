/* y = x @ W^T (+ bias) for fp32 on the CPU, with W pre-blocked as [N/32, K, 32].
 *
 * Each 32-column block of W is K rows of 32 contiguous floats, so a thread streams its blocks
 * front to back (one prefetch-friendly read of the weights for small batches) while the register
 * tiles of gemm_tile.h keep R rows' accumulators across the whole K loop; the column blocks are
 * split across threads. On AMD CPUs MKL runs its AVX2 code, so with AVX-512 this is about twice
 * torch's matmul there.
 */
#include <math.h>
#include <omp.h>
#include <stdint.h>
#include <stdlib.h>

#include "block_argmax.h"
#include "gemm_tile.h"

/* x: [M, K] rows ldx apart; w_blocked: [N/32, K, 32]; bias: [N] or NULL; y: [M, N] rows ldy
 * apart. N must be a multiple of 32. */
void linear_f32(const float *x, int64_t ldx, const float *w_blocked, const float *bias, float *y,
                int64_t ldy, int64_t M, int32_t K, int32_t N, int32_t num_threads)
{
    const int32_t blocks = N / 32;
    #pragma omp parallel for num_threads(num_threads) schedule(static)
    for (int32_t nb = 0; nb < blocks; nb++)
        block_tiles(x, ldx, w_blocked + (int64_t)nb * K * 32, bias ? bias + nb * 32 : 0, 0,
                    y + nb * 32, ldy, M, K);
}

/* Greedy sampling fused with the output projection: out[m] = argmax_n (x @ W^T)[m, n] over the
 * first `vocab` columns, without writing the [M, N] logits (tens of MB at large batches, which
 * flush the caches the engine's bookkeeping runs from). Each thread computes its contiguous range
 * of column blocks into a [M, 32] scratch with the same tiles as linear_f32 (so the values, and
 * the index chosen, are linear_f32's bit for bit) and keeps each row's first maximum; ranges are
 * merged in column order, so ties go to the lowest index, as torch.argmax. Rows without NaN. */
void linear_argmax_f32(const float *x, int64_t ldx, const float *w_blocked, int64_t M, int32_t K,
                       int32_t N, int32_t vocab, int64_t *out, int32_t num_threads)
{
    const int32_t blocks = N / 32;
    if (num_threads < 1)
        num_threads = 1;
    if (num_threads > blocks)
        num_threads = blocks > 0 ? blocks : 1;
    float *best = malloc(sizeof(float) * (size_t)(M * num_threads));
    int64_t *where = malloc(sizeof(int64_t) * (size_t)(M * num_threads));
    float *scratch = malloc(sizeof(float) * (size_t)(M * 32 * num_threads));
    #pragma omp parallel num_threads(num_threads)
    {
        const int t = omp_get_thread_num(), nt = omp_get_num_threads();
        const int32_t lo = (int32_t)((int64_t)blocks * t / nt);
        const int32_t hi = (int32_t)((int64_t)blocks * (t + 1) / nt);
        float *bv = best + (int64_t)t * M, *y = scratch + (int64_t)t * M * 32;
        int64_t *bi = where + (int64_t)t * M;
        for (int64_t m = 0; m < M; m++) {
            bv[m] = -INFINITY;
            bi[m] = (int64_t)lo * 32;
        }
        for (int32_t nb = lo; nb < hi; nb++) {
            block_tiles(x, ldx, w_blocked + (int64_t)nb * K * 32, 0, 0, y, 32, M, K);
            const int32_t cols = vocab - nb * 32 < 32 ? vocab - nb * 32 : 32;
            block_argmax_update(y, M, cols, (int64_t)nb * 32, bv, bi);
        }
    }
    block_argmax_merge(best, where, M, num_threads, M, out);
    free(best);
    free(where);
    free(scratch);
}

/* The SwiGLU feed-forward's first half fused: out = silu(x @ G^T) * (x @ U^T), with the gate and
 * up weights blocked in pairs, [I/32, 2, K, 32] (gate block j, then up block j). A tile keeps
 * both blocks' accumulators in registers and applies silu * mul on them, so the [M, 2I]
 * intermediate and its second pass never exist. Tiles of 6 rows with AVX-512 (24 accumulators);
 * with 256-bit vectors one row (8), where the split GEMM + silu_and_mul is the better choice
 * (swiglu_tile_rows() tells callers). */
#if VW == 16
#define SWIGLU_ROWS 6
#else
#define SWIGLU_ROWS 1
#endif

int32_t swiglu_tile_rows(void) { return SWIGLU_ROWS; }

#define DEFINE_SWIGLU_TILE(R)                                                                      \
static inline void swiglu_tile_##R(const float *x, int64_t ldx, const float *wg, const float *wu, \
                                   float *y, int64_t ldy, int32_t K)                               \
{                                                                                                  \
    vf g[R][NV], u[R][NV];                                                                         \
    _Pragma("GCC unroll 16") for (int m = 0; m < R; m++)                                           \
        _Pragma("GCC unroll 16") for (int j = 0; j < NV; j++) g[m][j] = u[m][j] = (vf){0};         \
    for (int32_t k = 0; k < K; k++) {                                                              \
        vf gk[NV], uk[NV];                                                                         \
        _Pragma("GCC unroll 16") for (int j = 0; j < NV; j++) {                                    \
            gk[j] = loadv(wg + (int64_t)k * 32 + j * VW);                                          \
            uk[j] = loadv(wu + (int64_t)k * 32 + j * VW);                                          \
        }                                                                                          \
        _Pragma("GCC unroll 16") for (int m = 0; m < R; m++) {                                     \
            const float xv = x[m * ldx + k];                                                       \
            _Pragma("GCC unroll 16") for (int j = 0; j < NV; j++) {                                \
                g[m][j] += xv * gk[j];                                                             \
                u[m][j] += xv * uk[j];                                                             \
            }                                                                                      \
        }                                                                                          \
    }                                                                                              \
    for (int m = 0; m < R; m++) {                                                                  \
        float gs[32], us[32];                                                                      \
        _Pragma("GCC unroll 16") for (int j = 0; j < NV; j++) {                                    \
            storev(gs + j * VW, g[m][j]);                                                          \
            storev(us + j * VW, u[m][j]);                                                          \
        }                                                                                          \
        float *out = y + m * ldy;                                                                  \
        for (int i = 0; i < 32; i++) out[i] = gs[i] / (1.0f + expf(-gs[i])) * us[i];              \
    }                                                                                              \
}

#if SWIGLU_ROWS > 1
DEFINE_SWIGLU_TILE(6)
DEFINE_SWIGLU_TILE(3)
DEFINE_SWIGLU_TILE(2)
#endif
DEFINE_SWIGLU_TILE(1)

/* x: [M, K] rows ldx apart; w_pairs: [I/32, 2, K, 32]; y: [M, I] rows ldy apart. */
void swiglu_f32(const float *x, int64_t ldx, const float *w_pairs, float *y, int64_t ldy,
                int64_t M, int32_t K, int32_t I, int32_t num_threads)
{
    const int32_t blocks = I / 32;
    #pragma omp parallel for num_threads(num_threads) schedule(static)
    for (int32_t nb = 0; nb < blocks; nb++) {
        const float *wg = w_pairs + (int64_t)nb * 2 * K * 32, *wu = wg + (int64_t)K * 32;
        float *yb = y + nb * 32;
        int64_t m = 0;
#if SWIGLU_ROWS > 1
        for (; m + 6 <= M; m += 6) swiglu_tile_6(x + m * ldx, ldx, wg, wu, yb + m * ldy, ldy, K);
        for (; m + 3 <= M; m += 3) swiglu_tile_3(x + m * ldx, ldx, wg, wu, yb + m * ldy, ldy, K);
        for (; m + 2 <= M; m += 2) swiglu_tile_2(x + m * ldx, ldx, wg, wu, yb + m * ldy, ldy, K);
#endif
        for (; m < M; m++) swiglu_tile_1(x + m * ldx, ldx, wg, wu, yb + m * ldy, ldy, K);
    }
}
