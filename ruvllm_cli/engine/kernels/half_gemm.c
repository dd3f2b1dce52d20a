/* Linear layers with float16 weights and float32 activations, for x86-64 CPUs with
 * AVX2, FMA and F16C (every such CPU since 2013) but no bfloat16 arithmetic.
 *
 * out[m, n] = sum_k x[m, k] * w[n, k] (+ bias[n]). The weights come in blocks of 32
 * output rows stored k-major (half.py's `to_blocks`): block b holds w[32 b + j, k] at
 * [b][k][j], so one k of a block is 64 contiguous bytes, 32 float16 values widened by
 * two `vcvtph2ps` into two 16-lane vectors (four 8-lane ones under AVX2). A tile of up
 * to eight activation rows runs down a block's k: each row's x[m, k] broadcast against
 * those vectors into its own sums (16 sums of 16 lanes: the rows' 32 outputs). The
 * weights are read once per eight rows, straight from memory, widened in registers,
 * with no scratch and no horizontal sums: the register-blocked form of a GEMM, where
 * the previous kernel (dot products of two rows against four widened weight rows)
 * reached a third of this CPU's FMA rate at 16 rows (docs/design.md, section 19).
 *
 * Every output is one chain of FMAs over k in order, whatever the number of rows, the
 * tile a row falls in, or the vector width: a row's result is the same bits alone, in
 * a decode batch, in a prompt chunk, under AVX2 or AVX-512.
 * Threads split the blocks (OpenMP: the runtime torch already loaded). */

#include <immintrin.h>
#include <stdint.h>
#include <omp.h>

#include "common.h"

#define BLOCK 32   /* output rows a block; half.py's BLOCK */
#define TILE 8     /* activation rows a pass down a block */
/* Software prefetch distance, in bytes, along a block (a thread's blocks are
 * contiguous, so it runs on into the next): as in int8_gemm.c (design.md, 19 and 20). */
#define AHEAD 4096

typedef int64_t i64;

/* Rows [m0, m0 + G) of x against block b, into out's 32 columns of the block (the
 * columns past N, padding, are not written). AVX-512: two 16-lane vectors a k. */
#define TILE512(G) tile512_##G(x, K, blocks, b, m0, N, bias, out)
#define DEFINE_TILE512(G)                                                                              \
__attribute__((target("avx512f,f16c,fma"), always_inline)) static inline void tile512_##G(               \
        const float *x, i64 K, const uint16_t *blocks, i64 b, i64 m0, i64 N, const float *bias, float *out) { \
    const uint16_t *w = blocks + b * K * BLOCK;                                                          \
    const float *row = x + m0 * K;                                                                       \
    __m512 lo[G], hi[G];                                                                                 \
    for (int g = 0; g < G; ++g) lo[g] = hi[g] = _mm512_setzero_ps();                                     \
    for (i64 k = 0; k < K; ++k) {                                                                        \
        _mm_prefetch((const char *)(w + k * BLOCK) + AHEAD, _MM_HINT_T0);                                \
        const __m512 w0 = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(w + k * BLOCK)));         \
        const __m512 w1 = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(w + k * BLOCK + 16)));    \
        for (int g = 0; g < G; ++g) {                                                                    \
            const __m512 v = _mm512_set1_ps(row[g * K + k]);                                             \
            lo[g] = _mm512_fmadd_ps(v, w0, lo[g]);                                                       \
            hi[g] = _mm512_fmadd_ps(v, w1, hi[g]);                                                       \
        }                                                                                                \
    }                                                                                                    \
    store_tile(lo, hi, G, b, m0, N, bias, out);                                                      \
}

/* The same under AVX2: four 8-lane vectors a k. One or two rows take all four in one
 * pass (four or eight sums: at one row, two sums would leave the FMAs waiting on each
 * other, 1.15x slower than the dot-product kernel before); more take two passes of 16
 * columns (the sixteen registers hold a pass's sums for up to six rows: tiles of six). */
