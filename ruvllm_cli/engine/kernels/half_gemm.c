/* Linear layers with float16 weights and float32 activations, for x86-64 CPUs with
 * AVX2, FMA and F16C (every such CPU since 2013) but no bfloat16 arithmetic.
 *
 * out[m, n] = sum_k x[m, k] * w[n, k] (+ bias[n]): w is read as float16 and widened
 * in registers, so a decode step streams half the bytes of float32 weights while the
 * sums stay float32. One activation row reads the weights a row at a time (the decode
 * GEMV, bandwidth-bound); several rows widen four weight rows once into a float32
 * scratch and run two activation rows at a time against it (docs/design.md, 5a).
 * Threads split the output columns (OpenMP: the runtime torch already loaded). */

#include <immintrin.h>
#include <stdint.h>
#include <omp.h>

#include "common.h"

#define ROWS 4
/* Software prefetch distance, in bytes, along the weight rows (a thread's rows are
 * contiguous, so it runs on into the next): as in int8_gemm.c (design.md, 19 and 20). */
#define AHEAD 4096

static inline __m256 load_half(const uint16_t *p) {
    return _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)p));
}

/* One activation row against one weight row read as float16: eight independent sums
 * over 64 weights a step. One row at a time keeps each thread on a single forward
 * stream (the prefetcher's best case); four rows read side by side, as this kernel
 * first did, streamed 1.35x slower (docs/design.md, section 19). */
static float dot_row(const float *x, const uint16_t *r, int64_t K) {
    __m256 a0 = _mm256_setzero_ps(), a1 = a0, a2 = a0, a3 = a0, a4 = a0, a5 = a0, a6 = a0, a7 = a0;
    int64_t k = 0;
    for (; k + 64 <= K; k += 64) {   /* 128 bytes of weights: two cache lines, fetched AHEAD on */
        _mm_prefetch((const char *)(r + k) + AHEAD, _MM_HINT_T0);
        _mm_prefetch((const char *)(r + k) + AHEAD + 64, _MM_HINT_T0);
        a0 = _mm256_fmadd_ps(load_half(r + k), _mm256_loadu_ps(x + k), a0);
        a1 = _mm256_fmadd_ps(load_half(r + k + 8), _mm256_loadu_ps(x + k + 8), a1);
        a2 = _mm256_fmadd_ps(load_half(r + k + 16), _mm256_loadu_ps(x + k + 16), a2);
        a3 = _mm256_fmadd_ps(load_half(r + k + 24), _mm256_loadu_ps(x + k + 24), a3);
        a4 = _mm256_fmadd_ps(load_half(r + k + 32), _mm256_loadu_ps(x + k + 32), a4);
        a5 = _mm256_fmadd_ps(load_half(r + k + 40), _mm256_loadu_ps(x + k + 40), a5);
        a6 = _mm256_fmadd_ps(load_half(r + k + 48), _mm256_loadu_ps(x + k + 48), a6);
        a7 = _mm256_fmadd_ps(load_half(r + k + 56), _mm256_loadu_ps(x + k + 56), a7);
    }
    for (; k < K; k += 8) a0 = _mm256_fmadd_ps(load_half(r + k), _mm256_loadu_ps(x + k), a0);
    __m256 s = _mm256_add_ps(_mm256_add_ps(_mm256_add_ps(a0, a1), _mm256_add_ps(a2, a3)),
                             _mm256_add_ps(_mm256_add_ps(a4, a5), _mm256_add_ps(a6, a7)));
    return hsum(s);
}

/* Two activation rows against four weight rows already widened into `s`. */
static void gemm_block2(const float *x0, const float *x1, int64_t K, const float *s, float *o0, float *o1) {
    const float *s1 = s + K, *s2 = s1 + K, *s3 = s2 + K;
    __m256 a0 = _mm256_setzero_ps(), a1 = _mm256_setzero_ps(), a2 = _mm256_setzero_ps(), a3 = _mm256_setzero_ps();
    __m256 b0 = _mm256_setzero_ps(), b1 = _mm256_setzero_ps(), b2 = _mm256_setzero_ps(), b3 = _mm256_setzero_ps();
    for (int64_t k = 0; k < K; k += 8) {
        __m256 u = _mm256_loadu_ps(x0 + k), v = _mm256_loadu_ps(x1 + k);
        __m256 w0 = _mm256_loadu_ps(s + k), w1 = _mm256_loadu_ps(s1 + k);
        a0 = _mm256_fmadd_ps(w0, u, a0); b0 = _mm256_fmadd_ps(w0, v, b0);
        a1 = _mm256_fmadd_ps(w1, u, a1); b1 = _mm256_fmadd_ps(w1, v, b1);
        __m256 w2 = _mm256_loadu_ps(s2 + k), w3 = _mm256_loadu_ps(s3 + k);
        a2 = _mm256_fmadd_ps(w2, u, a2); b2 = _mm256_fmadd_ps(w2, v, b2);
        a3 = _mm256_fmadd_ps(w3, u, a3); b3 = _mm256_fmadd_ps(w3, v, b3);
    }
    o0[0] = hsum(a0); o0[1] = hsum(a1); o0[2] = hsum(a2); o0[3] = hsum(a3);
    o1[0] = hsum(b0); o1[1] = hsum(b1); o1[2] = hsum(b2); o1[3] = hsum(b3);
}

/* Output columns n0..n0+4 for every activation row. */
static void block_all_rows(const float *x, int64_t M, int64_t K, const uint16_t *w, int64_t N,
                           int64_t n0, float *scratch, float *out) {
    float t0[ROWS], t1[ROWS];
    const uint16_t *rows = w + n0 * K;
    for (int64_t i = 0; i < ROWS * K; i += 8) _mm256_storeu_ps(scratch + i, load_half(rows + i));
    int64_t m = 0;
    for (; m + 1 < M; m += 2) {
        gemm_block2(x + m * K, x + (m + 1) * K, K, scratch, t0, t1);
        for (int j = 0; j < ROWS; ++j) { out[m * N + n0 + j] = t0[j]; out[(m + 1) * N + n0 + j] = t1[j]; }
    }
    if (m < M) {
        gemm_block2(x + m * K, x + m * K, K, scratch, t0, t1);
        for (int j = 0; j < ROWS; ++j) out[m * N + n0 + j] = t0[j];
    }
}

/* x [M, K] float32, w [N, K] float16 bits, bias [N] or NULL, out [M, N]; K % 8 == 0.
 * `scratch` holds threads * 4 * K floats (one widened block per thread; unused at M == 1). */
void ruvllm_f16_linear(const float *x, int64_t M, int64_t K, const uint16_t *w, int64_t N,
                       const float *bias, float *out, float *scratch, int threads) {
    if (M == 1) {
        #pragma omp parallel for num_threads(threads) schedule(static)
        for (int64_t n = 0; n < N; ++n) out[n] = dot_row(x, w + n * K, K);
    } else {
        const int64_t blocks = N / ROWS;
        #pragma omp parallel for num_threads(threads) schedule(static)
    for (int64_t b = 0; b < blocks; ++b)
            block_all_rows(x, M, K, w, N, b * ROWS, scratch + (int64_t)omp_get_thread_num() * ROWS * K, out);
        for (int64_t n = blocks * ROWS; n < N; ++n)
            for (int64_t m = 0; m < M; ++m) out[m * N + n] = dot_row(x + m * K, w + n * K, K);
    }
    if (bias != NULL)
        for (int64_t m = 0; m < M; ++m)
            for (int64_t n = 0; n < N; ++n) out[m * N + n] += bias[n];
}
