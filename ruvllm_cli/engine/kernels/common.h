/* Helpers every kernel file shares (kernels/__init__.py builds each .c beside this
 * header and hashes both into the library's name). */

#ifndef RUVLLM_COMMON_H
#define RUVLLM_COMMON_H

#include <immintrin.h>
#include <stdint.h>
#include <string.h>

/* A bfloat16 value as float32, exactly. */
static inline float bf16_load(uint16_t h) {
    uint32_t u = (uint32_t)h << 16;
    float f;
    memcpy(&f, &u, 4);
    return f;
}

/* Round to nearest even, as torch converts (NaN stays a quiet NaN). */
static inline uint16_t bf16_round(float f) {
    uint32_t u;
    memcpy(&u, &f, 4);
    if ((u & 0x7fffffffu) > 0x7f800000u) return (uint16_t)((u >> 16) | 0x40);
    return (uint16_t)((u + 0x7fffu + ((u >> 16) & 1u)) >> 16);
}

/* The sum of eight float32 lanes. */
static inline float hsum(__m256 v) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s = _mm_add_ss(s, _mm_shuffle_ps(s, s, 1));
    return _mm_cvtss_f32(s);
}

#endif
