/* Linear layers with int8 weights (one float32 scale per output row), for x86-64 CPUs
 * with AVX2 (every such CPU since 2013), and AVX-512 VNNI where the CPU has it.
 *
 * Activations are quantized per row, symmetrically to int8 (xs = absmax / 127), and
 * every product is summed exactly in int32; out[m, n] = float(acc) * (xs[m] * ws[n])
 * (+ bias[n]). This file has the quantizer, the product of up to 32 rows (decode
 * batches: a GEMV reading each weight once, bandwidth-bound at a few rows; in AVX2, and
 * in AVX-512 VNNI compiled by target attributes) and the scaling; more rows go to torch's `_int_mm`
 * (oneDNN's int8 GEMM) on the same codes where the CPU has VNNI, and 32 at a time through
 * the GEMV where it has not (oneDNN's int8 GEMM is slow there). Every path's int32 sums are the very same
 * integers, so a row gives the same bits alone, in any batch, on either GEMV
 * (engine/int8.py; docs/design.md, section 20). */

#include <immintrin.h>
#include <stdint.h>
#include <omp.h>

#include "common.h"

#define QK 32          /* bytes of a weight row per step: K must be a multiple */
/* Software prefetch distance along a weight row (a thread's rows are contiguous, so it
 * runs on into the next ones): without it one decode step's int8 layers read 12.7 GB/s
 * where a plain read loop read 17.2; with it 18.3, in one run (design.md, 20). */
#define AHEAD 4096

static inline int32_t hsum_epi32(__m256i v) {
    __m128i s = _mm_add_epi32(_mm256_castsi256_si128(v), _mm256_extracti128_si256(v, 1));
    s = _mm_add_epi32(s, _mm_shuffle_epi32(s, _MM_SHUFFLE(1, 0, 3, 2)));
    s = _mm_add_epi32(s, _mm_shuffle_epi32(s, _MM_SHUFFLE(2, 3, 0, 1)));
    return _mm_cvtsi128_si32(s);
}

static inline __m256i load32(const int8_t *p) { return _mm256_loadu_si256((const __m256i *)p); }

/* One row of K floats (K % 8 == 0) into K int8 codes: x ~ code * (*scale). */
static void quantize_row(const float *x, int64_t K, int8_t *q, float *scale) {
    const __m256 sign_bit = _mm256_set1_ps(-0.0f);
    const int rounding = _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC;
    __m256 m = _mm256_setzero_ps();
    for (int64_t k = 0; k < K; k += 8) m = _mm256_max_ps(m, _mm256_andnot_ps(sign_bit, _mm256_loadu_ps(x + k)));
    const float amax = hmax(m);
    *scale = amax / 127.0f;
    const __m256 inv = _mm256_set1_ps(amax > 0.0f ? 127.0f / amax : 0.0f);
    int64_t k = 0;
    for (; k + 32 <= K; k += 32) {
        const __m256 v[4] = {_mm256_loadu_ps(x + k), _mm256_loadu_ps(x + k + 8), _mm256_loadu_ps(x + k + 16),
                             _mm256_loadu_ps(x + k + 24)};
        int8_codes32(v, inv, q + k);
    }
    for (; k < K; ++k) {
        float v = x[k] * (amax > 0.0f ? 127.0f / amax : 0.0f);
        __m128 r = _mm_round_ss(_mm_setzero_ps(), _mm_set_ss(v), rounding);
        q[k] = (int8_t)_mm_cvtss_si32(r);
    }
}

/* x [M, K] float32 -> xq [M, K] int8 and xs [M] float32, a row per thread at a time. */
void ruvllm_q8_quantize(const float *x, int64_t M, int64_t K, int8_t *xq, float *xs, int threads) {
    if (M == 1) {
        quantize_row(x, K, xq, xs);
        return;
    }
    #pragma omp parallel for num_threads(threads) schedule(static)
    for (int64_t m = 0; m < M; ++m) quantize_row(x + m * K, K, xq + m * K, xs + m);
}

#define ROWS 4         /* activation rows dot_pair takes at once */
#define FEW_ROWS 32    /* rows the GEMVs take (four at a time against a pair of weight rows in L1
                          in AVX2); more go to oneDNN */

