/* q4k linear layers on x86-64 CPUs with AVX2 and FMA (every laptop CPU since 2013;
 * those with AVX-512 take int4_gemm.c): torch's packed int4 weights as torch lays them
 * out there, times bfloat16 activations quantized to int8, exact int32 sums, bfloat16
 * out, any number of rows.
 *
 * Each activation row is quantized per weight group, symmetrically (dx = absmax / 127,
 * codes -127..127, as int8_gemm.c quantizes a q8 row, here a group at a time), and the
 * codes' products with the weights' 4-bit codes are summed exactly in integers
 * (`vpmaddubsw`: 32 products a vector, pairs summed in int16; eight such sums at most
 * before they are widened to int32, so none saturates: 8 * 2 * 15 * 127 < 2^15). A group
 * then adds to each output, in float32:
 *
 *     acc = fma(scale * dx, float(sum over k of q[n,k] * xq[k]), acc)
 *     acc = fma(zero - 8 * scale, sum over k of x[k], acc)
 *
 * (torch's weight is (q - 8) * scale + zero). The integers are exact in any order, and
 * each row's float operations are the same whatever else is in the call, so a row's
 * result is the same bits alone, in a decode step of any size, or in a prompt chunk.
 * Float32 activations (the kernel before this one, and int4_gemm.c on AVX-512) cost a
 * conversion and an FMA a weight a row, and one row was bound by that arithmetic here
 * (design.md, section 23); this costs about a sixth of an instruction a weight, as
 * llama.cpp's Q4_K x Q8_K does.
 *
 * torch's AVX2 layout: [N / 32, K, 16] bytes, byte j of a k holding row j of the block
 * in its low nibble and row 16 + j in its high one (engine/int4_dense.py reads it off
 * torch; callers check it is this one). Four k's (64 bytes, two vectors: k, k+1 and k+2,
 * k+3) become four vectors of byte pairs: rows 0-7, 8-15 (low nibbles), 16-23, 24-31
 * (high), each row's codes at k and k+2 in the low 128-bit lane and at k+1 and k+3 in
 * the high one; the activation vector holds (x[k], x[k+2]) eight times in its low lane and
 * (x[k+1], x[k+3]) in its high one, and a flush adds the two lanes. Up to six rows take
 * the codes straight from memory (one row all four vectors in a pass, more a half of the
 * block at a time); more rows pass two at a time over a tile of one group's unpacked
 * pairs in L1, all 32 weight rows a pass.
 *
 * The int16 sums are pinned in registers (an empty asm naming each after its add): GCC
 * otherwise unrolled the eight steps of a flush, took every product first and spilled
 * them to the stack to add in a tree, which cost prefill a fifth of its time (design.md,
 * section 23). */

#include <immintrin.h>
#include <stdint.h>
#include <string.h>
#include <omp.h>

#include "common.h"

#define BLOCK 32       /* weight rows a block (torch's AVX2 layout) */
#define MAX_GROUP 128  /* the tile holds one group: 4 KiB of byte pairs at most */
#define STRIP 64       /* activation rows a pass over a block's tile takes at most */
#define PASS 2         /* activation rows a pass over the tile takes (8 int16 sums, 4 code vectors and
                          the partner in registers; three rows over half the tile ran 1.1x slower) */
#define DIRECT 6       /* rows up to which the codes go straight from memory to the products */
#define FLUSH 32       /* k's between widenings of the int16 sums (eight steps of four) */
#define AHEAD 4096     /* software prefetch distance along a block's codes, as int4_gemm.c's */
#define AHEAD_GROUPS 2 /* groups ahead whose scales `direct` fetches, as int4_gemm.c's */

typedef int64_t i64;

/* The byte pairs of four k's codes (at `bytes`, 64 of them): vectors `first` to
 * `first + count - 1` of rows 0-7, 8-15, 16-23, 24-31. */
static inline __attribute__((always_inline)) void pairs(const uint8_t *bytes, int first, int count, __m256i *p) {
    const __m256i nibble = _mm256_set1_epi8(0x0F);
    const __m256i a = _mm256_loadu_si256((const __m256i *)bytes), b = _mm256_loadu_si256((const __m256i *)(bytes + 32));
    for (int j = first; j < first + count; ++j) {
        const __m256i x = j < 2 ? _mm256_and_si256(a, nibble) : _mm256_and_si256(_mm256_srli_epi16(a, 4), nibble);
        const __m256i y = j < 2 ? _mm256_and_si256(b, nibble) : _mm256_and_si256(_mm256_srli_epi16(b, 4), nibble);
        p[j - first] = j % 2 == 0 ? _mm256_unpacklo_epi8(x, y) : _mm256_unpackhi_epi8(x, y);
    }
}

