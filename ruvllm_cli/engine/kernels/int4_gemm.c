/* q4k linear layers for a few activation rows (decode steps), on x86-64 CPUs with
 * AVX-512: torch's packed int4 weights (`_convert_weight_to_int4pack_for_cpu`) times
 * bfloat16 activations, float32 sums, bfloat16 out.
 *
 * torch's CPU int4 kernel reads the weights once per activation row: at 16 rows a call
 * cost about 7 times one row's (docs/design.md, section 23). Here each block of 64
 * weight rows is dequantized, a chunk of k at a time, into a float32 tile in L1 (w =
 * (q - 8) * scale + zero, the kernel's own formula, one FMA a value), and every
 * activation row passes over the tile four at a time: the weights leave memory once
 * per call, their dequantization is paid once, and the FMAs are the rest.
 *
 * The packed bytes are [N / 64, K, 32]: byte j of a k holds row j of the block in its
 * low nibble and row 32 + j in its high nibble (the layout engine/int4_dense.py reads
 * off torch; callers check it is this one). scales_and_zeros: [K / group, N, 2]
 * bfloat16. Every output is summed in one order whatever the number of rows, so a
 * row's result is the same bits alone or in any batch. */

#include <immintrin.h>
#include <stdint.h>
#include <string.h>
#include <omp.h>

#include "common.h"

#define BLOCK 64   /* weight rows a block (torch's layout) */
#define CHUNK 64   /* k values dequantized into the tile at a time: 16 KiB of float32 */
#define AHEAD 2048 /* software prefetch distance along a block's bytes */
#define MAX_ROWS 64 /* activation rows a pass over a block takes: more go through it in strips */

/* Rows of x [M, K] bfloat16 as float32 in xf. */
static void widen_rows(const uint16_t *x, int64_t count, float *xf) {
    int64_t i = 0;
    for (; i + 16 <= count; i += 16) {
        const __m256i v = _mm256_loadu_si256((const __m256i *)(x + i));
        _mm512_storeu_ps(xf + i, _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(v), 16)));
    }
    for (; i < count; ++i) xf[i] = bf16_load(x[i]);
}

/* The group's 64 scales and zeros (bfloat16 pairs) as four float32 vectors each. */
static inline void group_params(const uint16_t *sz, __m512 *scale, __m512 *zero) {
    const __m512i high = _mm512_set1_epi32((int)0xffff0000u);
    for (int i = 0; i < 4; ++i) {
        const __m512i v = _mm512_loadu_si512((const void *)(sz + 32 * i));
        scale[i] = _mm512_castsi512_ps(_mm512_slli_epi32(v, 16));
        zero[i] = _mm512_castsi512_ps(_mm512_and_si512(v, high));
    }
}

/* k values [k0, k0 + count) of one block into tile [count, 64] float32. */
static void dequantize(const uint8_t *bytes, const uint16_t *sz, int64_t N, int64_t group, int64_t k0, int64_t count,
                       float *tile) {
    const __m256i nibble = _mm256_set1_epi8(0x0F), eight = _mm256_set1_epi8(8);
    __m512 scale[4], zero[4];
    group_params(sz + (k0 / group) * N * 2, scale, zero);
    for (int64_t i = 0; i < count; ++i) {
        const int64_t k = k0 + i;
        if (k % group == 0 && i > 0) group_params(sz + (k / group) * N * 2, scale, zero);
        _mm_prefetch((const char *)(bytes + k * 32) + AHEAD, _MM_HINT_T0);
        const __m256i v = _mm256_loadu_si256((const __m256i *)(bytes + k * 32));
        const __m256i lo = _mm256_sub_epi8(_mm256_and_si256(v, nibble), eight);
        const __m256i hi = _mm256_sub_epi8(_mm256_and_si256(_mm256_srli_epi16(v, 4), nibble), eight);
        const __m128i part[4] = {_mm256_castsi256_si128(lo), _mm256_extracti128_si256(lo, 1),
                                 _mm256_castsi256_si128(hi), _mm256_extracti128_si256(hi, 1)};
        for (int j = 0; j < 4; ++j) {
            const __m512 q = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(part[j]));
            _mm512_storeu_ps(tile + i * BLOCK + 16 * j, _mm512_fmadd_ps(q, scale[j], zero[j]));
        }
    }
}

/* R activation rows (1..4, a constant where inlined) over the tile's `count` k values,
 * their 64 sums each added into acc [R][64]. */