/* Exact int32 dot products of `M` activation rows (|x| and x, 32 codes a step) with two
 * weight rows: maddubs(|x|, w signed by x) sums pairs within int16 (|x| <= 127). */
static inline void dot_pair(const int8_t *xa, const int8_t *xq, int M, int64_t K, const int8_t *w0,
                            const int8_t *w1, int32_t d[2][ROWS]) {
    const __m256i ones = _mm256_set1_epi16(1);
    __m256i a0[ROWS], a1[ROWS];
    for (int m = 0; m < M; ++m) a0[m] = a1[m] = _mm256_setzero_si256();
    for (int64_t k = 0; k < K; k += QK) {
        if (!(k & 32)) {   /* a cache line of each weight row, AHEAD bytes on */
            _mm_prefetch((const char *)(w0 + k + AHEAD), _MM_HINT_T0);
            _mm_prefetch((const char *)(w1 + k + AHEAD), _MM_HINT_T0);
        }
        __m256i v0 = load32(w0 + k), v1 = load32(w1 + k);
        for (int m = 0; m < M; ++m) {
            __m256i xabs = load32(xa + m * K + k), x = load32(xq + m * K + k);
            a0[m] = _mm256_add_epi32(a0[m], _mm256_madd_epi16(_mm256_maddubs_epi16(xabs, _mm256_sign_epi8(v0, x)), ones));
            a1[m] = _mm256_add_epi32(a1[m], _mm256_madd_epi16(_mm256_maddubs_epi16(xabs, _mm256_sign_epi8(v1, x)), ones));
            __asm__("" : "+x"(a0[m]), "+x"(a1[m]));   /* the sums in registers: GCC had spilled */
        }
    }
    for (int m = 0; m < M; ++m) {
        d[0][m] = hsum_epi32(a0[m]);
        d[1][m] = hsum_epi32(a1[m]);
    }
}

static void scale_rows(const int32_t *sums, int64_t M, int64_t N, const float *xs, const float *ws,
                       const float *bias, float *out);
void ruvllm_q8_scale(const int32_t *sums, int64_t M, int64_t N, const float *xs, const float *ws,
                     const float *bias, float *out, int threads);

/* M <= FEW_ROWS quantized rows (xq [M, K], scales xs [M]; xa room for M * K bytes)
 * against w [N, K] int8 with scales ws [N]: out [M, N] as ruvllm_q8_scale gives it. Each
 * pair of weight rows is read from memory once: four rows at a time go past it while it
 * sits in L1. */
static void q8_gemv(const int8_t *xq, const float *xs, int8_t *xa, int64_t M, int64_t K, const int8_t *w,
                    const float *ws, int64_t N, const float *bias, float *out, int32_t *sums, int threads) {
    for (int64_t k = 0; k < M * K; k += QK) _mm256_storeu_si256((__m256i *)(xa + k), _mm256_abs_epi8(load32(xq + k)));
    const int64_t pairs = (N + 1) / 2;
    #pragma omp parallel for num_threads(threads) schedule(static)
    for (int64_t p = 0; p < pairs; ++p) {
        const int64_t n = 2 * p, n1 = n + 1 < N ? n + 1 : n;   /* an odd last row is read twice */
        for (int64_t m0 = 0; m0 < M; m0 += ROWS) {
            const int8_t *a = xa + m0 * K, *x = xq + m0 * K;
            int32_t d[2][ROWS];
            switch (M - m0) {   /* a constant row count: the accumulators stay in registers */
                case 1: dot_pair(a, x, 1, K, w + n * K, w + n1 * K, d); break;
                case 2: dot_pair(a, x, 2, K, w + n * K, w + n1 * K, d); break;
                case 3: dot_pair(a, x, 3, K, w + n * K, w + n1 * K, d); break;
                default: dot_pair(a, x, 4, K, w + n * K, w + n1 * K, d); break;
            }
            for (int64_t m = m0; m < M && m < m0 + ROWS; ++m) {
                sums[m * N + n] = d[0][m - m0];
                sums[m * N + n1] = d[1][m - m0];
            }
        }
    }
    scale_rows(sums, M, N, xs, ws, bias, out);
}

