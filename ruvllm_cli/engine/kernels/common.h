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

/* bf16_round for sixteen lanes, for AVX-512 code (files built for it, or functions with
 * its target attribute): bf16_held16 leaves the rounded values as float32 (what
 * transformers holds after a bfloat16 op), bf16_pack16 takes such values to their 16
 * bits. */
#define RUVLLM_AVX512_INLINE __attribute__((target("avx512f,avx512bw"), always_inline)) static inline

RUVLLM_AVX512_INLINE __m512 bf16_held16(__m512 v) {
    const __m512i u = _mm512_castps_si512(v), high = _mm512_set1_epi32((int)0xffff0000u);
    const __m512i odd = _mm512_and_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(1));
    const __m512i rounded = _mm512_and_si512(_mm512_add_epi32(_mm512_add_epi32(u, _mm512_set1_epi32(0x7fff)), odd), high);
    const __m512i quiet = _mm512_and_si512(_mm512_or_si512(u, _mm512_set1_epi32(0x400000)), high);
    return _mm512_castsi512_ps(_mm512_mask_blend_epi32(_mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q), rounded, quiet));
}

RUVLLM_AVX512_INLINE __m256i bf16_pack16(__m512 held) {
    return _mm512_cvtepi32_epi16(_mm512_srli_epi32(_mm512_castps_si512(held), 16));
}

/* bf16_held16 for eight lanes (AVX2). */
static inline __m256 bf16_held8(__m256 v) {
    const __m256i u = _mm256_castps_si256(v), high = _mm256_set1_epi32((int)0xffff0000u);
    const __m256i odd = _mm256_and_si256(_mm256_srli_epi32(u, 16), _mm256_set1_epi32(1));
    const __m256i rounded = _mm256_and_si256(_mm256_add_epi32(_mm256_add_epi32(u, _mm256_set1_epi32(0x7fff)), odd), high);
    const __m256i quiet = _mm256_and_si256(_mm256_or_si256(u, _mm256_set1_epi32(0x400000)), high);
    return _mm256_blendv_ps(_mm256_castsi256_ps(rounded), _mm256_castsi256_ps(quiet), _mm256_cmp_ps(v, v, _CMP_UNORD_Q));
}

/* bf16_pack16 for eight lanes: held values to their 16 bits. */
static inline __m128i bf16_pack8(__m256 held) {
    const __m256i bits = _mm256_srli_epi32(_mm256_castps_si256(held), 16);
    return _mm_packus_epi32(_mm256_castsi256_si128(bits), _mm256_extracti128_si256(bits, 1));
}

/* int4_gemm.c's first step: x [M, K] bfloat16 widened to float32 in xf, and each row's
 * sum over each group of `group` values in totals [M][K / group]. A sum runs in sixteen
 * lanes along the group, then adds the lanes in one written-out tree (the one GCC's
 * _mm512_reduce_add_ps takes), so any compiler holds the same totals. (int4_gemm_avx2.c
 * had shared it until it took int8 activations.) */
static inline void int4_widen_rows(const uint16_t *x, int64_t M, int64_t K, int64_t group, float *xf,
                                   float *totals, int threads) {
    const int64_t groups = K / group;
    #pragma omp parallel for num_threads(threads) schedule(static) if (M * K >= 32768)
    for (int64_t m = 0; m < M; ++m)
        for (int64_t g = 0; g < groups; ++g) {
            __m256 low = _mm256_setzero_ps(), high = _mm256_setzero_ps();
            for (int64_t k = g * group; k < (g + 1) * group; k += 16) {
                const __m256i raw = _mm256_loadu_si256((const __m256i *)(x + m * K + k));
                const __m256 a = _mm256_castsi256_ps(_mm256_slli_epi32(
                    _mm256_cvtepu16_epi32(_mm256_castsi256_si128(raw)), 16));
                const __m256 b = _mm256_castsi256_ps(_mm256_slli_epi32(
                    _mm256_cvtepu16_epi32(_mm256_extracti128_si256(raw, 1)), 16));
                _mm256_storeu_ps(xf + m * K + k, a);
                _mm256_storeu_ps(xf + m * K + k + 8, b);
                low = _mm256_add_ps(low, a);
                high = _mm256_add_ps(high, b);
            }
            const __m256 eight = _mm256_add_ps(high, low);
            const __m128 four = _mm_add_ps(_mm256_extractf128_ps(eight, 1), _mm256_castps256_ps128(eight));
            const __m128 two = _mm_add_ps(four, _mm_shuffle_ps(four, four, _MM_SHUFFLE(1, 0, 3, 2)));
            totals[m * groups + g] = _mm_cvtss_f32(two) + _mm_cvtss_f32(_mm_shuffle_ps(two, two, 1));
        }
}

/* call(G) for G = min(count, 8), a constant in each instance, so that the always-inline
 * function it names keeps its G rows' sums in registers (its loops' trip counts constant). */
#define BY_GROUP(count, call) \
    switch ((count) < 8 ? (count) : 8) { \
        case 1: call(1); break; case 2: call(2); break; case 3: call(3); break; case 4: call(4); break; \
        case 5: call(5); break; case 6: call(6); break; case 7: call(7); break; default: call(8); break; \
    }

/* The largest of eight float32 lanes. */
static inline float hmax(__m256 v) {
    __m128 lo = _mm_max_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    lo = _mm_max_ps(lo, _mm_movehl_ps(lo, lo));
    lo = _mm_max_ss(lo, _mm_shuffle_ps(lo, lo, 1));
    return _mm_cvtss_f32(lo);
}

/* 32 float32 values (four vectors, in order) as int8 codes round(v * inv), half to
 * even, at q: the activation codes of int8_gemm.c (a q8 row) and int4_gemm_avx2.c (a
 * q4k weight group); |v * inv| <= 127, so the saturating packs change nothing. */
static inline void int8_codes32(const __m256 *v, __m256 inv, int8_t *q) {
    const __m256i order = _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7);
    const int rounding = _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC;
    __m256i i[4];
    for (int j = 0; j < 4; ++j) i[j] = _mm256_cvtps_epi32(_mm256_round_ps(_mm256_mul_ps(v[j], inv), rounding));
    /* Saturating packs interleave 128-bit lanes; one permutation restores the order. */
    const __m256i packed = _mm256_packs_epi16(_mm256_packs_epi32(i[0], i[1]), _mm256_packs_epi32(i[2], i[3]));
    _mm256_storeu_si256((__m256i *)q, _mm256_permutevar8x32_epi32(packed, order));
}

/* The sum of eight float32 lanes. */
static inline float hsum(__m256 v) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s = _mm_add_ss(s, _mm_shuffle_ps(s, s, 1));
    return _mm_cvtss_f32(s);
}

#endif
