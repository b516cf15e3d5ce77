/* The vector type of the kernels: the widest the build target has (16 floats with AVX-512, 8
 * otherwise), through GCC vector extensions so the same source builds for any x86 (or other)
 * target. Loads and stores go through an unaligned, may_alias twin of the type. */
#ifndef ENGINE_VEC_H
#define ENGINE_VEC_H

#include <stdint.h>
#include <string.h>
#if defined(__AVX2__) || defined(__AVX512F__)
#include <immintrin.h>
#endif

#ifdef __AVX512F__
#define VW 16
#else
#define VW 8
#endif

typedef float vf __attribute__((vector_size(VW * 4)));
typedef float vf_unaligned __attribute__((vector_size(VW * 4), aligned(4), may_alias));
typedef int32_t vi __attribute__((vector_size(VW * 4)));

static inline __attribute__((always_inline)) vf loadv(const float *p)
{
    return *(const vf_unaligned *)p;
}

static inline __attribute__((always_inline)) void storev(float *p, vf v) { *(vf_unaligned *)p = v; }

static inline __attribute__((always_inline)) vf to_float(vi v) { return __builtin_convertvector(v, vf); }

/* Integer widening and half-precision loads: GCC turns vector-extension conversions of bytes
 * into scalar code, so the x86 instructions are named here (AVX2, AVX-512), with a plain
 * fallback for other targets. */

/* VW bytes at p, zero-extended into 32-bit lanes. */
static inline __attribute__((always_inline)) vi widen_u8(const uint8_t *p)
{
#if VW == 16
    return (vi)_mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)p));
#elif defined(__AVX2__)
    return (vi)_mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)p));
#else
    vi v;
    for (int i = 0; i < VW; i++) v[i] = p[i];
    return v;
#endif
}

/* VW signed bytes at p, sign-extended into 32-bit lanes. */
static inline __attribute__((always_inline)) vi widen_i8(const uint8_t *p)
{
#if VW == 16
    return (vi)_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)p));
#elif defined(__AVX2__)
    return (vi)_mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)p));
#else
    vi v;
    for (int i = 0; i < VW; i++) v[i] = (int8_t)p[i];
    return v;
#endif
}

/* IEEE half to float, for targets without a conversion instruction. */
static inline float half_to_float(uint16_t h)
{
    const uint32_t sign = (uint32_t)(h & 0x8000) << 16, exp = (h >> 10) & 0x1f, man = h & 0x3ff;
    float magnitude;
    if (exp == 0) {
        magnitude = (float)man * (1.0f / 16777216.0f); /* subnormal: man * 2^-24 */
    } else {
        const uint32_t bits = exp == 31 ? 0x7f800000 | (man << 13) : ((exp + 112) << 23) | (man << 13);
        memcpy(&magnitude, &bits, 4);
    }
    uint32_t out;
    memcpy(&out, &magnitude, 4);
    out |= sign;
    float f;
    memcpy(&f, &out, 4);
    return f;
}

/* VW half-precision floats at p as fp32. */
static inline __attribute__((always_inline)) vf load_f16(const uint8_t *p)
{
#if VW == 16
    return (vf)_mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)p));
#elif defined(__F16C__)
    return (vf)_mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)p));
#else
    vf v;
    for (int i = 0; i < VW; i++) {
        uint16_t h;
        memcpy(&h, p + 2 * i, 2);
        v[i] = half_to_float(h);
    }
    return v;
#endif
}

/* Subnormal floats (e.g. exp of a score far below the row's max) take a slow microcode path;
 * the kernels flush them to zero, for the calling thread only and for the span of the kernel
 * (MXCSR is per thread: each thread of a parallel region sets and restores its own). */
#if defined(__SSE__)
#include <xmmintrin.h>
static inline unsigned ftz_enter(void)
{
    const unsigned old = _mm_getcsr();
    _mm_setcsr(old | 0x8040); /* FTZ | DAZ */
    return old;
}
static inline void ftz_leave(unsigned old) { _mm_setcsr(old); }
#else
static inline unsigned ftz_enter(void) { return 0; }
static inline void ftz_leave(unsigned old) { (void)old; }
#endif

#endif
