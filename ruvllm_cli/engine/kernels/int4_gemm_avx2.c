/* q4k linear layers on x86-64 CPUs with AVX2 and FMA (every laptop CPU since 2013;
 * those with AVX-512 take int4_gemm.c): torch's packed int4 weights as torch lays them
 * out there, times bfloat16 activations, float32 sums, bfloat16 out, any number of rows.
 *
 * The computation is int4_gemm.c's (its comment says why: each group's sums keep the
 * scale and zero out of the inner loop, so a weight costs its conversion and one FMA a
 * row) in eight-lane vectors: each output is the same operations in the same order, so
 * the two kernels give the same bits for the same weights, and a row's result is the
 * same bits alone, in a decode step of any size, or in a prompt chunk.
 *
 * torch's AVX2 layout: [N / 32, K, 16] bytes, byte j of a k holding row j of the block
 * in its low nibble and row 16 + j in its high one (engine/int4_dense.py reads it off
 * torch; callers check it is this one). A k's 16 bytes are widened into two vectors of
 * eight lanes (one shuffle each, straight from memory); a mask leaves the low nibbles,
 * rows 0-15, and another the high ones, rows 16-31, as 16 times their code: those rows'
 * scales are taken a sixteenth (exact, as the product of the sum by it), so no shift and
 * no subtraction is spent on a weight: a mask, a conversion and its FMAs. Up to two
 * rows take all four vectors in one pass straight from memory; three to six take the
 * block's two halves one after the other, a group at a time, so their sums fit the
 * sixteen registers; more rows pass up to six at a time over a float32 tile of one
 * group's codes in L1, converted once for all of them. */

#include <immintrin.h>
#include <stdint.h>
#include <string.h>
#include <omp.h>

#include "common.h"

#define BLOCK 32       /* weight rows a block (torch's AVX2 layout) */
#define MAX_GROUP 128  /* the tile holds one group: 16 KiB of float32 at most */
#define STRIP 64       /* activation rows a pass over a block's tile takes at most */
#define PASS 6         /* activation rows a pass over half the tile takes (12 sums in registers) */
#define DIRECT 6       /* rows up to which the codes go straight from memory to the FMAs */
#define AHEAD 4096     /* software prefetch distance along a block's codes, as int4_gemm.c's */
#define AHEAD_GROUPS 2 /* groups ahead whose scales `direct` fetches, as int4_gemm.c's */

typedef int64_t i64;

/* One k's codes for the block's 32 rows as float32 in four vectors: rows 0-7 and 8-15
 * (their codes), 16-23 and 24-31 (16 times theirs); `first` and `count` pick which. */
static inline __attribute__((always_inline)) void codes(const uint8_t *bytes, int first, int count, __m256 *q) {
    const __m256i a = _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)bytes));
    const __m256i b = _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)(bytes + 8)));
    for (int j = first; j < first + count; ++j) {
        const __m256i mask = _mm256_set1_epi32(j < 2 ? 0x0F : 0xF0);
        q[j - first] = _mm256_cvtepi32_ps(_mm256_and_si256(j % 2 == 0 ? a : b, mask));
    }
}

/* The scales and zeros of the block's rows [8 j, 8 j + 8), j in [first, first + count),
 * as float32 vectors (bfloat16 pairs, the scale in the low half): each zero less 8
 * scales, as int4_gemm.c's, and the scales of rows 16-31 a sixteenth (`codes`). */
static inline __attribute__((always_inline)) void group_params(const uint16_t *sz, int first, int count,
                                                               __m256 *scale, __m256 *zero) {
    const __m256i high = _mm256_set1_epi32((int)0xffff0000u);
    for (int i = 0; i < count; ++i) {
        const __m256i v = _mm256_loadu_si256((const __m256i *)(sz + 16 * (first + i)));
        const __m256 s = _mm256_castsi256_ps(_mm256_slli_epi32(v, 16));
        zero[i] = _mm256_fnmadd_ps(_mm256_set1_ps(8.0f), s, _mm256_castsi256_ps(_mm256_and_si256(v, high)));
        scale[i] = first + i < 2 ? s : _mm256_mul_ps(s, _mm256_set1_ps(0.0625f));
    }
}

/* acc += scale * sums + zero * total (two FMAs, in that order), for `count` vectors. */
static inline __attribute__((always_inline)) void add_group(float *acc, const __m256 *sums, const __m256 *scale,
                                                            const __m256 *zero, float total, int count) {
    const __m256 t = _mm256_set1_ps(total);
    for (int j = 0; j < count; ++j) {
        __m256 a = _mm256_loadu_ps(acc + 8 * j);
        a = _mm256_fmadd_ps(scale[j], sums[j], a);
        _mm256_storeu_ps(acc + 8 * j, _mm256_fmadd_ps(zero[j], t, a));
    }
}