/* ---- The GEMV in AVX-512 VNNI (the caller picks it where the CPU has it): `vpdpbusd`
 * multiplies unsigned by signed bytes and sums four products into each int32 lane, one
 * instruction for 64 codes where AVX2 takes four for 32. The activations go in offset
 * to unsigned (x + 128), and 128 times each weight row's sum, taken by the same
 * instruction against ones, comes off after: the same exact integers. ---- */
#define WIDE __attribute__((target("avx512f,avx512bw,avx512vl,avx512vnni")))

WIDE static inline __attribute__((always_inline)) void dot_pair_wide(const uint8_t *xu, int M, int64_t K,
                                                                   const int8_t *w0, const int8_t *w1,
                                                                   int32_t d[2][ROWS]) {
    const __m512i ones = _mm512_set1_epi8(1);
    __m512i a0[ROWS], a1[ROWS], s0 = _mm512_setzero_si512(), s1 = _mm512_setzero_si512();
    for (int m = 0; m < M; ++m) a0[m] = a1[m] = _mm512_setzero_si512();
    for (int64_t k = 0; k < K; k += 64) {
        const __mmask64 valid = K - k >= 64 ? ~(__mmask64)0 : ((__mmask64)1 << (K - k)) - 1;   /* K % 32 == 0 */
        _mm_prefetch((const char *)(w0 + k + AHEAD), _MM_HINT_T0);
        _mm_prefetch((const char *)(w1 + k + AHEAD), _MM_HINT_T0);
        const __m512i v0 = _mm512_maskz_loadu_epi8(valid, w0 + k), v1 = _mm512_maskz_loadu_epi8(valid, w1 + k);
        s0 = _mm512_dpbusd_epi32(s0, ones, v0);
        s1 = _mm512_dpbusd_epi32(s1, ones, v1);
        for (int m = 0; m < M; ++m) {
            const __m512i x = _mm512_maskz_loadu_epi8(valid, xu + m * K + k);
            a0[m] = _mm512_dpbusd_epi32(a0[m], x, v0);
            a1[m] = _mm512_dpbusd_epi32(a1[m], x, v1);
        }
    }
    const int32_t c0 = 128 * _mm512_reduce_add_epi32(s0), c1 = 128 * _mm512_reduce_add_epi32(s1);
    for (int m = 0; m < M; ++m) {
        d[0][m] = _mm512_reduce_add_epi32(a0[m]) - c0;
        d[1][m] = _mm512_reduce_add_epi32(a1[m]) - c1;
    }
}

/* q8_gemv in AVX-512 VNNI; xu: room for M * K bytes (the codes offset to unsigned). Up
 * to four rows dot_pair_wide, from five the groups below (q8_pair_groups). */
WIDE static void q8_pair_groups(const uint8_t *xu, int64_t M, int64_t K, const int8_t *w0, const int8_t *w1,
                                int64_t n, int64_t n1, int64_t N, int32_t *sums);

WIDE static void q8_gemv_wide(const int8_t *xq, const float *xs, uint8_t *xu, int64_t M, int64_t K,
                              const int8_t *w, const float *ws, int64_t N, const float *bias, float *out,
                              int32_t *sums, int threads) {
    const __m256i offset = _mm256_set1_epi8((char)0x80);
    for (int64_t k = 0; k < M * K; k += QK) _mm256_storeu_si256((__m256i *)(xu + k), _mm256_xor_si256(load32(xq + k), offset));
    const int64_t pairs = (N + 1) / 2;
    #pragma omp parallel for num_threads(threads) schedule(static)
    for (int64_t p = 0; p < pairs; ++p) {
        const int64_t n = 2 * p, n1 = n + 1 < N ? n + 1 : n;
        if (M > ROWS) {
            q8_pair_groups(xu, M, K, w + n * K, w + n1 * K, n, n1, N, sums);
            continue;
        }
        int32_t d[2][ROWS];
        switch (M) {
            case 1: dot_pair_wide(xu, 1, K, w + n * K, w + n1 * K, d); break;
            case 2: dot_pair_wide(xu, 2, K, w + n * K, w + n1 * K, d); break;
            case 3: dot_pair_wide(xu, 3, K, w + n * K, w + n1 * K, d); break;
            default: dot_pair_wide(xu, 4, K, w + n * K, w + n1 * K, d); break;
        }
        for (int64_t m = 0; m < M; ++m) {
            sums[m * N + n] = d[0][m];
            sums[m * N + n1] = d[1][m];
        }
    }
    if (M > ROWS) ruvllm_q8_scale(sums, M, N, xs, ws, bias, out, threads);
    else scale_rows(sums, M, N, xs, ws, bias, out);   /* a few rows: no parallel region */
}

