/* q4k linear layers on x86-64 CPUs with AVX-512: torch's packed int4 weights
 * (`_convert_weight_to_int4pack_for_cpu`) times bfloat16 activations, float32 sums,
 * bfloat16 out, for any number of rows.
 *
 * torch's CPU int4 kernel dequantizes every weight (w = (q - 8) * scale + zero) once per
 * activation row: one row of a whole model read its weights at about 12 GB/s here, and
 * 16 rows cost 7 times one (docs/design.md, section 23). Here each group's sum leaves
 * the scale and zero out of the inner loop:
 *
 *     out[n] = sum over groups g of  scale[n,g] * (sum over k in g of x[k] * q[n,k])
 *                                  + (zero[n,g] - 8 * scale[n,g]) * (sum over k in g of x[k])
 *
 * so a weight costs its conversion to float32 (a table lookup) and one FMA a row (the
 * codes as they are, 0 to 15). Up to
 * six rows take the codes straight from memory, prefetched ahead, into their sums in
 * registers (`direct`); more pass up to six at a time over a float32 tile of one group's
 * codes in L1 (`tiled`), so the codes are converted once for all of them. Both compute
 * each row with the same operations in the same order, so a row's result is the same
 * bits alone, in a decode step of any size, or in a prompt chunk.
 *
 * The packed bytes are [N / 64, K, 32]: byte j of a k holds row j of the block in its
 * low nibble and row 32 + j in its high nibble (the layout engine/int4_dense.py reads
 * off torch; callers check it is this one). scales_and_zeros: [K / group, N, 2]
 * bfloat16; group 32, 64 or 128. */

#include <immintrin.h>
#include <stdint.h>
#include <string.h>
#include <omp.h>

#include "common.h"

#define BLOCK 64       /* weight rows a block (torch's layout) */
#define MAX_GROUP 128  /* the tile holds one group: 32 KiB of float32 at most */
#define STRIP 64       /* activation rows a pass over a block's tile takes at most */
#define PASS 6         /* activation rows a pass over the tile takes (24 sums in registers) */
#define DIRECT 6       /* rows up to which the codes go straight from memory to the FMAs (24 sums) */
#define AHEAD 4096     /* software prefetch distance along a block's codes: one row of a whole model's
                          layers 1.4x faster with it than without (1,024: 1.2x; 8,192 as 4,096) */
#define AHEAD_GROUPS 2 /* groups ahead whose scales `direct` fetches: a group's sit N * 4 bytes after
                          the last's (a tied head's 1.5x faster than without, one row) */

/* The codes of one k for the block's 64 rows as float32 in four vectors (rows
 * 0-15, 16-31, 32-47, 48-63): each byte widened to a lane, whose low four bits pick the
 * value out of a 16-entry table (vpermps reads only those bits); the high nibble the same
 * after a shift. */
static inline __attribute__((always_inline)) void codes(const uint8_t *bytes, __m512 table, __m512 *q) {
    const __m512i first = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)bytes));
    const __m512i second = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)(bytes + 16)));
    q[0] = _mm512_permutexvar_ps(first, table);
    q[1] = _mm512_permutexvar_ps(second, table);
    q[2] = _mm512_permutexvar_ps(_mm512_srli_epi32(first, 4), table);
    q[3] = _mm512_permutexvar_ps(_mm512_srli_epi32(second, 4), table);
}

/* The group's 64 scales and zeros (bfloat16 pairs) as four float32 vectors each, each
 * zero less 8 scales (one rounding: the codes are taken as 0 to 15). */
static inline __attribute__((always_inline)) void group_params(const uint16_t *sz, __m512 *scale, __m512 *zero) {
    const __m512i high = _mm512_set1_epi32((int)0xffff0000u);
    for (int i = 0; i < 4; ++i) {
        const __m512i v = _mm512_loadu_si512((const void *)(sz + 32 * i));
        scale[i] = _mm512_castsi512_ps(_mm512_slli_epi32(v, 16));
        zero[i] = _mm512_fnmadd_ps(_mm512_set1_ps(8.0f), scale[i], _mm512_castsi512_ps(_mm512_and_si512(v, high)));
    }
}

/* acc += scale * sums + zero * total (two FMAs, in that order): the group's part of a
 * row's 64 outputs, acc [64] float32 (64-byte aligned). */
static inline __attribute__((always_inline)) void add_group(float *acc, const __m512 *sums, const __m512 *scale,
                                                            const __m512 *zero, float total) {
    const __m512 t = _mm512_set1_ps(total);
    for (int j = 0; j < 4; ++j) {
        __m512 a = _mm512_load_ps(acc + 16 * j);
        a = _mm512_fmadd_ps(scale[j], sums[j], a);
        _mm512_store_ps(acc + 16 * j, _mm512_fmadd_ps(zero[j], t, a));
    }
}

