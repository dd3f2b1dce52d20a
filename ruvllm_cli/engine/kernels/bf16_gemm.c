/* Linear layers with bfloat16 weights and activations for a few rows (decode steps),
 * on x86-64 CPUs with AVX-512 BF16.
 *
 * out[m, n] = sum_k x[m, k] * w[n, k] (+ bias[n]), each product pair summed in float32
 * by `vdpbf16ps`, rounded to bfloat16 once at the end (as oneDNN's bfloat16 GEMM does,
 * in another order). Threads split the weight rows; each weight row is read from
 * memory once and kept in L1 while every activation row takes its dot product with it,
 * so M rows cost about one weight read: oneDNN's packed GEMM read the 0.5B shape's
 * weights at 16 rows in 2.5x the time of one row (docs/design.md, section 22). */

#include <immintrin.h>
#include <stdint.h>
#include <string.h>
#include <omp.h>

#define AHEAD 4096   /* software prefetch distance along a weight row, as in int8_gemm.c */

static inline uint16_t bf16_round(float f) {
    uint32_t u;
    memcpy(&u, &f, 4);
    if ((u & 0x7fffffffu) > 0x7f800000u) return (uint16_t)((u >> 16) | 0x40);
    return (uint16_t)((u + 0x7fffu + ((u >> 16) & 1u)) >> 16);
}

static inline __m512bh load32(const uint16_t *p) { return (__m512bh)_mm512_loadu_si512((const void *)p); }

/* One activation row against one weight row of K values (K % 32 == 0): four
 * independent sums over 128 values a step; `fetch` prefetches the weight row ahead
 * (the first activation row reads it from memory, the others from L1). */
static inline float dot(const uint16_t *x, const uint16_t *w, int64_t K, int fetch) {
    __m512 a0 = _mm512_setzero_ps(), a1 = a0, a2 = a0, a3 = a0;
    int64_t k = 0;
    for (; k + 128 <= K; k += 128) {
        if (fetch) {
            _mm_prefetch((const char *)(w + k) + AHEAD, _MM_HINT_T0);
            _mm_prefetch((const char *)(w + k) + AHEAD + 64, _MM_HINT_T0);
            _mm_prefetch((const char *)(w + k) + AHEAD + 128, _MM_HINT_T0);
            _mm_prefetch((const char *)(w + k) + AHEAD + 192, _MM_HINT_T0);
        }
        a0 = _mm512_dpbf16_ps(a0, load32(x + k), load32(w + k));
        a1 = _mm512_dpbf16_ps(a1, load32(x + k + 32), load32(w + k + 32));
        a2 = _mm512_dpbf16_ps(a2, load32(x + k + 64), load32(w + k + 64));
        a3 = _mm512_dpbf16_ps(a3, load32(x + k + 96), load32(w + k + 96));
    }
    for (; k < K; k += 32) a0 = _mm512_dpbf16_ps(a0, load32(x + k), load32(w + k));
    return _mm512_reduce_add_ps(_mm512_add_ps(_mm512_add_ps(a0, a1), _mm512_add_ps(a2, a3)));
}

static inline __m512 widen16(const uint16_t *p) {   /* 16 bfloat16 values as float32, exactly */
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)p)), 16));
}

/* R activation rows (float32, widened once per call; R = 4 or 8, a constant where
 * inlined) against two weight rows widened 16 values at a time in registers: 2R float32
 * FMA chains. `vdpbf16ps` ran at about one every two cycles here, no faster than the
 * FMAs, so past one row the weights are widened instead, and the widening is shared by
 * R rows (docs/design.md, section 22). x[r] for the rows past the last repeats row 0. */
static inline __attribute__((always_inline)) void block_rows(const float *const *x, const int R, const uint16_t *w0,
                                                             const uint16_t *w1, int64_t K, int fetch, float *sums) {
    __m512 a[16];
    for (int i = 0; i < 2 * R; ++i) a[i] = _mm512_setzero_ps();
    for (int64_t k = 0; k < K; k += 16) {
        if (fetch && k % 32 == 0) {
            _mm_prefetch((const char *)(w0 + k) + AHEAD, _MM_HINT_T0);
            _mm_prefetch((const char *)(w1 + k) + AHEAD, _MM_HINT_T0);
        }
        const __m512 u = widen16(w0 + k), v = widen16(w1 + k);
        for (int r = 0; r < R; ++r) {
            const __m512 row = _mm512_loadu_ps(x[r] + k);
            a[2 * r] = _mm512_fmadd_ps(row, u, a[2 * r]);
            a[2 * r + 1] = _mm512_fmadd_ps(row, v, a[2 * r + 1]);
        }
    }
    for (int i = 0; i < 2 * R; ++i) sums[i] = _mm512_reduce_add_ps(a[i]);
}

/* Weight rows n and n + 1 against every activation row (xf: [M, K] float32), eight
 * rows at a time (four where fewer than eight remain: less work thrown away). */
static void pair_all_rows(const float *xf, int64_t M, int64_t K, const uint16_t *w, int64_t N, int64_t n,
                          const float *bias, uint16_t *out) {
    const float b0 = bias != NULL ? bias[n] : 0.0f, b1 = bias != NULL ? bias[n + 1] : 0.0f;
    for (int64_t m = 0; m < M;) {
        const int R = M - m > 4 ? 8 : 4;
        const int64_t rows = M - m < R ? M - m : R;
        const float *xs[8];
        float sums[16];
        for (int r = 0; r < R; ++r) xs[r] = xf + (m + (r < rows ? r : 0)) * K;
        if (R == 8)
            block_rows(xs, 8, w + n * K, w + (n + 1) * K, K, m == 0, sums);
        else
            block_rows(xs, 4, w + n * K, w + (n + 1) * K, K, m == 0, sums);
        for (int r = 0; r < rows; ++r) {
            out[(m + r) * N + n] = bf16_round(sums[2 * r] + b0);
            out[(m + r) * N + n + 1] = bf16_round(sums[2 * r + 1] + b1);
        }
        m += rows;
    }
}

/* x [M, K] bfloat16, w [N, K] bfloat16, bias [N] float32 or NULL, out [M, N] bfloat16;
 * K % 32 == 0; scratch: M * K floats. One row streams each weight row once (the decode
 * GEMV); more rows take weight rows in pairs, each pair held in L1 while the activation
 * rows pass by fours. */
void ruvllm_bf16_linear(const uint16_t *x, int64_t M, int64_t K, const uint16_t *w, int64_t N,
                        const float *bias, uint16_t *out, float *scratch, int threads) {
    if (M == 1) {
        #pragma omp parallel for num_threads(threads) schedule(static)
        for (int64_t n = 0; n < N; ++n) out[n] = bf16_round(dot(x, w + n * K, K, 1) + (bias != NULL ? bias[n] : 0.0f));
        return;
    }
    for (int64_t i = 0; i < M * K; i += 16) _mm512_storeu_ps(scratch + i, widen16(x + i));
    #pragma omp parallel for num_threads(threads) schedule(static)
    for (int64_t pair = 0; pair < N / 2; ++pair) pair_all_rows(scratch, M, K, w, N, 2 * pair, bias, out);
    if (N % 2)
        for (int64_t m = 0; m < M; ++m)
            out[m * N + N - 1] = bf16_round(dot(x + m * K, w + (N - 1) * K, K, 0) + (bias != NULL ? bias[N - 1] : 0.0f));
}
