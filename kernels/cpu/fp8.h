/* float8 e4m3 (torch.float8_e4m3fn) conversions of the fp8 KV cache (--kv-cache-dtype fp8):
 * 4 exponent bits (bias 7), 3 mantissa bits, no infinities, 0x7f / 0xff NaN, largest 448. */
#ifndef ENGINE_FP8_H
#define ENGINE_FP8_H

#include <stdint.h>
#include <string.h>

#include "vec.h"

/* x rounded to the nearest e4m3 (ties to even), saturating at +-448 as torch's conversion does
 * (NaN stays NaN). Integer arithmetic only: the library is built with -ffast-math, and the
 * rounding must equal torch's bit for bit. */
static inline uint8_t e4m3_from_float(float x)
{
    uint32_t u;
    memcpy(&u, &x, 4);
    const uint8_t sign = (uint8_t)((u >> 24) & 0x80);
    const uint32_t a = u & 0x7fffffffu;
    if (a > 0x7f800000u) return sign | 0x7f;     /* NaN */
    if (a >= 0x43e00000u) return sign | 0x7e;    /* >= 448 (and inf): saturate */
    if (a >= 0x3c800000u) {                      /* >= 2^-6: a normal e4m3 */
        const uint32_t r = (a + 0x7ffffu + ((a >> 20) & 1)) >> 20; /* 3 mantissa bits, RNE */
        return sign | (uint8_t)(r - (120u << 3)); /* exponent bias 127 -> 7 */
    }
    /* A subnormal m * 2^-9 (m = 8 is 2^-6, the smallest normal's encoding): m = |x| * 2^9
     * rounded to even, from the float's 24-bit significand. */
    const int32_t shift = 14 - ((int32_t)(a >> 23) - 127);
    if (shift > 24) return sign;                 /* below 2^-10: rounds to 0 */
    const uint32_t sig = (a & 0x7fffffu) | 0x800000u;
    uint32_t m = sig >> shift;
    const uint32_t rem = sig & ((1u << shift) - 1), half = 1u << (shift - 1);
    if (rem > half || (rem == half && (m & 1))) m++;
    return sign | (uint8_t)m;
}

typedef uint32_t vu_fp8 __attribute__((vector_size(VW * 4)));

/* VW e4m3 values at p as floats, exactly (NaN bytes are never written by e4m3_from_float's
 * callers). With a half-precision conversion instruction: the byte's sign and magnitude moved
 * into a half's bits (e4m3 is e5m10 with the exponent bias 8 apart and the low mantissa bits
 * zero, subnormals included), converted, times 2^8. Otherwise: normal values rebiased in the
 * float's bits, subnormals (exponent 0) the mantissa times 2^-9. Neither forms a float
 * subnormal, so the kernels' flush-to-zero mode leaves every value intact. */
static inline __attribute__((always_inline)) vf load_e4m3(const uint8_t *p)
{
#if VW == 16
    const __m256i w = _mm256_cvtepu8_epi16(_mm_loadu_si128((const __m128i *)p));
    const __m256i h = _mm256_or_si256(
        _mm256_and_si256(_mm256_slli_epi16(w, 8), _mm256_set1_epi16((short)0x8000)),
        _mm256_and_si256(_mm256_slli_epi16(w, 7), _mm256_set1_epi16(0x3f80)));
    return (vf)_mm512_cvtph_ps(h) * 256.0f;
#elif defined(__AVX2__) && defined(__F16C__)
    const __m128i w = _mm_cvtepu8_epi16(_mm_loadl_epi64((const __m128i *)p));
    const __m128i h = _mm_or_si128(
        _mm_and_si128(_mm_slli_epi16(w, 8), _mm_set1_epi16((short)0x8000)),
        _mm_and_si128(_mm_slli_epi16(w, 7), _mm_set1_epi16(0x3f80)));
    return (vf)_mm256_cvtph_ps(h) * 256.0f;
#else
    const vu_fp8 b = (vu_fp8)widen_u8(p);
    const vu_fp8 mag = b & 0x7f;
    const vu_fp8 normal = (mag << 20) + (120u << 23);
    const vf sub = to_float((vi)mag) * (1.0f / 512.0f);
    const vu_fp8 is_sub = (vu_fp8)(mag < 8); /* all ones where the exponent is 0 */
    const vu_fp8 bits = ((is_sub & (vu_fp8)sub) | (~is_sub & normal)) | ((b & 0x80) << 24);
    return (vf)bits;
#endif
}

#endif
