/* The vector type of the kernels: the widest the build target has (16 floats with AVX-512, 8
 * otherwise), through GCC vector extensions so the same source builds for any x86 (or other)
 * target. Loads and stores go through an unaligned, may_alias twin of the type. */
#ifndef ENGINE_VEC_H
#define ENGINE_VEC_H

#ifdef __AVX512F__
#define VW 16
#else
#define VW 8
#endif

typedef float vf __attribute__((vector_size(VW * 4)));
typedef float vf_unaligned __attribute__((vector_size(VW * 4), aligned(4), may_alias));

static inline __attribute__((always_inline)) vf loadv(const float *p)
{
    return *(const vf_unaligned *)p;
}

static inline __attribute__((always_inline)) void storev(float *p, vf v) { *(vf_unaligned *)p = v; }

#endif