/* The activation codes of four k's (at xq + k) as the pairs' partner: (x[k], x[k+2])
 * eight times in the low lane, (x[k+1], x[k+3]) in the high one. */
static inline __attribute__((always_inline)) __m256i partner(const int8_t *xq) {
    const __m256i order = _mm256_setr_epi8(0, 2, 0, 2, 0, 2, 0, 2, 0, 2, 0, 2, 0, 2, 0, 2,
                                           1, 3, 1, 3, 1, 3, 1, 3, 1, 3, 1, 3, 1, 3, 1, 3);
    int32_t four;
    memcpy(&four, xq, 4);
    return _mm256_shuffle_epi8(_mm256_set1_epi32(four), order);
}

/* An int16 sum's two lanes (the same eight rows) added into the int32 sums. */
static inline __attribute__((always_inline)) __m256i widen(__m256i sum16, __m256i sum32) {
    const __m256i low = _mm256_cvtepi16_epi32(_mm256_castsi256_si128(sum16));
    const __m256i high = _mm256_cvtepi16_epi32(_mm256_extracti128_si256(sum16, 1));
    return _mm256_add_epi32(sum32, _mm256_add_epi32(low, high));
}

/* The scales and zeros of the block's rows [8 j, 8 j + 8), j in [first, first + count),
 * as float32 vectors (bfloat16 pairs, the scale in the low half), each zero less 8 scales. */
static inline __attribute__((always_inline)) void group_params(const uint16_t *sz, int first, int count,
                                                               __m256 *scale, __m256 *zero) {
    const __m256i high = _mm256_set1_epi32((int)0xffff0000u);
    for (int i = 0; i < count; ++i) {
        const __m256i v = _mm256_loadu_si256((const __m256i *)(sz + 16 * (first + i)));
        const __m256 s = _mm256_castsi256_ps(_mm256_slli_epi32(v, 16));
        zero[i] = _mm256_fnmadd_ps(_mm256_set1_ps(8.0f), s, _mm256_castsi256_ps(_mm256_and_si256(v, high)));
        scale[i] = s;
    }
}

