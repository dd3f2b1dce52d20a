/* torch's packed int4 weights (`_convert_weight_to_int4pack_for_cpu`) unpacked to
 * float32 rows, for prompt chunks run through a float32 GEMM (engine/int4_dense.py).
 *
 * The packed bytes are [N / block, K, block / 2]: byte j of a k holds row low[j] of the
 * block in its low nibble and row high[j] in its high nibble (the layout is read off
 * torch at run time, since it follows the CPU capability torch dispatched to). Each
 * value becomes (q - 8) * scale + zero with the group's bfloat16 scale and zero, the
 * kernel's own formula. */

#include <math.h>
#include <stdint.h>
#include <string.h>
#include <omp.h>

#include "common.h"

/* Rows [start, start + rows) of an [N, K] weight (start and rows multiples of block)
 * into out [rows, K]; scales_and_zeros: [K / group, N, 2] bfloat16. Each output row is
 * written in order along k (its bytes read at a stride of block / 2, from L1 or L2):
 * writing the block's rows column by column cost 1.5-1.9 ns a value here. */
void ruvllm_int4_unpack(const uint8_t *packed, int64_t N, int64_t K, int64_t block, const int64_t *low,
                        const int64_t *high, const uint16_t *scales_and_zeros, int64_t group, int64_t start,
                        int64_t rows, float *out, int threads) {
    const int64_t half = block / 2;
    #pragma omp parallel for num_threads(threads) schedule(static) collapse(2)
    for (int64_t b = 0; b < rows / block; ++b) {
        for (int64_t j = 0; j < half; ++j) {
            const int64_t first = start + b * block;           /* the block's first weight row */
            const uint8_t *bytes = packed + first * K / 2 + j;
            const int64_t lo = low[j], hi = high[j];
            float *row_lo = out + (b * block + lo) * K, *row_hi = out + (b * block + hi) * K;
            for (int64_t g = 0; g * group < K; ++g) {
                const uint16_t *sz = scales_and_zeros + (g * N + first) * 2;
                const float scale_lo = bf16_load(sz[2 * lo]), zero_lo = bf16_load(sz[2 * lo + 1]);
                const float scale_hi = bf16_load(sz[2 * hi]), zero_hi = bf16_load(sz[2 * hi + 1]);
                const int64_t end = (g + 1) * group < K ? (g + 1) * group : K;
                for (int64_t k = g * group; k < end; ++k) {
                    const uint8_t byte = bytes[k * half];
                    row_lo[k] = ((float)(byte & 0xF) - 8.0f) * scale_lo + zero_lo;
                    row_hi[k] = ((float)(byte >> 4) - 8.0f) * scale_hi + zero_hi;
                }
            }
        }
    }
}

/* Rows of an int4 embedding table (quantize.Int4Embedding: byte i of a row holds values
 * 2i and 2i + 1 in its low and high nibbles; a bfloat16 scale and low per group) for
 * `count` token ids, as bfloat16 [count, K]: code * scale rounded to bfloat16, plus low,
 * rounded again, as the module's torch ops compute it (35 us for one id, 11 calls). */
void ruvllm_int4_embedding(const uint8_t *packed, const uint16_t *scales, const uint16_t *lows, const int64_t *ids,
                           int64_t count, int64_t K, int64_t group, uint16_t *out) {
    const int64_t groups = K / group;
    for (int64_t r = 0; r < count; ++r) {
        const uint8_t *row = packed + ids[r] * (K / 2);
        const uint16_t *scale = scales + ids[r] * groups, *low = lows + ids[r] * groups;
        uint16_t *dst = out + r * K;
        for (int64_t k = 0; k < K; ++k) {
            const float code = (float)(k % 2 ? row[k / 2] >> 4 : row[k / 2] & 0xF);
            const float product = bf16_load(bf16_round(code * bf16_load(scale[k / group])));
            dst[k] = bf16_round(product + bf16_load(low[k / group]));
        }
    }
}

/* Rows of a tied q4k head's packed weights looked up as embedding rows, for `count` token
 * ids, as bfloat16 [count, K]: (q - 8) * scale + zero in float32, rounded once, the values
 * `ruvllm_int4_unpack` gives for the same rows. Row r of a block sits in byte byte_of[r]
 * of each k, in the nibble at bit shift_of[r] (0 or 4). */