/* One row's 64 sums of block b (acc [64], 64-byte aligned) to bfloat16 in out (the
 * row's), the bias added as torch adds a bfloat16 bias: to the rounded sum, rounded again. */
static inline void store(const float *acc, int64_t b, const uint16_t *bias, uint16_t *out) {
    for (int j = 0; j < 4; ++j) {
        __m512 sum = bf16_held16(_mm512_load_ps(acc + 16 * j));
        if (bias != NULL) {
            const __m256i add = _mm256_loadu_si256((const __m256i *)(bias + b * BLOCK + 16 * j));
            const __m512 widened = _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(add), 16));
            sum = bf16_held16(_mm512_add_ps(sum, widened));
        }
        _mm256_storeu_si256((__m256i *)(out + b * BLOCK + 16 * j), bf16_pack16(sum));
    }
}

/* R rows (1..DIRECT, a constant where inlined) against block b: each group's sums in
 * registers while the codes stream by, the block's outputs in acc [R][64] (L1). */
static inline __attribute__((always_inline)) void direct(const float *xf, const float *totals, const int R, int64_t K,
                                                         const uint8_t *bytes, const uint16_t *sz, int64_t N,
                                                         int64_t group, int64_t b, const uint16_t *bias,
                                                         uint16_t *out, __m512 table) {
    float acc[DIRECT * BLOCK] __attribute__((aligned(64)));
    memset(acc, 0, sizeof(float) * R * BLOCK);
    for (int64_t g = 0; g < K / group; ++g) {
        __m512 sums[DIRECT][4];
        for (int r = 0; r < R; ++r)
            for (int j = 0; j < 4; ++j) sums[r][j] = _mm512_setzero_ps();
        if (g + AHEAD_GROUPS < K / group)
            for (int i = 0; i < 4; ++i)
                _mm_prefetch((const char *)(sz + (g + AHEAD_GROUPS) * N * 2 + 32 * i), _MM_HINT_T0);
        for (int64_t k = g * group; k < (g + 1) * group; ++k) {
            __m512 q[4];
            if ((k & 1) == 0)   /* a line holds two k */
                _mm_prefetch((const char *)(bytes + k * 32) + AHEAD, _MM_HINT_T0);
            codes(bytes + k * 32, table, q);
            for (int r = 0; r < R; ++r) {
                const __m512 x = _mm512_set1_ps(xf[r * K + k]);
                for (int j = 0; j < 4; ++j) sums[r][j] = _mm512_fmadd_ps(x, q[j], sums[r][j]);
            }
        }
        __m512 scale[4], zero[4];
        group_params(sz + g * N * 2, scale, zero);
        for (int r = 0; r < R; ++r) add_group(acc + r * BLOCK, sums[r], scale, zero, totals[r * (K / group) + g]);
    }
    for (int r = 0; r < R; ++r) store(acc + r * BLOCK, b, bias, out + r * N);
}

/* R rows (1..PASS) over the tile of one group's codes ([count][64] float32): their sums
 * (in registers), then the group's part added into acc [R][64]. */
static inline __attribute__((always_inline)) void pass(const float *const *x, const float *const *totals, const int R,
                                                       const float *tile, int64_t count, const __m512 *scale,
                                                       const __m512 *zero, float *acc) {
    __m512 s[PASS][4];
    for (int r = 0; r < R; ++r)
        for (int j = 0; j < 4; ++j) s[r][j] = _mm512_setzero_ps();
    for (int64_t i = 0; i < count; ++i) {
        const __m512 w0 = _mm512_load_ps(tile + i * BLOCK), w1 = _mm512_load_ps(tile + i * BLOCK + 16),
                     w2 = _mm512_load_ps(tile + i * BLOCK + 32), w3 = _mm512_load_ps(tile + i * BLOCK + 48);
        for (int r = 0; r < R; ++r) {
            const __m512 b = _mm512_set1_ps(x[r][i]);
            s[r][0] = _mm512_fmadd_ps(b, w0, s[r][0]);
            s[r][1] = _mm512_fmadd_ps(b, w1, s[r][1]);
            s[r][2] = _mm512_fmadd_ps(b, w2, s[r][2]);
            s[r][3] = _mm512_fmadd_ps(b, w3, s[r][3]);
        }
    }
    for (int r = 0; r < R; ++r) add_group(acc + r * BLOCK, s[r], scale, zero, *totals[r]);
}

