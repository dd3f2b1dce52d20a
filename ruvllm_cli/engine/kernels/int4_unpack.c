/* torch's packed int4 weights (`_convert_weight_to_int4pack_for_cpu`) unpacked to
 * float32 rows, for prompt chunks run through a float32 GEMM (engine/int4_dense.py).
 *
 * The packed bytes are [N / block, K, block / 2]: byte j of a k holds row low[j] of the
 * block in its low nibble and row high[j] in its high nibble (the layout is read off
 * torch at run time, since it follows the CPU capability torch dispatched to). Each
 * value becomes (q - 8) * scale + zero with the group's bfloat16 scale and zero, the
 * kernel's own formula. */

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