static inline __attribute__((always_inline)) void pass(const float *const *x, const int R, const float *tile,
                                                       int64_t count, float *acc) {
    __m512 a[4][4];
    for (int r = 0; r < R; ++r)
        for (int j = 0; j < 4; ++j) a[r][j] = _mm512_loadu_ps(acc + r * BLOCK + 16 * j);
    for (int64_t i = 0; i < count; ++i) {
        const __m512 w0 = _mm512_loadu_ps(tile + i * BLOCK), w1 = _mm512_loadu_ps(tile + i * BLOCK + 16),
                     w2 = _mm512_loadu_ps(tile + i * BLOCK + 32), w3 = _mm512_loadu_ps(tile + i * BLOCK + 48);
        for (int r = 0; r < R; ++r) {
            const __m512 b = _mm512_set1_ps(x[r][i]);
            a[r][0] = _mm512_fmadd_ps(b, w0, a[r][0]);
            a[r][1] = _mm512_fmadd_ps(b, w1, a[r][1]);
            a[r][2] = _mm512_fmadd_ps(b, w2, a[r][2]);
            a[r][3] = _mm512_fmadd_ps(b, w3, a[r][3]);
        }
    }
    for (int r = 0; r < R; ++r)
        for (int j = 0; j < 4; ++j) _mm512_storeu_ps(acc + r * BLOCK + 16 * j, a[r][j]);
}

/* 16 float32 sums to bfloat16, rounded to nearest even (torch's rounding; NaN stays NaN). */
static inline __m256i round16(__m512 v) {
    const __m512i u = _mm512_castps_si512(v);
    const __m512i odd = _mm512_and_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(1));
    __m512i r = _mm512_srli_epi32(_mm512_add_epi32(u, _mm512_add_epi32(odd, _mm512_set1_epi32(0x7fff))), 16);
    const __mmask16 nan = _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q);
    r = _mm512_mask_or_epi32(r, nan, _mm512_srli_epi32(u, 16), _mm512_set1_epi32(0x40));
    return _mm512_cvtepi32_epi16(r);
}

/* A block's sums for `rows` rows (acc [rows][64]) to bfloat16 in out [rows, N]. */
static void store(const float *acc, int64_t rows, int64_t N, int64_t b, const uint16_t *bias, uint16_t *out) {
    for (int64_t m = 0; m < rows; ++m)
        for (int j = 0; j < 4; ++j) {
            __m512 sum = _mm512_loadu_ps(acc + m * BLOCK + 16 * j);
            if (bias != NULL) {
                const __m256i rounded = round16(sum);
                const __m256i add = _mm256_loadu_si256((const __m256i *)(bias + b * BLOCK + 16 * j));
                sum = _mm512_add_ps(_mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(rounded), 16)),
                                    _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(add), 16)));
            }
            _mm256_storeu_si256((__m256i *)(out + m * N + b * BLOCK + 16 * j), round16(sum));
        }
}

/* x [M, K] bfloat16; packed [N / 64, K, 32]; scales_and_zeros [K / group,
 * N, 2] bfloat16; bias [N] bfloat16 or NULL (added as torch adds a bfloat16 bias: to the
 * rounded sum, rounded again); out [M, N] bfloat16. N % 64 == 0, K % group == 0,
 * group % 32 == 0. scratch: M * K floats (the rows widened once). */
void ruvllm_int4_linear(const uint16_t *x, int64_t M, int64_t K, const uint8_t *packed, int64_t N,
                        const uint16_t *scales_and_zeros, int64_t group, const uint16_t *bias, uint16_t *out,
                        float *scratch, int threads) {
    float *xf = scratch;
    widen_rows(x, M * K, xf);
    #pragma omp parallel num_threads(threads)
    {
        float tile[CHUNK * BLOCK] __attribute__((aligned(64)));   /* in L1: 16 KiB */
        float acc[MAX_ROWS * BLOCK] __attribute__((aligned(64)));
        #pragma omp for schedule(static) collapse(2)
        for (int64_t b = 0; b < N / BLOCK; ++b) {
            for (int64_t s = 0; s < (M + MAX_ROWS - 1) / MAX_ROWS; ++s) {
                const uint8_t *bytes = packed + b * BLOCK * K / 2;
                const uint16_t *sz = scales_and_zeros + b * BLOCK * 2;
                const int64_t first = s * MAX_ROWS, rows = M - first < MAX_ROWS ? M - first : MAX_ROWS;
                memset(acc, 0, sizeof(float) * rows * BLOCK);
                for (int64_t k0 = 0; k0 < K; k0 += CHUNK) {
                    const int64_t count = K - k0 < CHUNK ? K - k0 : CHUNK;
                    dequantize(bytes, sz, N, group, k0, count, tile);
                    for (int64_t m = 0; m < rows; m += 4) {
                        const int R = rows - m < 4 ? (int)(rows - m) : 4;
                        const float *xs[4];
                        for (int r = 0; r < 4; ++r) xs[r] = xf + (first + m + (r < R ? r : 0)) * K + k0;
                        switch (R) {
                            case 4: pass(xs, 4, tile, count, acc + m * BLOCK); break;
                            case 3: pass(xs, 3, tile, count, acc + m * BLOCK); break;
                            case 2: pass(xs, 2, tile, count, acc + m * BLOCK); break;
                            default: pass(xs, 1, tile, count, acc + m * BLOCK); break;
                        }
                    }
                }
                store(acc, rows, N, b, bias, out + first * N);
            }
        }
    }
}