/* One row's 32 sums of block b to bfloat16 in out (the row's), the bias added as torch
 * adds a bfloat16 bias: to the rounded sum, rounded again. */
static inline void store(const float *acc, i64 b, const uint16_t *bias, uint16_t *out) {
    for (int j = 0; j < 4; ++j) {
        __m256 sum = bf16_held8(_mm256_loadu_ps(acc + 8 * j));
        if (bias != NULL) {
            const __m128i add = _mm_loadu_si128((const __m128i *)(bias + b * BLOCK + 8 * j));
            sum = bf16_held8(_mm256_add_ps(sum, _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(add), 16))));
        }
        _mm_storeu_si128((__m128i *)(out + b * BLOCK + 8 * j), bf16_pack8(sum));
    }
}

/* R rows (1..DIRECT, a constant where inlined) against block b, the codes straight from
 * memory, each group's sums in registers: all four vectors a k for one or two rows (at
 * one row, two sums a pass would leave the FMAs waiting on each other), else a half of
 * the block at a time. The block's outputs gather in acc [R][32] (L1). */
static inline __attribute__((always_inline)) void direct(const float *xf, const float *totals, const int R, i64 K,
                                                         const uint8_t *bytes, const uint16_t *sz, i64 N, i64 group,
                                                         i64 b, const uint16_t *bias, uint16_t *out) {
    enum { WHOLE = 4, HALF = 2 };
    const int vectors = R <= 2 ? WHOLE : HALF;
    float acc[DIRECT * BLOCK] __attribute__((aligned(32)));
    memset(acc, 0, sizeof(float) * R * BLOCK);
    for (i64 g = 0; g < K / group; ++g) {
        if (g + AHEAD_GROUPS < K / group)
            for (int i = 0; i < 2; ++i)
                _mm_prefetch((const char *)(sz + (g + AHEAD_GROUPS) * N * 2 + 32 * i), _MM_HINT_T0);
        for (int part = 0; part < WHOLE / vectors; ++part) {
            __m256 sums[DIRECT][WHOLE];
            for (int r = 0; r < R; ++r)
                for (int j = 0; j < vectors; ++j) sums[r][j] = _mm256_setzero_ps();
            for (i64 k = g * group; k < (g + 1) * group; ++k) {
                if ((k & 3) == 0 && part == 0)   /* a line holds four k */
                    _mm_prefetch((const char *)(bytes + k * 16) + AHEAD, _MM_HINT_T0);
                __m256 q[WHOLE];
                codes(bytes + k * 16, vectors * part, vectors, q);
                for (int r = 0; r < R; ++r) {
                    const __m256 x = _mm256_set1_ps(xf[r * K + k]);
                    for (int j = 0; j < vectors; ++j) sums[r][j] = _mm256_fmadd_ps(x, q[j], sums[r][j]);
                }
            }
            __m256 scale[WHOLE], zero[WHOLE];
            group_params(sz + g * N * 2, vectors * part, vectors, scale, zero);
            for (int r = 0; r < R; ++r)
                add_group(acc + r * BLOCK + 8 * vectors * part, sums[r], scale, zero, totals[r * (K / group) + g],
                          vectors);
        }
    }
    for (int r = 0; r < R; ++r) store(acc + r * BLOCK, b, bias, out + r * N);
}

/* R rows (1..PASS) over half `part` of the tile of one group's codes ([count][32]
 * float32): their sums (in registers), then the group's part added into acc [R][32]. */
static inline __attribute__((always_inline)) void pass(const float *const *x, const float *const *totals, const int R,
                                                       const float *tile, i64 count, int part, const __m256 *scale,
                                                       const __m256 *zero, float *acc) {
    __m256 s[PASS][2];
    for (int r = 0; r < R; ++r) s[r][0] = s[r][1] = _mm256_setzero_ps();
    for (i64 i = 0; i < count; ++i) {
        const __m256 w0 = _mm256_load_ps(tile + i * BLOCK + 16 * part),
                     w1 = _mm256_load_ps(tile + i * BLOCK + 16 * part + 8);
        for (int r = 0; r < R; ++r) {
            const __m256 v = _mm256_set1_ps(x[r][i]);
            s[r][0] = _mm256_fmadd_ps(v, w0, s[r][0]);
            s[r][1] = _mm256_fmadd_ps(v, w1, s[r][1]);
        }
    }
    for (int r = 0; r < R; ++r) add_group(acc + r * BLOCK + 16 * part, s[r], scale + 2 * part, zero + 2 * part,
                                          *totals[r], 2);
}

