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
 * fetch the next four rows. From 5 to 32 rows (decode steps of several streams) the
 * rows pass each block of 128 values in turn instead, so the block and their values
 * stay in L1. Every output is summed in one order whatever the number of rows or
 * blocks, so a row's result is bit-identical alone or in any batch. */

#include <immintrin.h>
#include <stdint.h>
#include <string.h>
#include <omp.h>

#include "common.h"

#define AHEAD 16384      /* software prefetch distance along the weights (4096 read 2-3% slower at one row) */
#define KBLOCK 128        /* values a block when 5 to BLOCKED_ROWS rows pass the weights */
#define BLOCKED_ROWS 32   /* beyond, the rows' values of a block outgrow L1 (64 rows: 322 -> 350 ms a model) */

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

/* One step of 32 values k..k+31: R activation rows (R = 1..4, a constant where inlined)
 * against four weight rows, into the 4R sums a[4r + j] (16 FMA chains at R = 4).
 * `fetch`: the weights come from memory (prefetched along the rows); otherwise they sit
 * in L1 and `next` (four rows after them, or NULL) is fetched. */
static inline __attribute__((always_inline)) void step(const float *const *x, const int R, const uint16_t *const *w,
                                                       int64_t K, int64_t k, int fetch, const uint16_t *next,
                                                       __m512 *a) {
    const __m512i high = _mm512_set1_epi32((int)0xffff0000u);
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

/* The whole of K in one pass: the sums stay in registers. */
static inline __attribute__((always_inline)) void tile(const float *const *x, const int R, const uint16_t *const *w,
                                                       int64_t K, int fetch, const uint16_t *next, float *sums) {
    __m512 a[16];
    for (int i = 0; i < 16; ++i) a[i] = _mm512_setzero_ps();
    for (int64_t k = 0; k < K; k += 32) step(x, R, w, K, k, fetch, next, a);
    reduce16(a, sums);
}

/* Values [k0, k1) only, the sums carried over in `acc`: the same FMAs in the same order
 * as `tile`'s, block after block. */
static inline __attribute__((always_inline)) void tile_part(const float *const *x, const int R,
                                                            const uint16_t *const *w, int64_t K, int64_t k0,
                                                            int64_t k1, int fetch, __m512 *acc) {
    __m512 a[16];
    for (int i = 0; i < 16; ++i) a[i] = acc[i];
    for (int64_t k = k0; k < k1; k += 32) step(x, R, w, K, k, fetch, NULL, a);
    for (int i = 0; i < 16; ++i) acc[i] = a[i];
}

/* Activation rows m..m+R-1 of weight rows n..n+valid-1, from their 16 sums. */
static inline void store(const float *sums, int64_t m, int R, int64_t n, int valid, int64_t N, const float *bias,
                         uint16_t *out) {
    for (int r = 0; r < R; ++r)
        for (int j = 0; j < valid; ++j)
            out[(m + r) * N + n + j] = bf16_round(sums[4 * r + j] + (bias != NULL ? bias[n + j] : 0.0f));
}

/* Weight rows n..n+3 of w (fewer at the end: the last repeats), in `rows`. */
static int quad(const uint16_t *w, int64_t N, int64_t K, int64_t n, const uint16_t **rows) {
    const int valid = N - n < 4 ? (int)(N - n) : 4;
    for (int j = 0; j < 4; ++j) rows[j] = w + (n + (j < valid ? j : valid - 1)) * K;
    return valid;
}

/* How many of the four activation rows from m exist (1..4). */
static inline int group_rows(int64_t M, int64_t m) { return M - m < 4 ? (int)(M - m) : 4; }

/* Activation rows m..m+R-1 of xf (R = group_rows), the first repeated to fill four. */
static inline int group(const float *xf, int64_t M, int64_t K, int64_t m, const float **xs) {
    const int R = group_rows(M, m);
    for (int r = 0; r < 4; ++r) xs[r] = xf + (m + (r < R ? r : 0)) * K;
    return R;
}

/* Weight rows n..n+3 against every activation row of xf, four at a time. */
static void quad_all_rows(const float *xf, int64_t M, int64_t K, const uint16_t *w, int64_t N, int64_t n,
                          const float *bias, uint16_t *out) {
    const uint16_t *rows[4];
    const int valid = quad(w, N, K, n, rows);
    const uint16_t *next = n + 8 <= N ? w + (n + 4) * K : NULL;
    for (int64_t m = 0; m < M; m += 4) {
        const float *xs[4];
        float sums[16];
        const int R = group(xf, M, K, m, xs);
        switch (R) {
            case 4: tile(xs, 4, rows, K, m == 0, next, sums); break;
            case 3: tile(xs, 3, rows, K, m == 0, next, sums); break;
            case 2: tile(xs, 2, rows, K, m == 0, next, sums); break;
            default: tile(xs, 1, rows, K, m == 0, next, sums); break;
        }
        store(sums, m, R, n, valid, N, bias, out);
    }
}

/* The same for 5 to BLOCKED_ROWS rows, along K in blocks of KBLOCK values: every group
 * of four rows passes a block in turn, so the block's weights and the rows' values stay
 * in L1 (16 rows of K = 896 are 57 KiB of values: whole rows came from L2 again for
 * every four weight rows). */
static void quad_blocked(const float *xf, int64_t M, int64_t K, const uint16_t *w, int64_t N, int64_t n,
                         const float *bias, uint16_t *out) {
    const uint16_t *rows[4];
    const int valid = quad(w, N, K, n, rows);
    __m512 acc[BLOCKED_ROWS / 4][16];
    const int64_t groups = (M + 3) / 4;
    for (int64_t g = 0; g < groups; ++g)
        for (int i = 0; i < 16; ++i) acc[g][i] = _mm512_setzero_ps();
    for (int64_t k0 = 0; k0 < K; k0 += KBLOCK) {
        const int64_t k1 = k0 + KBLOCK < K ? k0 + KBLOCK : K;
        for (int64_t g = 0; g < groups; ++g) {
            const float *xs[4];
            switch (group(xf, M, K, 4 * g, xs)) {
                case 4: tile_part(xs, 4, rows, K, k0, k1, g == 0, acc[g]); break;
                case 3: tile_part(xs, 3, rows, K, k0, k1, g == 0, acc[g]); break;
                case 2: tile_part(xs, 2, rows, K, k0, k1, g == 0, acc[g]); break;
                default: tile_part(xs, 1, rows, K, k0, k1, g == 0, acc[g]); break;
            }
        }
    }
    for (int64_t g = 0; g < groups; ++g) {
        float sums[16];
        reduce16(acc[g], sums);
        store(sums, 4 * g, group_rows(M, 4 * g), n, valid, N, bias, out);
    }
}

/* x [M, K] bfloat16, w [N, K] bfloat16, bias [N] float32 or NULL, out [M, N] bfloat16;
 * K % 32 == 0; scratch: M * K floats. */
void ruvllm_bf16_linear(const uint16_t *x, int64_t M, int64_t K, const uint16_t *w, int64_t N,
                        const float *bias, uint16_t *out, float *scratch, int threads) {
    widen_rows(x, M, K, scratch);
    const int blocked = M > 4 && M <= BLOCKED_ROWS;
    #pragma omp parallel for num_threads(threads) schedule(static)
    for (int64_t q = 0; q < (N + 3) / 4; ++q) {
        if (blocked)
            quad_blocked(scratch, M, K, w, N, 4 * q, bias, out);
        else
            quad_all_rows(scratch, M, K, w, N, 4 * q, bias, out);
    }
}