/* Rows [first, first + rows) (rows <= STRIP) against block b through the tile. */
static void tiled(const float *xf, const float *totals, int64_t first, int64_t rows, int64_t K, const uint8_t *bytes,
                  const uint16_t *sz, int64_t N, int64_t group, int64_t b, const uint16_t *bias, uint16_t *out,
                  __m512 table, float *tile, float *acc) {
    const int64_t groups = K / group;
    memset(acc, 0, sizeof(float) * rows * BLOCK);
    for (int64_t g = 0; g < groups; ++g) {
        for (int64_t i = 0; i < group; ++i) {
            __m512 q[4];
            if ((i & 1) == 0)   /* a line holds two k */
                _mm_prefetch((const char *)(bytes + (g * group + i) * 32) + AHEAD, _MM_HINT_T0);
            codes(bytes + (g * group + i) * 32, table, q);
            for (int j = 0; j < 4; ++j) _mm512_store_ps(tile + i * BLOCK + 16 * j, q[j]);
        }
        __m512 scale[4], zero[4];
        group_params(sz + g * N * 2, scale, zero);
        /* The fewest passes, as even as they go: 8 rows as 4 + 4 (6 + 2 was slower), 16 as 6 + 6 + 4. */
        const int64_t passes = (rows + PASS - 1) / PASS, step = (rows + passes - 1) / passes;
        for (int64_t m = 0; m < rows; m += step) {
            const int R = rows - m < step ? (int)(rows - m) : (int)step;
            const float *xs[PASS], *ts[PASS];
            for (int r = 0; r < PASS; ++r) {
                const int64_t row = first + m + (r < R ? r : 0);
                xs[r] = xf + row * K + g * group;
                ts[r] = totals + row * groups + g;
            }
            switch (R) {
                case 6: pass(xs, ts, 6, tile, group, scale, zero, acc + m * BLOCK); break;
                case 5: pass(xs, ts, 5, tile, group, scale, zero, acc + m * BLOCK); break;
                case 4: pass(xs, ts, 4, tile, group, scale, zero, acc + m * BLOCK); break;
                case 3: pass(xs, ts, 3, tile, group, scale, zero, acc + m * BLOCK); break;
                case 2: pass(xs, ts, 2, tile, group, scale, zero, acc + m * BLOCK); break;
                default: pass(xs, ts, 1, tile, group, scale, zero, acc + m * BLOCK); break;
            }
        }
    }
    for (int64_t m = 0; m < rows; ++m) store(acc + m * BLOCK, b, bias, out + (first + m) * N);
}

/* x [M, K] bfloat16; packed [N / 64, K, 32]; scales_and_zeros [K / group, N, 2] bfloat16;
 * bias [N] bfloat16 or NULL; out [M, N] bfloat16. N % 64 == 0, K % group == 0, group
 * 32, 64 or 128. scratch: M * K + M * (K / group) floats (the rows widened once, and
 * each row's sum over each group). */
void ruvllm_int4_linear(const uint16_t *x, int64_t M, int64_t K, const uint8_t *packed, int64_t N,
                        const uint16_t *scales_and_zeros, int64_t group, const uint16_t *bias, uint16_t *out,
                        float *scratch, int threads) {
    if (M == 0) return;
    float *xf = scratch, *totals = scratch + M * K;
    int4_widen_rows(x, M, K, group, xf, totals, threads);
    const __m512 table = _mm512_setr_ps(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
    if (M <= DIRECT) {
        #pragma omp parallel for num_threads(threads) schedule(static)
        for (int64_t b = 0; b < N / BLOCK; ++b) {
            const uint8_t *bytes = packed + b * BLOCK * K / 2;
            const uint16_t *sz = scales_and_zeros + b * BLOCK * 2;
            switch (M) {
                case 6: direct(xf, totals, 6, K, bytes, sz, N, group, b, bias, out, table); break;
                case 5: direct(xf, totals, 5, K, bytes, sz, N, group, b, bias, out, table); break;
                case 4: direct(xf, totals, 4, K, bytes, sz, N, group, b, bias, out, table); break;
                case 3: direct(xf, totals, 3, K, bytes, sz, N, group, b, bias, out, table); break;
                case 2: direct(xf, totals, 2, K, bytes, sz, N, group, b, bias, out, table); break;
                default: direct(xf, totals, 1, K, bytes, sz, N, group, b, bias, out, table); break;
            }
        }
        return;
    }
    #pragma omp parallel num_threads(threads)
    {
        float tile[MAX_GROUP * BLOCK] __attribute__((aligned(64)));   /* one group's codes: in L1 */
        float acc[STRIP * BLOCK] __attribute__((aligned(64)));
        #pragma omp for schedule(static) collapse(2)
        for (int64_t b = 0; b < N / BLOCK; ++b)
            for (int64_t s = 0; s < (M + STRIP - 1) / STRIP; ++s) {
                const int64_t first = s * STRIP, rows = M - first < STRIP ? M - first : STRIP;
                tiled(xf, totals, first, rows, K, packed + b * BLOCK * K / 2, scales_and_zeros + b * BLOCK * 2, N,
                      group, b, bias, out, table, tile, acc);
            }
    }
}