/* Rows [first, first + rows) (rows <= STRIP) against block b through the tile. */
static void tiled(const float *xf, const float *totals, i64 first, i64 rows, i64 K, const uint8_t *bytes,
                  const uint16_t *sz, i64 N, i64 group, i64 b, const uint16_t *bias, uint16_t *out, float *tile,
                  float *acc) {
    const i64 groups = K / group;
    memset(acc, 0, sizeof(float) * rows * BLOCK);
    for (i64 g = 0; g < groups; ++g) {
        for (i64 i = 0; i < group; ++i) {
            const i64 k = g * group + i;
            if ((i & 3) == 0)   /* a line holds four k */
                _mm_prefetch((const char *)(bytes + k * 16) + AHEAD, _MM_HINT_T0);
            __m256 q[4];
            codes(bytes + k * 16, 0, 4, q);
            for (int j = 0; j < 4; ++j) _mm256_store_ps(tile + i * BLOCK + 8 * j, q[j]);
        }
        __m256 scale[4], zero[4];
        group_params(sz + g * N * 2, 0, 4, scale, zero);
        /* The fewest passes, as even as they go (int4_gemm.c's rule). */
        const i64 passes = (rows + PASS - 1) / PASS, step = (rows + passes - 1) / passes;
        for (int part = 0; part < 2; ++part)
            for (i64 m = 0; m < rows; m += step) {
                const int R = rows - m < step ? (int)(rows - m) : (int)step;
                const float *xs[PASS], *ts[PASS];
                for (int r = 0; r < PASS; ++r) {
                    const i64 row = first + m + (r < R ? r : 0);
                    xs[r] = xf + row * K + g * group;
                    ts[r] = totals + row * groups + g;
                }
                float *at = acc + m * BLOCK;
                switch (R) {
                    case 6: pass(xs, ts, 6, tile, group, part, scale, zero, at); break;
                    case 5: pass(xs, ts, 5, tile, group, part, scale, zero, at); break;
                    case 4: pass(xs, ts, 4, tile, group, part, scale, zero, at); break;
                    case 3: pass(xs, ts, 3, tile, group, part, scale, zero, at); break;
                    case 2: pass(xs, ts, 2, tile, group, part, scale, zero, at); break;
                    default: pass(xs, ts, 1, tile, group, part, scale, zero, at); break;
                }
            }
    }
    for (i64 m = 0; m < rows; ++m) store(acc + m * BLOCK, b, bias, out + (first + m) * N);
}

/* x [M, K] bfloat16; packed [N / 32, K, 16]; scales_and_zeros [K / group, N, 2] bfloat16;
 * bias [N] bfloat16 or NULL; out [M, N] bfloat16. N % 32 == 0, K % group == 0, group 32,
 * 64 or 128. scratch: M * K + M * (K / group) floats (the rows widened once, and each
 * row's sum over each group). */
void ruvllm_int4_linear_avx2(const uint16_t *x, i64 M, i64 K, const uint8_t *packed, i64 N,
                             const uint16_t *scales_and_zeros, i64 group, const uint16_t *bias, uint16_t *out,
                             float *scratch, int threads) {
    if (M == 0) return;
    float *xf = scratch, *totals = scratch + M * K;
    int4_widen_rows(x, M, K, group, xf, totals, threads);
    if (M <= DIRECT) {
        #pragma omp parallel for num_threads(threads) schedule(static)
        for (i64 b = 0; b < N / BLOCK; ++b) {
            const uint8_t *bytes = packed + b * BLOCK * K / 2;
            const uint16_t *sz = scales_and_zeros + b * BLOCK * 2;
            switch (M) {
                case 6: direct(xf, totals, 6, K, bytes, sz, N, group, b, bias, out); break;
                case 5: direct(xf, totals, 5, K, bytes, sz, N, group, b, bias, out); break;
                case 4: direct(xf, totals, 4, K, bytes, sz, N, group, b, bias, out); break;
                case 3: direct(xf, totals, 3, K, bytes, sz, N, group, b, bias, out); break;
                case 2: direct(xf, totals, 2, K, bytes, sz, N, group, b, bias, out); break;
                default: direct(xf, totals, 1, K, bytes, sz, N, group, b, bias, out); break;
            }
        }
        return;
    }
    #pragma omp parallel num_threads(threads)
    {
        float tile[MAX_GROUP * BLOCK] __attribute__((aligned(32)));   /* one group's codes: in L1 */
        float acc[STRIP * BLOCK] __attribute__((aligned(32)));
        #pragma omp for schedule(static) collapse(2)
        for (i64 b = 0; b < N / BLOCK; ++b)
            for (i64 s = 0; s < (M + STRIP - 1) / STRIP; ++s) {
                const i64 first = s * STRIP, rows = M - first < STRIP ? M - first : STRIP;
                tiled(xf, totals, first, rows, K, packed + b * BLOCK * K / 2, scales_and_zeros + b * BLOCK * 2, N,
                      group, b, bias, out, tile, acc);
            }
    }
}