/* acc = fma(scale * dx, float(sums), acc), then fma(zero, total, acc), for `count` vectors. */
static inline __attribute__((always_inline)) void add_group(float *acc, const __m256i *sums, const __m256 *scale,
                                                            const __m256 *zero, float dx, float total, int count) {
    const __m256 d = _mm256_set1_ps(dx), t = _mm256_set1_ps(total);
    for (int j = 0; j < count; ++j) {
        __m256 a = _mm256_loadu_ps(acc + 8 * j);
        a = _mm256_fmadd_ps(_mm256_mul_ps(scale[j], d), _mm256_cvtepi32_ps(sums[j]), a);
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

/* The quantized rows: xq [M, K] codes, and per row and group dx (the scale) and the sum
 * of the bfloat16 values, in scratch (floats first: M * groups each, then the codes). */
typedef struct {
    const int8_t *xq;
    const float *dx, *totals;
} Rows;

/* R rows (1..DIRECT, a constant where inlined) against block b, the codes straight from
 * memory, each group's sums in registers: all four vectors at one row, else a half of
 * the block at a time. The block's outputs gather in acc [R][32] (L1). */
static inline __attribute__((always_inline)) void direct(Rows x, const int R, i64 K, const uint8_t *bytes,
                                                         const uint16_t *sz, i64 N, i64 group, i64 b,
                                                         const uint16_t *bias, uint16_t *out) {
    enum { WHOLE = 4, HALF = 2 };
    const int vectors = R == 1 ? WHOLE : HALF;
    const i64 groups = K / group;
    float acc[DIRECT * BLOCK] __attribute__((aligned(32)));
    memset(acc, 0, sizeof(float) * R * BLOCK);
    for (i64 g = 0; g < groups; ++g) {
        if (g + AHEAD_GROUPS < groups)
            for (int i = 0; i < 2; ++i)
                _mm_prefetch((const char *)(sz + (g + AHEAD_GROUPS) * N * 2 + 32 * i), _MM_HINT_T0);
        for (int part = 0; part < WHOLE / vectors; ++part) {
            __m256i sums[DIRECT][WHOLE];
            for (int r = 0; r < R; ++r)
                for (int j = 0; j < vectors; ++j) sums[r][j] = _mm256_setzero_si256();
            for (i64 f = g * group; f < (g + 1) * group; f += FLUSH) {
                __m256i s16[DIRECT][WHOLE];
                for (int r = 0; r < R; ++r)
                    for (int j = 0; j < vectors; ++j) s16[r][j] = _mm256_setzero_si256();
                for (i64 k = f; k < f + FLUSH; k += 4) {
                    if (part == 0)   /* a line holds four k */
                        _mm_prefetch((const char *)(bytes + k * 16) + AHEAD, _MM_HINT_T0);
                    __m256i p[WHOLE];
                    pairs(bytes + k * 16, vectors * part, vectors, p);
                    for (int r = 0; r < R; ++r) {
                        const __m256i xv = partner(x.xq + r * K + k);
                        for (int j = 0; j < vectors; ++j) {
                            s16[r][j] = _mm256_add_epi16(s16[r][j], _mm256_maddubs_epi16(p[j], xv));
                            __asm__("" : "+x"(s16[r][j]));   /* in a register, added in this order */
                        }
                    }
                }
                for (int r = 0; r < R; ++r)
                    for (int j = 0; j < vectors; ++j) sums[r][j] = widen(s16[r][j], sums[r][j]);
            }
            __m256 scale[WHOLE], zero[WHOLE];
            group_params(sz + g * N * 2, vectors * part, vectors, scale, zero);
            for (int r = 0; r < R; ++r)
                add_group(acc + r * BLOCK + 8 * vectors * part, sums[r], scale, zero, x.dx[r * groups + g],
                          x.totals[r * groups + g], vectors);
        }
    }
    for (int r = 0; r < R; ++r) store(acc + r * BLOCK, b, bias, out + r * N);
}

/* R rows (1..PASS) over the tile of one group's pairs ([count / 4][4] vectors): their
 * sums (in registers), then the group added into acc [R][32]. */
static inline __attribute__((always_inline)) void pass(const int8_t *const *xq, const float *dx,
                                                       const float *totals, const int R, const __m256i *tile,
                                                       i64 count, const __m256 *scale, const __m256 *zero,
                                                       float *acc) {
    __m256i sums[PASS][4];
    for (int r = 0; r < R; ++r)
        for (int j = 0; j < 4; ++j) sums[r][j] = _mm256_setzero_si256();
    for (i64 f = 0; f < count; f += FLUSH) {
        __m256i s[PASS][4];
        for (int r = 0; r < R; ++r)
            for (int j = 0; j < 4; ++j) s[r][j] = _mm256_setzero_si256();
        #pragma GCC unroll 8   /* the flush's eight steps whole */
        for (i64 i = f; i < f + FLUSH; i += 4) {
            __m256i w[4];
            for (int j = 0; j < 4; ++j) w[j] = _mm256_load_si256(tile + i + j);
            for (int r = 0; r < R; ++r) {
                const __m256i v = partner(xq[r] + i);
                for (int j = 0; j < 4; ++j) {
                    s[r][j] = _mm256_add_epi16(s[r][j], _mm256_maddubs_epi16(w[j], v));
                    __asm__("" : "+x"(s[r][j]));   /* in a register, added in this order */
                }
            }
        }
        for (int r = 0; r < R; ++r)
            for (int j = 0; j < 4; ++j) sums[r][j] = widen(s[r][j], sums[r][j]);
    }
    for (int r = 0; r < R; ++r) add_group(acc + r * BLOCK, sums[r], scale, zero, dx[r], totals[r], 4);
}

/* Rows [first, first + rows) (rows <= STRIP) against block b through the tile. */
static void tiled(Rows x, i64 first, i64 rows, i64 K, const uint8_t *bytes, const uint16_t *sz, i64 N, i64 group,
                  i64 b, const uint16_t *bias, uint16_t *out, __m256i *tile, float *acc) {
    const i64 groups = K / group;
    memset(acc, 0, sizeof(float) * rows * BLOCK);
    for (i64 g = 0; g < groups; ++g) {
        for (i64 i = 0; i < group; i += 4) {
            const i64 k = g * group + i;
            _mm_prefetch((const char *)(bytes + k * 16) + AHEAD, _MM_HINT_T0);
            pairs(bytes + k * 16, 0, 4, tile + i);   /* tile[i .. i + 3]: four k's four vectors */
        }
        __m256 scale[4], zero[4];
        group_params(sz + g * N * 2, 0, 4, scale, zero);
        /* The fewest passes, as even as they go (int4_gemm.c's rule). */
        const i64 passes = (rows + PASS - 1) / PASS, step = (rows + passes - 1) / passes;
        for (i64 m = 0; m < rows; m += step) {
            const int R = rows - m < step ? (int)(rows - m) : (int)step;
            const int8_t *xs[PASS];
            float ds[PASS], ts[PASS];
            for (int r = 0; r < PASS; ++r) {
                const i64 row = first + m + (r < R ? r : 0);
                xs[r] = x.xq + row * K + g * group;
                ds[r] = x.dx[row * groups + g];
                ts[r] = x.totals[row * groups + g];
            }
            if (R == PASS) pass(xs, ds, ts, PASS, tile, group, scale, zero, acc + m * BLOCK);
            else pass(xs, ds, ts, 1, tile, group, scale, zero, acc + m * BLOCK);
        }
    }
    for (i64 m = 0; m < rows; ++m) store(acc + m * BLOCK, b, bias, out + (first + m) * N);
}

/* One group of a row (n values, a multiple of 32): its codes, scale and sum. */
static void quantize_group(const uint16_t *x, i64 n, int8_t *q, float *dx, float *total) {
    const __m256 sign_bit = _mm256_set1_ps(-0.0f);
    __m256 m = _mm256_setzero_ps(), low = _mm256_setzero_ps(), high = _mm256_setzero_ps();
    for (i64 k = 0; k < n; k += 16) {
        const __m256i raw = _mm256_loadu_si256((const __m256i *)(x + k));
        const __m256 a = _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(_mm256_castsi256_si128(raw)), 16));
        const __m256 c = _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(_mm256_extracti128_si256(raw, 1)), 16));
        m = _mm256_max_ps(m, _mm256_max_ps(_mm256_andnot_ps(sign_bit, a), _mm256_andnot_ps(sign_bit, c)));
        low = _mm256_add_ps(low, a);
        high = _mm256_add_ps(high, c);
    }
    const float amax = hmax(m);
    *dx = amax / 127.0f;
    *total = hsum(_mm256_add_ps(high, low));
    const __m256 inv = _mm256_set1_ps(amax > 0.0f ? 127.0f / amax : 0.0f);
    for (i64 k = 0; k < n; k += 32) {
        __m256 v[4];
        for (int j = 0; j < 4; ++j)
            v[j] = _mm256_castsi256_ps(_mm256_slli_epi32(
                _mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i *)(x + k + 8 * j))), 16));
        int8_codes32(v, inv, q + k);
    }
}