/* Five to FEW_ROWS rows in AVX-512 VNNI (a batch of decodes, where oneDNN's int8 GEMM
 * took 43 ms for the 0.5B shape's layers at 8 rows against the GEMV's 20 at 4): each pair
 * of weight rows is read from memory once, for groups of up to eight activation rows (the
 * pair stays in L1 between groups), and 128 times each row's sum comes off as in
 * dot_pair_wide: the same exact integers. */
#define GROUP 8

WIDE static inline __attribute__((always_inline)) void dot_pair_group(const uint8_t *xu, int G, int64_t K,
                                                                    const int8_t *w0, const int8_t *w1,
                                                                    int32_t d0[GROUP], int32_t d1[GROUP]) {
    __m512i a0[GROUP], a1[GROUP];
    for (int g = 0; g < G; ++g) a0[g] = a1[g] = _mm512_setzero_si512();
    int64_t k = 0;
    for (; k + 64 <= K; k += 64) {
        const __m512i v0 = _mm512_loadu_si512(w0 + k), v1 = _mm512_loadu_si512(w1 + k);
        for (int g = 0; g < G; ++g) {
            const __m512i x = _mm512_loadu_si512(xu + g * K + k);
            a0[g] = _mm512_dpbusd_epi32(a0[g], x, v0);
            a1[g] = _mm512_dpbusd_epi32(a1[g], x, v1);
        }
    }
    if (k < K) {   /* K % 64 == 32: the last 32 codes */
        const __mmask64 valid = ((__mmask64)1 << (K - k)) - 1;
        const __m512i v0 = _mm512_maskz_loadu_epi8(valid, w0 + k), v1 = _mm512_maskz_loadu_epi8(valid, w1 + k);
        for (int g = 0; g < G; ++g) {
            const __m512i x = _mm512_maskz_loadu_epi8(valid, xu + g * K + k);
            a0[g] = _mm512_dpbusd_epi32(a0[g], x, v0);
            a1[g] = _mm512_dpbusd_epi32(a1[g], x, v1);
        }
    }
    for (int g = 0; g < G; ++g) {
        d0[g] = _mm512_reduce_add_epi32(a0[g]);
        d1[g] = _mm512_reduce_add_epi32(a1[g]);
    }
}

/* 128 times the sums of two weight rows (what the offset activations add), with the
 * rows prefetched AHEAD bytes on: the first pass over the pair, from memory. */
WIDE static inline __attribute__((always_inline)) void offsets_pair(int64_t K, const int8_t *w0, const int8_t *w1,
                                                                  int32_t *c0, int32_t *c1) {
    const __m512i ones = _mm512_set1_epi8(1);
    __m512i s0 = _mm512_setzero_si512(), s1 = _mm512_setzero_si512();
    for (int64_t k = 0; k < K; k += 64) {
        const __mmask64 valid = K - k >= 64 ? ~(__mmask64)0 : ((__mmask64)1 << (K - k)) - 1;
        _mm_prefetch((const char *)(w0 + k + AHEAD), _MM_HINT_T0);
        _mm_prefetch((const char *)(w1 + k + AHEAD), _MM_HINT_T0);
        s0 = _mm512_dpbusd_epi32(s0, ones, _mm512_maskz_loadu_epi8(valid, w0 + k));
        s1 = _mm512_dpbusd_epi32(s1, ones, _mm512_maskz_loadu_epi8(valid, w1 + k));
    }
    *c0 = 128 * _mm512_reduce_add_epi32(s0);
    *c1 = 128 * _mm512_reduce_add_epi32(s1);
}

/* Rows beyond four against one pair of weight rows n, n1: the pair's offsets, then each
 * group of up to eight rows while the pair sits in L1. */
