/* Linear layers with bfloat16 weights and activations for a few rows (decode steps),
 * on x86-64 CPUs with AVX-512 BF16.
 *
 * out[m, n] = sum_k x[m, k] * w[n, k] (+ bias[n]), summed in float32, rounded to
 * bfloat16 once at the end (as oneDNN's bfloat16 GEMM does, in another order). The
 * weights are widened to float32 in registers, two instructions for 32 values (the even
 * ones shifted up, the odd ones masked), and go through FMAs: `vdpbf16ps` ran at a
 * quarter of the FMAs' rate here (docs/design.md, section 22). The activation rows are
 * widened once per call into the same even/odd order.
 *
 * Threads split the weight rows four at a time; the activation rows pass them four at a
 * time, the first four reading the weights from memory, the others from L1 while they
 * fetch the next four rows. Every output is summed in one order whatever the number of
 * rows, so a row's result is bit-identical alone or in any batch. */

#include <immintrin.h>
#include <stdint.h>
#include <string.h>
#include <omp.h>

#include "common.h"

#define AHEAD 16384  /* software prefetch distance along the weights (4096 read 2-3% slower at one row) */

/* Rows of x [M, K] as float32 in xf, each 32-value chunk as its 16 even values then its
 * 16 odd ones: the order in which `tile` widens the weights. */
static void widen_rows(const uint16_t *x, int64_t M, int64_t K, float *xf) {
    const __m512i high = _mm512_set1_epi32((int)0xffff0000u);
    for (int64_t i = 0; i < M * K; i += 32) {
        const __m512i v = _mm512_loadu_si512((const void *)(x + i));
        _mm512_storeu_si512((void *)(xf + i), _mm512_slli_epi32(v, 16));
        _mm512_storeu_si512((void *)(xf + i + 16), _mm512_and_si512(v, high));
    }
}

/* The 16 sums of a[0..15] (a[4r + j]: activation row r, weight row j) in one fixed tree
 * (the same for every output, whatever the other accumulators hold). */
static inline void reduce16(const __m512 *a, float *sums) {
    __m512 b[8], c[4];
    for (int i = 0; i < 8; ++i)
        b[i] = _mm512_add_ps(_mm512_shuffle_f32x4(a[2 * i], a[2 * i + 1], 0x44),
                             _mm512_shuffle_f32x4(a[2 * i], a[2 * i + 1], 0xEE));
    for (int i = 0; i < 4; ++i)   /* c[i]: a[4i + L] in 128-bit lane L */
        c[i] = _mm512_add_ps(_mm512_shuffle_f32x4(b[2 * i], b[2 * i + 1], 0x88),
                             _mm512_shuffle_f32x4(b[2 * i], b[2 * i + 1], 0xDD));
    const __m512 d0 = _mm512_add_ps(_mm512_unpacklo_ps(c[0], c[1]), _mm512_unpackhi_ps(c[0], c[1]));
    const __m512 d1 = _mm512_add_ps(_mm512_unpacklo_ps(c[2], c[3]), _mm512_unpackhi_ps(c[2], c[3]));
    const __m512 e = _mm512_add_ps(_mm512_castpd_ps(_mm512_unpacklo_pd(_mm512_castps_pd(d0), _mm512_castps_pd(d1))),
                                   _mm512_castpd_ps(_mm512_unpackhi_pd(_mm512_castps_pd(d0), _mm512_castps_pd(d1))));
    float t[16];   /* t[4L + i] = sum of a[4i + L] */
    _mm512_storeu_ps(t, e);
    for (int i = 0; i < 16; ++i) sums[i] = t[4 * (i % 4) + i / 4];
}

/* R activation rows (R = 1..4, a constant where inlined) against four weight rows: 4R
 * FMA chains over 32 values a step. `fetch`: the weights come from memory (prefetched
 * along the rows); otherwise they sit in L1 and `next` (four rows after them, or NULL)
 * is fetched. */
static inline __attribute__((always_inline)) void tile(const float *const *x, const int R, const uint16_t *const *w,
                                                       int64_t K, int fetch, const uint16_t *next, float *sums) {
    const __m512i high = _mm512_set1_epi32((int)0xffff0000u);
    __m512 a[16];
    for (int i = 0; i < 16; ++i) a[i] = _mm512_setzero_ps();
    for (int64_t k = 0; k < K; k += 32) {
        __m512 even[4], odd[4];
        for (int j = 0; j < 4; ++j) {
            if (fetch)
                _mm_prefetch((const char *)(w[j] + k) + AHEAD, _MM_HINT_T0);
            else if (next != NULL)
                _mm_prefetch((const char *)(next + j * K + k), _MM_HINT_T0);
            const __m512i v = _mm512_loadu_si512((const void *)(w[j] + k));
            even[j] = _mm512_castsi512_ps(_mm512_slli_epi32(v, 16));
            odd[j] = _mm512_castsi512_ps(_mm512_and_si512(v, high));
        }
        for (int r = 0; r < R; ++r) {
            const __m512 e = _mm512_loadu_ps(x[r] + k), o = _mm512_loadu_ps(x[r] + k + 16);
            for (int j = 0; j < 4; ++j) a[4 * r + j] = _mm512_fmadd_ps(e, even[j], a[4 * r + j]);
            for (int j = 0; j < 4; ++j) a[4 * r + j] = _mm512_fmadd_ps(o, odd[j], a[4 * r + j]);
        }
    }
    reduce16(a, sums);
}

/* Weight rows n..n+3 (fewer at the end: the last repeats) against every activation row
 * of xf, four at a time. */
static void quad_all_rows(const float *xf, int64_t M, int64_t K, const uint16_t *w, int64_t N, int64_t n,
                          const float *bias, uint16_t *out) {
    const int valid = N - n < 4 ? (int)(N - n) : 4;
    const uint16_t *rows[4];
    for (int j = 0; j < 4; ++j) rows[j] = w + (n + (j < valid ? j : valid - 1)) * K;
    const uint16_t *next = n + 8 <= N ? w + (n + 4) * K : NULL;
    for (int64_t m = 0; m < M; m += 4) {
        const int R = M - m < 4 ? (int)(M - m) : 4;
        const float *xs[4];
        float sums[16];
        for (int r = 0; r < 4; ++r) xs[r] = xf + (m + (r < R ? r : 0)) * K;
        switch (R) {
            case 4: tile(xs, 4, rows, K, m == 0, next, sums); break;
            case 3: tile(xs, 3, rows, K, m == 0, next, sums); break;
            case 2: tile(xs, 2, rows, K, m == 0, next, sums); break;
            default: tile(xs, 1, rows, K, m == 0, next, sums); break;
        }
        for (int r = 0; r < R; ++r)
            for (int j = 0; j < valid; ++j)
                out[(m + r) * N + n + j] = bf16_round(sums[4 * r + j] + (bias != NULL ? bias[n + j] : 0.0f));
    }
}

/* x [M, K] bfloat16, w [N, K] bfloat16, bias [N] float32 or NULL, out [M, N] bfloat16;
 * K % 32 == 0; scratch: M * K floats. */
void ruvllm_bf16_linear(const uint16_t *x, int64_t M, int64_t K, const uint16_t *w, int64_t N,
                        const float *bias, uint16_t *out, float *scratch, int threads) {
    widen_rows(x, M, K, scratch);
    #pragma omp parallel for num_threads(threads) schedule(static)
    for (int64_t quad = 0; quad < (N + 3) / 4; ++quad) quad_all_rows(scratch, M, K, w, N, 4 * quad, bias, out);
}