#define TILE256(G) tile256_##G(x, K, blocks, b, m0, N, bias, out)
#define DEFINE_TILE256(G)                                                                              \
__attribute__((always_inline)) static inline void tile256_##G(                                          \
        const float *x, i64 K, const uint16_t *blocks, i64 b, i64 m0, i64 N, const float *bias, float *out) { \
    const uint16_t *w = blocks + b * K * BLOCK;                                                          \
    const float *row = x + m0 * K;                                                                       \
    enum { VECTORS = G <= 2 ? 4 : 2 };                                                                   \
    for (int part = 0; part < 4 / VECTORS; ++part) {                                                     \
        __m256 sums[G][VECTORS];                                                                         \
        for (int g = 0; g < G; ++g)                                                                      \
            for (int j = 0; j < VECTORS; ++j) sums[g][j] = _mm256_setzero_ps();                           \
        for (i64 k = 0; k < K; ++k) {                                                                    \
            const uint16_t *at = w + k * BLOCK + 8 * VECTORS * part;                                     \
            _mm_prefetch((const char *)at + AHEAD, _MM_HINT_T0);                                         \
            __m256 q[VECTORS];                                                                           \
            for (int j = 0; j < VECTORS; ++j) q[j] = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(at + 8 * j))); \
            for (int g = 0; g < G; ++g) {                                                                \
                const __m256 v = _mm256_set1_ps(row[g * K + k]);                                         \
                for (int j = 0; j < VECTORS; ++j) sums[g][j] = _mm256_fmadd_ps(v, q[j], sums[g][j]);      \
            }                                                                                            \
        }                                                                                                \
        float kept[8 * 4 * 6];                                                                           \
        for (int g = 0; g < G; ++g)                                                                      \
            for (int j = 0; j < VECTORS; ++j) _mm256_storeu_ps(kept + (g * VECTORS + j) * 8, sums[g][j]); \
        write_sums(kept, G, 8 * VECTORS, b * BLOCK + 8 * VECTORS * part, m0, N, bias, out);               \
    }                                                                                                    \
}

/* sums [G][width]: rows m0.. and columns n0.. of out, plus the bias, past N dropped. */
static inline void write_sums(const float *sums, int G, int width, i64 n0, i64 m0, i64 N, const float *bias,
                              float *out) {
    const int columns = N - n0 < width ? (int)(N - n0) : width;
    for (int g = 0; g < G; ++g)
        for (int j = 0; j < columns; ++j)
            out[(m0 + g) * N + n0 + j] = bias != NULL ? sums[g * width + j] + bias[n0 + j] : sums[g * width + j];
}

__attribute__((target("avx512f"), always_inline)) static inline void store_tile(
        const __m512 *lo, const __m512 *hi, int G, i64 b, i64 m0, i64 N, const float *bias, float *out) {
    float sums[BLOCK * TILE];
    for (int g = 0; g < G; ++g) {
        _mm512_storeu_ps(sums + g * BLOCK, lo[g]);
        _mm512_storeu_ps(sums + g * BLOCK + 16, hi[g]);
    }
    write_sums(sums, G, BLOCK, b * BLOCK, m0, N, bias, out);
}

DEFINE_TILE512(1) DEFINE_TILE512(2) DEFINE_TILE512(3) DEFINE_TILE512(4)
DEFINE_TILE512(5) DEFINE_TILE512(6) DEFINE_TILE512(7) DEFINE_TILE512(8)
DEFINE_TILE256(1) DEFINE_TILE256(2) DEFINE_TILE256(3) DEFINE_TILE256(4) DEFINE_TILE256(5) DEFINE_TILE256(6)

__attribute__((target("avx512f,f16c,fma")))
static void block512(const float *x, i64 M, i64 K, const uint16_t *blocks, i64 b, i64 N, const float *bias,
                     float *out) {
    for (i64 m0 = 0; m0 < M; m0 += TILE) {
        const i64 rows = M - m0;
        BY_GROUP(rows, TILE512)
    }
}

static void block256(const float *x, i64 M, i64 K, const uint16_t *blocks, i64 b, i64 N, const float *bias,
                     float *out) {
    for (i64 m0 = 0; m0 < M; m0 += 6) {
        switch (M - m0 < 6 ? M - m0 : 6) {
            case 1: TILE256(1); break; case 2: TILE256(2); break; case 3: TILE256(3); break;
            case 4: TILE256(4); break; case 5: TILE256(5); break; default: TILE256(6); break;
        }
    }
}

static void linear(const float *x, i64 M, i64 K, const uint16_t *blocks, i64 N, const float *bias, float *out,
                   int threads, int wide) {
    const i64 count = (N + BLOCK - 1) / BLOCK;
    #pragma omp parallel for num_threads(threads) schedule(static)
    for (i64 b = 0; b < count; ++b) {
        if (wide) block512(x, M, K, blocks, b, N, bias, out);
        else block256(x, M, K, blocks, b, N, bias, out);
    }
}

/* x [M, K] float32; blocks [ceil(N / 32)][K][32] float16 bits (rows past N zeros);
 * bias [N] or NULL; out [M, N]. `scratch` is not used (the signature decode_step.c's
 * table holds for every kernel). kernels/__init__.py's HalfKernel picks the AVX-512 form
 * where the CPU has it; the two give the same bits, which the tests check. */
void ruvllm_f16_linear_avx512(const float *x, i64 M, i64 K, const uint16_t *blocks, i64 N, const float *bias,
                              float *out, float *scratch, int threads) {
    (void)scratch;
    linear(x, M, K, blocks, N, bias, out, threads, 1);
}

void ruvllm_f16_linear_avx2(const float *x, i64 M, i64 K, const uint16_t *blocks, i64 N, const float *bias,
                            float *out, float *scratch, int threads) {
    (void)scratch;
    linear(x, M, K, blocks, N, bias, out, threads, 0);
}