WIDE static void q8_pair_groups(const uint8_t *xu, int64_t M, int64_t K, const int8_t *w0, const int8_t *w1,
                                int64_t n, int64_t n1, int64_t N, int32_t *sums) {
    int32_t c0, c1, d0[GROUP], d1[GROUP];
    offsets_pair(K, w0, w1, &c0, &c1);
    for (int64_t m0 = 0; m0 < M; m0 += GROUP) {
        const uint8_t *x = xu + m0 * K;
        const int G = (int)(M - m0 < GROUP ? M - m0 : GROUP);
#define DOTS(g) dot_pair_group(x, g, K, w0, w1, d0, d1)
        BY_GROUP(G, DOTS)   /* GROUP is 8: a constant group, the sums in registers */
#undef DOTS
        for (int g = 0; g < G; ++g) {
            sums[(m0 + g) * N + n] = d0[g] - c0;
            sums[(m0 + g) * N + n1] = d1[g] - c1;
        }
    }
}

static void scale_rows(const int32_t *sums, int64_t M, int64_t N, const float *xs, const float *ws,
                       const float *bias, float *out) {
    for (int64_t m = 0; m < M; ++m)
        for (int64_t n = 0; n < N; ++n) out[m * N + n] = (float)sums[m * N + n] * (xs[m] * ws[n]);
    if (bias != NULL)
        for (int64_t m = 0; m < M; ++m)
            for (int64_t n = 0; n < N; ++n) out[m * N + n] += bias[n];
}

/* Exact int32 sums [M, N] (oneDNN's, or the GEMV's) to out [M, N] float32:
 * float(sum) * (xs[m] * ws[n]), then + bias[n] if given: two roundings, in that order. */
void ruvllm_q8_scale(const int32_t *sums, int64_t M, int64_t N, const float *xs, const float *ws,
                     const float *bias, float *out, int threads) {
    #pragma omp parallel for num_threads(threads) schedule(static)
    for (int64_t m = 0; m < M; ++m) scale_rows(sums + m * N, 1, N, xs + m, ws, bias, out + m * N);
}

/* Rows end to end in one call (a decode step's layer; a prompt's on a CPU without VNNI,
 * FEW_ROWS at a time): x [M, K] float32 -> out [M, N], through `scratch` (for m =
 * min(M, FEW_ROWS): 2 * m * K + 4 * (m + 8) + 4 * m * N bytes, 32-byte aligned pieces):
 * quantize, then the GEMV (`wide`: the VNNI
 * one, or the VNNI GEMM from five rows). One call instead of three saves the per-call
 * cost that a decode step pays 169 times. */
static void linear_few(const float *x, int64_t M, int64_t K, const int8_t *w, const float *ws, int64_t N,
                       const float *bias, float *out, int8_t *scratch, int threads, int wide) {
    if (M == 0) return;   /* the GEMV's switch would take four rows */
    if (M > FEW_ROWS) {   /* a pass of FEW_ROWS rows at a time, reusing the scratch */
        const int64_t step = FEW_ROWS;
        for (int64_t m = 0; m < M; m += step)
            linear_few(x + m * K, M - m < step ? M - m : step, K, w, ws, N, bias, out + m * N, scratch, threads, wide);
        return;
    }
    int8_t *xq = scratch, *xa = scratch + M * K;
    float *xs = (float *)(scratch + 2 * M * K);
    int32_t *sums = (int32_t *)(xs + ((M + 7) & ~(int64_t)7));
    ruvllm_q8_quantize(x, M, K, xq, xs, threads);
    if (wide)
        q8_gemv_wide(xq, xs, (uint8_t *)xa, M, K, w, ws, N, bias, out, sums, threads);
    else
        q8_gemv(xq, xs, xa, M, K, w, ws, N, bias, out, sums, threads);
}

void ruvllm_q8_linear_few(const float *x, int64_t M, int64_t K, const int8_t *w, const float *ws, int64_t N,
                          const float *bias, float *out, int8_t *scratch, int threads) {
    linear_few(x, M, K, w, ws, N, bias, out, scratch, threads, 0);
}

/* The same through the AVX-512 VNNI GEMV (and from five rows to FEW_ROWS its GEMM):
 * the same bits, for CPUs with it. */
void ruvllm_q8_linear_few_wide(const float *x, int64_t M, int64_t K, const int8_t *w, const float *ws, int64_t N,
                               const float *bias, float *out, int8_t *scratch, int threads) {
    linear_few(x, M, K, w, ws, N, bias, out, scratch, threads, 1);
}