/* x [M, K] bfloat16; packed [N / 32, K, 16]; scales_and_zeros [K / group, N, 2] bfloat16;
 * bias [N] bfloat16 or NULL; out [M, N] bfloat16. N % 32 == 0, K % group == 0, group 32,
 * 64 or 128. scratch: M * K + M * (K / group) floats (int4_dense.scratch_floats; this
 * kernel takes 2 * M * (K / group) floats and M * K bytes of it). */
void ruvllm_int4_linear_avx2(const uint16_t *x, i64 M, i64 K, const uint8_t *packed, i64 N,
                             const uint16_t *scales_and_zeros, i64 group, const uint16_t *bias, uint16_t *out,
                             float *scratch, int threads) {
    if (M == 0) return;
    const i64 groups = K / group;
    float *dx = scratch, *totals = scratch + M * groups;
    int8_t *xq = (int8_t *)(scratch + 2 * M * groups);
    #pragma omp parallel for num_threads(threads) schedule(static) if (M * K >= 32768)
    for (i64 m = 0; m < M; ++m)
        for (i64 g = 0; g < groups; ++g)
            quantize_group(x + m * K + g * group, group, xq + m * K + g * group, dx + m * groups + g,
                           totals + m * groups + g);
    const Rows rows = {xq, dx, totals};
    if (M <= DIRECT) {
        #pragma omp parallel for num_threads(threads) schedule(static)
        for (i64 b = 0; b < N / BLOCK; ++b) {
            const uint8_t *bytes = packed + b * BLOCK * K / 2;
            const uint16_t *sz = scales_and_zeros + b * BLOCK * 2;
            switch (M) {
                case 6: direct(rows, 6, K, bytes, sz, N, group, b, bias, out); break;
                case 5: direct(rows, 5, K, bytes, sz, N, group, b, bias, out); break;
                case 4: direct(rows, 4, K, bytes, sz, N, group, b, bias, out); break;
                case 3: direct(rows, 3, K, bytes, sz, N, group, b, bias, out); break;
                case 2: direct(rows, 2, K, bytes, sz, N, group, b, bias, out); break;
                default: direct(rows, 1, K, bytes, sz, N, group, b, bias, out); break;
            }
        }
        return;
    }
    #pragma omp parallel num_threads(threads)
    {
        __m256i tile[MAX_GROUP] __attribute__((aligned(32)));   /* one group's pairs: 4 KiB, in L1 */
        float acc[STRIP * BLOCK] __attribute__((aligned(32)));
        #pragma omp for schedule(static) collapse(2)
        for (i64 b = 0; b < N / BLOCK; ++b)
            for (i64 s = 0; s < (M + STRIP - 1) / STRIP; ++s) {
                const i64 first = s * STRIP, count = M - first < STRIP ? M - first : STRIP;
                tiled(rows, first, count, K, packed + b * BLOCK * K / 2, scales_and_zeros + b * BLOCK * 2, N, group,
                      b, bias, out, tile, acc);
            }
    }
}