void ruvllm_int4_packed_rows(const uint8_t *packed, int64_t N, int64_t K, int64_t block, const int64_t *byte_of,
                             const int64_t *shift_of, const uint16_t *scales_and_zeros, int64_t group,
                             const int64_t *ids, int64_t count, uint16_t *out) {
    const int64_t half = block / 2;
    for (int64_t r = 0; r < count; ++r) {
        const int64_t id = ids[r], first = id - id % block, in_block = id % block;
        const uint8_t *bytes = packed + first * K / 2 + byte_of[in_block];
        const int shift = (int)shift_of[in_block];
        uint16_t *dst = out + r * K;
        for (int64_t g = 0; g * group < K; ++g) {
            const uint16_t *sz = scales_and_zeros + (g * N + id) * 2;
            const float scale = bf16_load(sz[0]), zero = bf16_load(sz[1]);
            const int64_t end = (g + 1) * group < K ? (g + 1) * group : K;
            for (int64_t k = g * group; k < end; ++k) {
                const float code = (float)((bytes[k * half] >> shift) & 0xF);
                dst[k] = bf16_round((code - 8.0f) * scale + zero);
            }
        }
    }
}

/* Asymmetric int4 codes for rows of float32 weights [rows, K], a scale and low per group
 * of `group` (quantize.int4_groups, whose torch ops are the reference): codes from the
 * group's min and max, then `rounds` least-squares fits of scale and low to the codes,
 * each followed by the codes nearest to the fit, a group keeping whatever lowers its
 * squared error. Sums and fits in double. codes: [rows, K] int32; scales, lows:
 * [rows, K / group]. */
static double fit_error(double a, double b, double n, double sq, double sqq, double sqx, double sx, double sxx) {
    return a * a * sqq + 2.0 * a * b * sq - 2.0 * a * sqx + n * b * b - 2.0 * b * sx + sxx;
}

static void code_sums(const float *x, const int32_t *q, int64_t n, double *sq, double *sqq, double *sqx) {
    double s = 0.0, ss = 0.0, sx = 0.0;
    for (int64_t i = 0; i < n; ++i) {
        s += q[i];
        ss += (double)q[i] * q[i];
        sx += (double)q[i] * x[i];
    }
    *sq = s, *sqq = ss, *sqx = sx;
}

static void nearest_codes(const float *x, int64_t n, float scale, float low, int32_t *q) {
    for (int64_t i = 0; i < n; ++i) {
        float code = nearbyintf((x[i] - low) / scale);
        q[i] = (int32_t)(code < 0.0f ? 0.0f : code > 15.0f ? 15.0f : code);
    }
}

void ruvllm_int4_fit(const float *w, int64_t rows, int64_t K, int64_t group, int rounds, int32_t *codes,
                     float *scales, float *lows, int threads) {
    const int64_t groups = K / group;
    #pragma omp parallel num_threads(threads)
    {
        int32_t again[256];   /* group <= 256 */
        #pragma omp for schedule(static)
        for (int64_t index = 0; index < rows * groups; ++index) {
            const float *x = w + index * group;
            int32_t *q = codes + index * group;
            float lo = x[0], hi = x[0];
            for (int64_t i = 1; i < group; ++i) {
                lo = x[i] < lo ? x[i] : lo;
                hi = x[i] > hi ? x[i] : hi;
            }
            float range = hi - lo;
            float scale = (range > 1e-8f ? range : 1e-8f) / 15.0f;
            nearest_codes(x, group, scale, lo, q);
            double a = scale, b = lo, sx = 0.0, sxx = 0.0, sq, sqq, sqx;
            const double n = (double)group;
            for (int64_t i = 0; i < group; ++i) {
                sx += x[i];
                sxx += (double)x[i] * x[i];
            }
            code_sums(x, q, group, &sq, &sqq, &sqx);
            double best = fit_error(a, b, n, sq, sqq, sqx, sx, sxx);
            for (int r = 0; r < rounds; ++r) {
                const double det = n * sqq - sq * sq;
                if (det <= 0.0) break;
                const double fit_a = (n * sqx - sq * sx) / det, fit_b = (sx - fit_a * sq) / n;
                if (fit_a > 0.0) {
                    const double fitted = fit_error(fit_a, fit_b, n, sq, sqq, sqx, sx, sxx);
                    if (fitted < best) a = fit_a, b = fit_b, best = fitted;
                }
                nearest_codes(x, group, (float)a, (float)b, again);
                double nq, nqq, nqx;
                code_sums(x, again, group, &nq, &nqq, &nqx);
                const double moved = fit_error(a, b, n, nq, nqq, nqx, sx, sxx);
                if (!(moved < best)) break;
                memcpy(q, again, group * sizeof(int32_t));
                sq = nq, sqq = nqq, sqx = nqx, best = moved;
            }
            scales[index] = (float)a;
            lows[index] = (float)b;
        }
    }
}
