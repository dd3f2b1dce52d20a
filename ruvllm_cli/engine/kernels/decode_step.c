/* The work between the linear layers of a Llama-family decode step, fused into four
 * calls a layer (engine/fused.py): residual add + RMSNorm, RoPE of q and k + the KV
 * cache write, attention over each request's cache blocks, SiLU(gate) * up.
 *
 * Activations are float32 or bfloat16 (`bf16` flag), the KV cache float32, bfloat16 or
 * float16 (`kv`: float16 beside float32 activations); arithmetic is float32. In bfloat16
 * every value transformers rounds (after each elementwise op) is rounded here at the
 * same point, so the residual stream and RoPE match it; RMSNorm and softmax sum in
 * another order, and the attention keeps its scores in float32 where transformers
 * rounds them to bfloat16, so logits agree within a bound (tests/engine/test_fused.py).
 * With -ffp-contract=off, the elementwise float32 ops round as torch's do. */

#include <immintrin.h>
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <omp.h>

#include "common.h"

typedef int64_t i64;

/* The dtype of an array: 0 float32, 1 bfloat16, 2 float16 (a KV cache beside float32
 * activations). Activations are float32 or bfloat16 only. */
enum { F32 = 0, BF16 = 1, F16 = 2 };

/* n values of an array of `kind` from `start`, into float32. */
static void load_row(const void *src, i64 start, i64 n, int kind, float *dst) {
    if (kind == F32) {
        memcpy(dst, (const float *)src + start, (size_t)n * 4);
        return;
    }
    const uint16_t *s = (const uint16_t *)src + start;
    if (kind == F16)
        for (i64 i = 0; i < n; ++i) dst[i] = _cvtsh_ss(s[i]);
    else
        for (i64 i = 0; i < n; ++i) dst[i] = bf16_load(s[i]);
}

/* Eight values as the activation dtype holds them (`held`, vectorized). */
static inline __m256 held8(__m256 v, int bf16) { return bf16 ? bf16_held8(v) : v; }

/* n float32 values into an array of `kind` from `start`, rounded to nearest even, eight
 * at a time (held8's rounding, the same bits as bf16_round's; F16C's conversion). */
static void store_row(const float *src, i64 n, int kind, void *dst, i64 start) {
    if (kind == F32) {
        memcpy((float *)dst + start, src, (size_t)n * 4);
        return;
    }
    uint16_t *d = (uint16_t *)dst + start;
    i64 i = 0;
    if (kind == F16) {
        for (; i + 8 <= n; i += 8)
            _mm_storeu_si128((__m128i *)(d + i), _mm256_cvtps_ph(_mm256_loadu_ps(src + i), _MM_FROUND_TO_NEAREST_INT));
        for (; i < n; ++i) d[i] = _cvtss_sh(src[i], _MM_FROUND_TO_NEAREST_INT);
        return;
    }
    for (; i + 8 <= n; i += 8) _mm_storeu_si128((__m128i *)(d + i), bf16_pack8(bf16_held8(_mm256_loadu_ps(src + i))));
    for (; i < n; ++i) d[i] = bf16_round(src[i]);
}

/* A value as the activation dtype holds it: rounded to bfloat16, or as is. */
static inline float held(float v, int bf16) { return bf16 ? bf16_load(bf16_round(v)) : v; }

/* Eight values of an array of `kind` as float32. */
static inline __m256 load8(const void *base, i64 at, int kind) {
    if (kind == F32) return _mm256_loadu_ps((const float *)base + at);
    __m128i h = _mm_loadu_si128((const __m128i *)((const uint16_t *)base + at));
    if (kind == F16) return _mm256_cvtph_ps(h);
    return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
}

/* exp's constants: its range, log2(e), ln 2 in two parts, and e^r's series (highest first). */
static const float EXP_LOW = -87.0f, EXP_HIGH = 88.0f, LOG2E = 1.44269504f, LN2_HI = 0.693145752f,
                   LN2_LO = 1.42860677e-6f;
static const float EXP_SERIES[8] = {1.0f / 5040, 1.0f / 720, 1.0f / 120, 1.0f / 24, 1.0f / 6, 0.5f, 1.0f, 1.0f};

/* exp(x) for eight floats: 2^n * e^r with |r| <= ln2/2, r's series to degree 7
 * (truncation below float32's precision; within 2 ulp of expf). */
static inline __m256 exp8(__m256 x) {
    x = _mm256_min_ps(_mm256_max_ps(x, _mm256_set1_ps(EXP_LOW)), _mm256_set1_ps(EXP_HIGH));
    const __m256 n = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(LOG2E)),
                                     _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    __m256 r = _mm256_sub_ps(x, _mm256_mul_ps(n, _mm256_set1_ps(LN2_HI)));
    r = _mm256_sub_ps(r, _mm256_mul_ps(n, _mm256_set1_ps(LN2_LO)));
    __m256 p = _mm256_set1_ps(EXP_SERIES[0]);
    for (int i = 1; i < 8; ++i) p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(EXP_SERIES[i]));
    const __m256i scale = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
    return _mm256_mul_ps(p, _mm256_castsi256_ps(scale));
}

/* x += delta (when delta is not NULL), then out = RMSNorm(x) * weight, row by row, in
 * transformers' order: x * rsqrt(mean(x^2) + eps), held in the dtype, times the weight.
 * Rows split over the threads from four rows on. */
static void add_rms_norm8(void *x, const void *delta, const void *weight, void *out,
                          i64 rows, i64 width, float eps, int bf16, int threads) {
    #pragma omp parallel num_threads(threads) if (rows >= 4)
    {
        float *row = malloc((size_t)width * 3 * sizeof(float));
        float *add = row + width, *w = row + 2 * width;
        load_row(weight, 0, width, bf16, w);
        #pragma omp for schedule(static)
        for (i64 r = 0; r < rows; ++r) {
            load_row(x, r * width, width, bf16, row);
            if (delta != NULL) {
                load_row(delta, r * width, width, bf16, add);
                for (i64 i = 0; i < width; ++i) row[i] = held(row[i] + add[i], bf16);
                store_row(row, width, bf16, x, r * width);
            }
            __m256 squares = _mm256_setzero_ps();
            i64 i = 0;
            for (; i + 8 <= width; i += 8)
                squares = _mm256_fmadd_ps(_mm256_loadu_ps(row + i), _mm256_loadu_ps(row + i), squares);
            float sum = hsum(squares);
            for (; i < width; ++i) sum += row[i] * row[i];
            const float inv = 1.0f / sqrtf(sum / (float)width + eps);
            for (i64 i = 0; i < width; ++i) row[i] = w[i] * held(row[i] * inv, bf16);
            store_row(row, width, bf16, out, r * width);
        }
        free(row);
    }
}

/* transformers' x * cos + rotate_half(x) * sin for each head of one row, in place;
 * rotate_half(x) = cat(-x[D/2:], x[:D/2]). cos and sin: [D] of this row's position.
 * Eight values at a time where D/2 allows, each product and sum held as transformers'. */
static void rope_row(float *x, i64 heads, i64 dim, const float *cos, const float *sin, int bf16) {
    const i64 half = dim / 2, wide = half % 8 == 0 ? half : 0;
    for (i64 h = 0; h < heads; ++h, x += dim) {
        for (i64 i = 0; i < wide; i += 8) {
            const __m256 a = _mm256_loadu_ps(x + i), b = _mm256_loadu_ps(x + i + half);
            const __m256 minus_b = _mm256_xor_ps(b, _mm256_set1_ps(-0.0f));
            const __m256 first = held8(_mm256_add_ps(held8(_mm256_mul_ps(a, _mm256_loadu_ps(cos + i)), bf16),
                                                     held8(_mm256_mul_ps(minus_b, _mm256_loadu_ps(sin + i)), bf16)), bf16);
            const __m256 second = held8(_mm256_add_ps(held8(_mm256_mul_ps(b, _mm256_loadu_ps(cos + i + half)), bf16),
                                                      held8(_mm256_mul_ps(a, _mm256_loadu_ps(sin + i + half)), bf16)), bf16);
            _mm256_storeu_ps(x + i, first);
            _mm256_storeu_ps(x + i + half, second);
        }
        for (i64 i = wide; i < half; ++i) {
            const float a = x[i], b = x[i + half];
            x[i] = held(held(a * cos[i], bf16) + held(-b * sin[i], bf16), bf16);
            x[i + half] = held(held(b * cos[i + half], bf16) + held(a * sin[i + half], bf16), bf16);
        }
    }
}

/* RoPE of q (in place) and k, then k and v written to each row's cache slot, the rows
 * split over the threads from four on. q: [T, Hq*D], k and v: [T, Hkv*D], cos/sin:
 * [T, D]; caches [Hkv, cache_slots, D] of `kv` kind. */
void ruvllm_rope_store(void *q, const void *k, const void *v, const void *cos, const void *sin,
                       i64 rows, i64 q_heads, i64 kv_heads, i64 dim, void *k_cache, void *v_cache,
                       i64 cache_slots, const i64 *slots, int bf16, int kv, int threads) {
    const i64 qw = q_heads * dim, kw = kv_heads * dim;
    const size_t item = bf16 ? 2 : 4;
    #pragma omp parallel num_threads(threads) if (rows >= 4)
    {
        float *buf = malloc((size_t)(qw + 2 * kw + 2 * dim) * sizeof(float));
        float *kb = buf + qw, *vb = kb + kw, *c = vb + kw, *s = c + dim;
        #pragma omp for schedule(static)
        for (i64 t = 0; t < rows; ++t) {
            load_row(cos, t * dim, dim, bf16, c);
            load_row(sin, t * dim, dim, bf16, s);
            load_row(q, t * qw, qw, bf16, buf);
            rope_row(buf, q_heads, dim, c, s, bf16);
            store_row(buf, qw, bf16, q, t * qw);
            load_row(k, t * kw, kw, bf16, kb);
            rope_row(kb, kv_heads, dim, c, s, bf16);
            if (kv != bf16) load_row(v, t * kw, kw, bf16, vb);
            for (i64 h = 0; h < kv_heads; ++h) {
                const i64 at = (h * cache_slots + slots[t]) * dim;
                store_row(kb + h * dim, dim, kv, k_cache, at);
                if (kv == bf16)   /* the activations' own dtype: copied as they are */
                    memcpy((char *)v_cache + at * item, (const char *)v + (t * kw + h * dim) * item, (size_t)dim * item);
                else
                    store_row(vb + h * dim, dim, kv, v_cache, at);
            }
        }
        free(buf);
    }
}

/* Eight accumulators' sums as one vector, in order. */
static inline __m256 hsum8(const __m256 a[8]) {
    const __m256 u0 = _mm256_hadd_ps(_mm256_hadd_ps(a[0], a[1]), _mm256_hadd_ps(a[2], a[3]));
    const __m256 u1 = _mm256_hadd_ps(_mm256_hadd_ps(a[4], a[5]), _mm256_hadd_ps(a[6], a[7]));
    return _mm256_add_ps(_mm256_permute2f128_ps(u0, u1, 0x20), _mm256_permute2f128_ps(u0, u1, 0x31));
}

/* q . k * scale for the eight keys at `rows` of one query head: eight independent sums
 * advancing together (one chain of dependent FMAs per key would wait on latency). */
static inline __attribute__((always_inline)) __m256 scores8(const float *qf, i64 dim, const void *k_cache, const i64 *rows, int kv, __m256 scale) {
    __m256 acc[8];
    for (int r = 0; r < 8; ++r) acc[r] = _mm256_setzero_ps();
    for (i64 d = 0; d < dim; d += 8) {
        const __m256 query = _mm256_loadu_ps(qf + d);
        for (int r = 0; r < 8; ++r) acc[r] = _mm256_fmadd_ps(query, load8(k_cache, rows[r] + d, kv), acc[r]);
    }
    return _mm256_mul_ps(hsum8(acc), scale);
}

/* p = softmax(p) over n scores (n % 8 == 0: the tail is padded with -inf). */
static void softmax(float *p, i64 n) {
    __m256 top = _mm256_set1_ps(-INFINITY);
    for (i64 j = 0; j < n; j += 8) top = _mm256_max_ps(top, _mm256_loadu_ps(p + j));
    float lanes[8], high = -INFINITY;
    _mm256_storeu_ps(lanes, top);
    for (int i = 0; i < 8; ++i) high = lanes[i] > high ? lanes[i] : high;
    const __m256 shift = _mm256_set1_ps(high);
    __m256 total = _mm256_setzero_ps();
    for (i64 j = 0; j < n; j += 8) {
        const __m256 e = exp8(_mm256_sub_ps(_mm256_loadu_ps(p + j), shift));
        _mm256_storeu_ps(p + j, e);
        total = _mm256_add_ps(total, e);
    }
    const __m256 inv = _mm256_set1_ps(1.0f / hsum(total));
    for (i64 j = 0; j < n; j += 8) _mm256_storeu_ps(p + j, _mm256_mul_ps(_mm256_loadu_ps(p + j), inv));
}

/* out[0, width) = sum over j of p[j] * (value row j)[d0, d0 + width), width <= 64: up
 * to eight accumulators, kept in registers by the constant trip count of the full case. */
static inline __attribute__((always_inline)) void weighted_values(
        const float *p, i64 length, const void *v_cache, const i64 *rows, i64 d0, i64 width, int kv, float *out) {
    __m256 acc[8];
    for (int v = 0; v < 8; ++v) acc[v] = _mm256_setzero_ps();
    if (width == 64) {
        for (i64 j = 0; j < length; ++j) {
            const __m256 weight = _mm256_set1_ps(p[j]);
            for (int v = 0; v < 8; ++v) acc[v] = _mm256_fmadd_ps(weight, load8(v_cache, rows[j] + d0 + 8 * v, kv), acc[v]);
        }
    } else {
        for (i64 j = 0; j < length; ++j) {
            const __m256 weight = _mm256_set1_ps(p[j]);
            for (i64 v = 0; v < width / 8; ++v)
                acc[v] = _mm256_fmadd_ps(weight, load8(v_cache, rows[j] + d0 + 8 * v, kv), acc[v]);
        }
    }
    for (i64 v = 0; v < width / 8; ++v) _mm256_storeu_ps(out + 8 * v, acc[v]);
}

/* The G query heads sharing one KV head, for one request of `length` cached tokens:
 * scores over every cached key, softmax, and the weighted sum of values. qf: [G, D]
 * float32; rows: each token's offset in the caches, padded to a multiple of 8 with
 * token 0's; scores: [G, padded]; out: [G, D] float32. dim % 8 == 0. */
static inline __attribute__((always_inline)) void attend(const float *qf, i64 groups, i64 dim, const void *k_cache, const void *v_cache,
                   const i64 *rows, i64 length, float scale, int kv, float *scores, float *out) {
    const i64 padded = (length + 7) / 8 * 8;
    const __m256 scaled = _mm256_set1_ps(scale);
    for (i64 j = 0; j < padded; j += 8)   /* eight keys stay in L1 for the G heads */
        for (i64 g = 0; g < groups; ++g)
            _mm256_storeu_ps(scores + g * padded + j, scores8(qf + g * dim, dim, k_cache, rows + j, kv, scaled));
    for (i64 g = 0; g < groups; ++g) {
        float *p = scores + g * padded;
        for (i64 j = length; j < padded; ++j) p[j] = -INFINITY;
        softmax(p, padded);
    }
    for (i64 g = 0; g < groups; ++g)
        for (i64 d0 = 0; d0 < dim; d0 += 64)
            weighted_values(scores + g * padded, length, v_cache, rows, d0, dim - d0 < 64 ? dim - d0 : 64, kv,
                            out + g * dim + d0);
}

/* ---- The attention in AVX-512, for CPUs that have it (the caller's `wide`): sixteen
 * lanes, each block of sixteen keys converted to float32 and transposed once for the G
 * heads sharing it (a head's sixteen scores come out of one vector, no sum across
 * lanes), the G heads' softmaxes side by side, and each value row read once for all of
 * them, their sums held in registers. The rest of
 * the file stays AVX2: these functions alone are compiled for AVX-512 (target
 * attributes), so the one build runs on every AVX2 CPU. ---- */
#define AVX512 __attribute__((target("avx512f,avx512bw,avx512vl,avx512dq"), always_inline)) static inline
#define AVX512_OUTER __attribute__((target("avx512f,avx512bw,avx512vl,avx512dq"))) static

/* Sixteen values of an array of `kind` as float32. */
AVX512 __m512 load16(const void *base, i64 at, int kind) {
    if (kind == F32) return _mm512_loadu_ps((const float *)base + at);
    const __m256i h = _mm256_loadu_si256((const __m256i *)((const uint16_t *)base + at));
    if (kind == F16) return _mm512_cvtph_ps(h);
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
}

/* The 16x16 block of floats a[0..15] transposed in place. */
AVX512 void transpose16(__m512 a[16]) {
    __m512 t[16];
    for (int i = 0; i < 8; ++i) {
        t[2 * i] = _mm512_unpacklo_ps(a[2 * i], a[2 * i + 1]);
        t[2 * i + 1] = _mm512_unpackhi_ps(a[2 * i], a[2 * i + 1]);
    }
    for (int i = 0; i < 4; ++i)
        for (int h = 0; h < 2; ++h) {
            const __m512d x = _mm512_castps_pd(t[4 * i + h]), y = _mm512_castps_pd(t[4 * i + 2 + h]);
            a[4 * i + 2 * h] = _mm512_castpd_ps(_mm512_unpacklo_pd(x, y));
            a[4 * i + 2 * h + 1] = _mm512_castpd_ps(_mm512_unpackhi_pd(x, y));
        }
    for (int i = 0; i < 2; ++i)
        for (int h = 0; h < 4; ++h) {
            t[8 * i + h] = _mm512_shuffle_f32x4(a[8 * i + h], a[8 * i + 4 + h], 0x88);
            t[8 * i + 4 + h] = _mm512_shuffle_f32x4(a[8 * i + h], a[8 * i + 4 + h], 0xdd);
        }
    for (int h = 0; h < 8; ++h) {
        a[h] = _mm512_shuffle_f32x4(t[h], t[8 + h], 0x88);
        a[8 + h] = _mm512_shuffle_f32x4(t[h], t[8 + h], 0xdd);
    }
}

/* G heads (a constant) against one block of sixteen keys held by dimension (kt[d]: the
 * sixteen keys' values at d): two sums a head, over even and odd d. */
AVX512 void block_scores(const float *qf, i64 dim, const float *kt, const int G, __m512 scaled, float *scores,
                         i64 stride) {
    __m512 a[8][2];
    for (int g = 0; g < G; ++g) a[g][0] = a[g][1] = _mm512_setzero_ps();
    for (i64 d = 0; d < dim; d += 2)
        for (int h = 0; h < 2; ++h) {
            const __m512 k = _mm512_loadu_ps(kt + (d + h) * 16);
            for (int g = 0; g < G; ++g) a[g][h] = _mm512_fmadd_ps(_mm512_set1_ps(qf[g * dim + d + h]), k, a[g][h]);
        }
    for (int g = 0; g < G; ++g) _mm512_storeu_ps(scores + g * stride, _mm512_mul_ps(_mm512_add_ps(a[g][0], a[g][1]), scaled));
}

/* scores[g][j] = q_g . k_j * scale for j < padded (a multiple of 16): each block of
 * sixteen keys converted to float32 and transposed once (into kt) for the G heads. */
AVX512 void scores16(const float *qf, i64 groups, i64 dim, const void *k_cache, const i64 *rows, i64 padded,
                     float scale, int kv, float *scores, i64 stride, float *kt) {
    const __m512 scaled = _mm512_set1_ps(scale);
    for (i64 j0 = 0; j0 < padded; j0 += 16) {
        for (i64 d = 0; d < dim; d += 16) {
            __m512 a[16];
            for (int k = 0; k < 16; ++k) a[k] = load16(k_cache, rows[j0 + k] + d, kv);
            transpose16(a);
            for (int i = 0; i < 16; ++i) _mm512_storeu_ps(kt + (d + i) * 16, a[i]);
        }
        for (i64 g0 = 0; g0 < groups; g0 += 8) {
            const float *q = qf + g0 * dim;
            float *s = scores + g0 * stride + j0;
#define SCORES(G) block_scores(q, dim, kt, G, scaled, s, stride)
            BY_GROUP(groups - g0, SCORES)
#undef SCORES
        }
    }
}

/* out[g][d0, d0 + 16W) = inv[g] * sum over j of p[g][j] * (value row j), every head's
 * sums held in registers while each value row is read once (p: the softmax's exps, inv:
 * one over their sum). G * W <= 28. */
AVX512 void values_block(const float *p, i64 stride, i64 length, const void *v_cache, const i64 *rows,
                         i64 d0, int kv, const float *inv, float *out, i64 dim, const int G, const int W) {
    __m512 acc[8][4];
    for (int g = 0; g < G; ++g)
        for (int w = 0; w < W; ++w) acc[g][w] = _mm512_setzero_ps();
    for (i64 j = 0; j < length; ++j) {
        __m512 v[4];
        for (int w = 0; w < W; ++w) v[w] = load16(v_cache, rows[j] + d0 + 16 * w, kv);
        for (int g = 0; g < G; ++g) {
            const __m512 weight = _mm512_set1_ps(p[g * stride + j]);
            for (int w = 0; w < W; ++w) acc[g][w] = _mm512_fmadd_ps(weight, v[w], acc[g][w]);
        }
    }
    for (int g = 0; g < G; ++g)
        for (int w = 0; w < W; ++w)
            _mm512_storeu_ps(out + g * dim + d0 + 16 * w, _mm512_mul_ps(acc[g][w], _mm512_set1_ps(inv[g])));
}

/* values_block over every head and slice: one (G, W) instance per case, so that the trip
 * counts are constants and the sums stay in registers. */
AVX512 void values16(const float *p, i64 stride, i64 groups, i64 length, const void *v_cache, const i64 *rows,
                     i64 dim, int kv, const float *inv, float *out) {
    const i64 vectors = dim / 16;
    for (i64 g0 = 0; g0 < groups; g0 += 8) {   /* more than eight heads to a KV head: blocks of eight */
        const int G = (int)(groups - g0 < 8 ? groups - g0 : 8);
        int W = 4;   /* the widest slice of 16W values (W divides dim / 16) whose G x W sums fit */
        while (W > 1 && (vectors % W != 0 || G * W > 28)) --W;
        const float *pg = p + g0 * stride, *ig = inv + g0;
        float *og = out + g0 * dim;
        for (i64 d0 = 0; d0 < dim; d0 += 16 * W) {
#define CASE(g, w) case (g) * 8 + (w): values_block(pg, stride, length, v_cache, rows, d0, kv, ig, og, dim, g, w); break;
            switch (G * 8 + W) {
                CASE(1, 1) CASE(1, 2) CASE(1, 3) CASE(1, 4) CASE(2, 1) CASE(2, 2) CASE(2, 3) CASE(2, 4)
                CASE(3, 1) CASE(3, 2) CASE(3, 3) CASE(3, 4) CASE(4, 1) CASE(4, 2) CASE(4, 3) CASE(4, 4)
                CASE(5, 1) CASE(5, 2) CASE(5, 3) CASE(5, 4) CASE(6, 1) CASE(6, 2) CASE(6, 3) CASE(6, 4)
                CASE(7, 1) CASE(7, 2) CASE(7, 3) CASE(7, 4) CASE(8, 1) CASE(8, 2) CASE(8, 3)
            }
#undef CASE
        }
    }
}

/* exp(x) for sixteen floats, exp8's steps in sixteen lanes (the same rounding). */
AVX512 __m512 exp16(__m512 x) {
    x = _mm512_min_ps(_mm512_max_ps(x, _mm512_set1_ps(EXP_LOW)), _mm512_set1_ps(EXP_HIGH));
    const __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(LOG2E)),
                                          _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    __m512 r = _mm512_sub_ps(x, _mm512_mul_ps(n, _mm512_set1_ps(LN2_HI)));
    r = _mm512_sub_ps(r, _mm512_mul_ps(n, _mm512_set1_ps(LN2_LO)));
    __m512 p = _mm512_set1_ps(EXP_SERIES[0]);
    for (int i = 1; i < 8; ++i) p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(EXP_SERIES[i]));
    const __m512i scale = _mm512_slli_epi32(_mm512_add_epi32(_mm512_cvtps_epi32(n), _mm512_set1_epi32(127)), 23);
    return _mm512_mul_ps(p, _mm512_castsi512_ps(scale));
}

/* softmax() over each of G rows of n scores (row g at p + g * n), n % 16 == 0 (the tail
 * padded with -inf), the rows side by side: G independent chains at each pass, and each
 * row's values taken in the same order as alone. The rows keep their exps; inv[g] is
 * one over row g's sum, applied to the weighted sum of values instead (values_block):
 * a pass over the scores fewer. */
AVX512 void softmax_rows(float *p, i64 n, const int G, float *inv) {
    __m512 top[8], total[8], shift[8];
    for (int g = 0; g < G; ++g) top[g] = _mm512_set1_ps(-INFINITY), total[g] = _mm512_setzero_ps();
    for (i64 j = 0; j < n; j += 16)
        for (int g = 0; g < G; ++g) top[g] = _mm512_max_ps(top[g], _mm512_loadu_ps(p + g * n + j));
    for (int g = 0; g < G; ++g) shift[g] = _mm512_set1_ps(_mm512_reduce_max_ps(top[g]));
    for (i64 j = 0; j < n; j += 16)
        for (int g = 0; g < G; ++g) {
            const __m512 e = exp16(_mm512_sub_ps(_mm512_loadu_ps(p + g * n + j), shift[g]));
            _mm512_storeu_ps(p + g * n + j, e);
            total[g] = _mm512_add_ps(total[g], e);
        }
    for (int g = 0; g < G; ++g) inv[g] = 1.0f / _mm512_reduce_add_ps(total[g]);
}

/* softmax_rows over `groups` rows, eight at a time, G a constant in each instance. */
AVX512_OUTER void softmax16(float *p, i64 n, i64 groups, float *inv) {
    for (i64 g0 = 0; g0 < groups; g0 += 8) {
        float *pg = p + g0 * n, *ig = inv + g0;
#define SOFTMAX(G) softmax_rows(pg, n, G, ig)
        BY_GROUP(groups - g0, SOFTMAX)
#undef SOFTMAX
    }
}

/* ---- CPUs with AVX-512 BF16 as well (`wide` 2): its conversion rounds sixteen floats to
 * bfloat16 in one instruction, and its dot product multiplies pairs of bfloat16 values.
 * The functions below that take a `cvt` flag are compiled with BF16 allowed but run it
 * only where the flag is set (only these intrinsics emit its instructions), so they also
 * serve AVX-512 CPUs without it. ---- */
#define AVX512_BF16 __attribute__((target("avx512f,avx512bw,avx512vl,avx512dq,avx512bf16"), always_inline)) static inline
#define AVX512_BF16_OUTER __attribute__((target("avx512f,avx512bw,avx512vl,avx512dq,avx512bf16"))) static

/* bf16_pack16(bf16_held16(v)), the same bits: vcvtneps2bf16 rounds to nearest even and
 * quiets a NaN as bf16_round does, but takes a subnormal input for zero, so a vector
 * holding one (never in practice) goes the integer way. */
AVX512_BF16 __m256i bf16_pack16_cvt(__m512 v) {
    if (__builtin_expect(_mm512_fpclass_ps_mask(v, 0x20) != 0, 0)) return bf16_pack16(bf16_held16(v));
    return (__m256i)_mm512_cvtneps_pbh(v);
}

/* bf16_held16(v): by the conversion above where `cvt` (the same bits). */
AVX512_BF16 __m512 held16(__m512 v, int cvt) {
    if (!cvt) return bf16_held16(v);
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(bf16_pack16_cvt(v)), 16));
}

/* Sixteen float32 values into an array of activations, rounded to bfloat16 where `bf16`
 * (by the conversion instruction where `cvt`). */
AVX512_BF16 void store16_rounded(void *base, i64 at, int bf16, int cvt, __m512 v) {
    if (!bf16) _mm512_storeu_ps((float *)base + at, v);
    else _mm256_storeu_si256((__m256i *)((uint16_t *)base + at), cvt ? bf16_pack16_cvt(v) : bf16_pack16(bf16_held16(v)));
}

/* Sixteen float32 values into an array of activations (float32, or bfloat16 already
 * held: its high half is the value). */
AVX512 void store16(void *base, i64 at, int bf16, __m512 held) {
    if (bf16) _mm256_storeu_si256((__m256i *)((uint16_t *)base + at), bf16_pack16(held));
    else _mm512_storeu_ps((float *)base + at, held);
}

/* add_rms_norm8 in sixteen lanes, on the arrays in place (no copies of each row), for a
 * width that is a multiple of 16: the same operations on each value; the squares summed
 * in four chains (another order). */
AVX512_BF16_OUTER void add_rms_norm16(void *x, const void *delta, const void *weight, void *out, i64 rows,
                                      i64 width, float eps, int bf16, int cvt, int threads) {
    const int kind = bf16 ? BF16 : F32;
    #pragma omp parallel for num_threads(threads) schedule(static) if (rows >= 4)
    for (i64 r = 0; r < rows; ++r) {
        const i64 row = r * width;
        __m512 squares[4] = {_mm512_setzero_ps(), _mm512_setzero_ps(), _mm512_setzero_ps(), _mm512_setzero_ps()};
        for (i64 i = 0; i < width; i += 16) {
            __m512 v = load16(x, row + i, kind);
            if (delta != NULL) {
                v = _mm512_add_ps(v, load16(delta, row + i, kind));
                if (bf16) v = held16(v, cvt);
                store16(x, row + i, bf16, v);
            }
            squares[i / 16 % 4] = _mm512_fmadd_ps(v, v, squares[i / 16 % 4]);
        }
        const float sum = _mm512_reduce_add_ps(_mm512_add_ps(_mm512_add_ps(squares[0], squares[1]),
                                                             _mm512_add_ps(squares[2], squares[3])));
        const __m512 inv = _mm512_set1_ps(1.0f / sqrtf(sum / (float)width + eps));
        for (i64 i = 0; i < width; i += 16) {
            __m512 v = _mm512_mul_ps(load16(x, row + i, kind), inv);
            if (bf16) v = held16(v, cvt);
            store16_rounded(out, row + i, bf16, cvt, _mm512_mul_ps(load16(weight, i, kind), v));
        }
    }
}

/* x += delta (when delta is not NULL), then out = RMSNorm(x) * weight, row by row, in
 * transformers' order: `wide` (AVX-512) where the width is a multiple of 16, else in
 * eight lanes. */
void ruvllm_add_rms_norm(void *x, const void *delta, const void *weight, void *out, i64 rows, i64 width, float eps,
                         int bf16, int wide, int threads) {
    if (wide && width % 16 == 0) add_rms_norm16(x, delta, weight, out, rows, width, eps, bf16, wide >= 2, threads);
    else add_rms_norm8(x, delta, weight, out, rows, width, eps, bf16, threads);
}

/* ruvllm_silu_mul in sixteen lanes, in place on the arrays (no copies of each chunk):
 * the same operations on each value (exp16 rounds as exp8 does), so the same bits. The
 * last eight values of a count that is not a multiple of sixteen take exp8. */
AVX512_BF16_OUTER void silu_mul16(void *gate, const void *up, i64 count, int bf16, int cvt, int threads) {
    const i64 chunk = 1024, chunks = (count + chunk - 1) / chunk;
    #pragma omp parallel for num_threads(threads) schedule(static) if (chunks > 1)
    for (i64 c = 0; c < chunks; ++c) {
        const i64 end = (c + 1) * chunk < count ? (c + 1) * chunk : count;
        i64 i = c * chunk;
        for (; i + 16 <= end; i += 16) {
            const __m512 x = load16(gate, i, bf16), one = _mm512_set1_ps(1.0f);
            const __m512 silu = _mm512_div_ps(x, _mm512_add_ps(one, exp16(_mm512_sub_ps(_mm512_setzero_ps(), x))));
            const __m512 product = _mm512_mul_ps(bf16 ? held16(silu, cvt) : silu, load16(up, i, bf16));
            store16_rounded(gate, i, bf16, cvt, product);
        }
        for (; i < end; i += 8) {
            const __m256 x = load8(gate, i, bf16), one = _mm256_set1_ps(1.0f);
            const __m256 silu = _mm256_div_ps(x, _mm256_add_ps(one, exp8(_mm256_sub_ps(_mm256_setzero_ps(), x))));
            float product[8];
            _mm256_storeu_ps(product, held8(_mm256_mul_ps(held8(silu, bf16), load8(up, i, bf16)), bf16));
            store_row(product, 8, bf16, gate, i);
        }
    }
}

/* block_scores for bfloat16 queries and keys: kt[i] holds the sixteen keys' values at
 * dimensions 2i and 2i + 1 side by side, qp each head's values in the same pairs; one dot
 * product instruction takes a pair (the products exact in float32, summed in another
 * order). */
AVX512_BF16 void block_scores_dot(const uint32_t *qp, i64 pairs, const __m512i *kt, const int G, __m512 scaled,
                                  float *scores, i64 stride) {
    __m512 a[8][2];
    for (int g = 0; g < G; ++g) a[g][0] = a[g][1] = _mm512_setzero_ps();
    for (i64 i = 0; i < pairs; i += 2)
        for (int h = 0; h < 2; ++h) {
            const __m512bh k = (__m512bh)_mm512_load_si512(kt + i + h);
            for (int g = 0; g < G; ++g)
                a[g][h] = _mm512_dpbf16_ps(a[g][h], (__m512bh)_mm512_set1_epi32((int)qp[g * pairs + i + h]), k);
        }
    for (int g = 0; g < G; ++g) _mm512_storeu_ps(scores + g * stride, _mm512_mul_ps(_mm512_add_ps(a[g][0], a[g][1]), scaled));
}

/* scores16 for a bfloat16 cache and bfloat16 queries (qb: [groups, dim]), dim % 32 == 0:
 * each block of sixteen keys transposed as pairs of values (32-bit units, no conversion),
 * half the shuffles and multiplies of the float32 way. kt: 64-byte aligned. */
AVX512_BF16_OUTER void scores16_dot(const uint16_t *qb, i64 groups, i64 dim, const uint16_t *k_cache,
                                    const uint16_t *v_cache, const i64 *rows, i64 padded, float scale, float *scores,
                                    i64 stride, __m512i *kt) {
    const __m512 scaled = _mm512_set1_ps(scale);
    const i64 pairs = dim / 2;
    const uint32_t *qp = (const uint32_t *)qb;
    for (i64 j0 = 0; j0 < padded; j0 += 16) {
        /* The cache is read from L3 at 16 streams (about 1 MiB a layer): the next block's
         * keys fetched while this one is scored, this block's values for values16 after
         * the softmax (0.1 ms of a 4 ms step's other work, section 21). */
        for (int k = 0; k < 16; ++k)
            for (i64 d = 0; d < dim; d += 32) {
                if (j0 + 16 < padded) _mm_prefetch((const char *)(k_cache + rows[j0 + 16 + k] + d), _MM_HINT_T0);
                _mm_prefetch((const char *)(v_cache + rows[j0 + k] + d), _MM_HINT_T1);
            }
        for (i64 d = 0; d < dim; d += 32) {
            __m512 a[16];
            for (int k = 0; k < 16; ++k) a[k] = _mm512_loadu_ps(k_cache + rows[j0 + k] + d);
            transpose16(a);
            for (int i = 0; i < 16; ++i) _mm512_store_si512(kt + d / 2 + i, _mm512_castps_si512(a[i]));
        }
        for (i64 g0 = 0; g0 < groups; g0 += 8) {
            const uint32_t *q = qp + g0 * pairs;
            float *s = scores + g0 * stride + j0;
#define SCORES(G) block_scores_dot(q, pairs, kt, G, scaled, s, stride)
            BY_GROUP(groups - g0, SCORES)
#undef SCORES
        }
    }
}

/* attend() in sixteen lanes, dim % 16 == 0: the same sums, the scores' and the softmax's
 * added in another order. qb: the queries as bfloat16 (or NULL), for scores16_dot. */
AVX512_OUTER void attend16(const float *qf, const uint16_t *qb, i64 groups, i64 dim, const void *k_cache,
                           const void *v_cache, const i64 *rows, i64 length, float scale, int kv, float *scores,
                           float *out, float *kt) {
    const i64 padded = (length + 15) / 16 * 16;
    if (qb != NULL) scores16_dot(qb, groups, dim, k_cache, v_cache, rows, padded, scale, scores, padded, (__m512i *)kt);
    else if (kv == F32) scores16(qf, groups, dim, k_cache, rows, padded, scale, F32, scores, padded, kt);
    else if (kv == BF16) scores16(qf, groups, dim, k_cache, rows, padded, scale, BF16, scores, padded, kt);
    else scores16(qf, groups, dim, k_cache, rows, padded, scale, F16, scores, padded, kt);
    for (i64 g = 0; g < groups; ++g)
        for (i64 j = length; j < padded; ++j) scores[g * padded + j] = -INFINITY;
    float inv[groups];
    softmax16(scores, padded, groups, inv);
    if (kv == F32) values16(scores, padded, groups, length, v_cache, rows, dim, F32, inv, out);
    else if (kv == BF16) values16(scores, padded, groups, length, v_cache, rows, dim, BF16, inv, out);
    else values16(scores, padded, groups, length, v_cache, rows, dim, F16, inv, out);
}

/* One query row per request over its cached tokens. q, out: [B, Hq, D]; caches
 * [Hkv, cache_slots, D] of `kv` kind; tables [B, width] block ids; lengths [B] tokens
 * cached (the new one included); window > 0: a sliding window, only each request's
 * last `window` tokens attended. One task per (request, KV head). */
void ruvllm_decode_attention(const void *q, const void *k_cache, const void *v_cache, i64 cache_slots,
                             const int32_t *tables, i64 width, const int32_t *lengths, i64 batch,
                             i64 block_size, i64 q_heads, i64 kv_heads, i64 dim, float scale,
                             void *out, int bf16, int kv, int wide, int threads, i64 window) {
    const i64 groups = q_heads / kv_heads, tasks = batch * kv_heads;
    i64 longest = 0;
    for (i64 b = 0; b < batch; ++b) longest = lengths[b] > longest ? lengths[b] : longest;
    if (threads > tasks) threads = (int)tasks;
    const int dot = wide >= 2 && bf16 && kv == BF16 && dim % 32 == 0;   /* scores16_dot */
    wide = wide && dim % 16 == 0;
    const i64 padded = wide ? (longest + 15) / 16 * 16 : (longest + 7) / 8 * 8;
    #pragma omp parallel num_threads(threads)
    {
        /* the keys' block (kt) first: 64-byte aligned for scores16_dot */
        const i64 block = wide ? 16 * dim : 0;
        float *work = aligned_alloc(64, (size_t)(block + groups * (padded + 2 * dim) + 15) / 16 * 64);
        float *kt = work, *scores = work + block, *qf = scores + groups * padded, *acc = qf + groups * dim;
        i64 *rows = malloc((size_t)padded * sizeof(i64));
        #pragma omp for schedule(static)
        for (i64 task = 0; task < tasks; ++task) {
            const i64 b = task / kv_heads, h = task % kv_heads, cached = lengths[b];
            const i64 first = window > 0 && cached > window ? cached - window : 0, length = cached - first;
            const i64 at = (b * q_heads + h * groups) * dim;
            const int32_t *table = tables + b * width;
            for (i64 j = 0, block = first / block_size, offset = first % block_size; j < length; ++j) {   /* no division per token */
                rows[j] = (h * cache_slots + (i64)table[block] * block_size + offset) * dim;
                if (++offset == block_size) offset = 0, ++block;
            }
            for (i64 j = length; j < padded; ++j) rows[j] = rows[0];
            if (!dot) load_row(q, at, groups * dim, bf16, qf);   /* scores16_dot reads q as it is */
            if (wide)
                attend16(qf, dot ? (const uint16_t *)q + at : NULL, groups, dim, k_cache, v_cache, rows, length, scale,
                         kv, scores, acc, kt);
            else if (kv == F32)   /* a constant kind inside: no dtype test per load */
                attend(qf, groups, dim, k_cache, v_cache, rows, length, scale, F32, scores, acc);
            else if (kv == BF16)
                attend(qf, groups, dim, k_cache, v_cache, rows, length, scale, BF16, scores, acc);
            else
                attend(qf, groups, dim, k_cache, v_cache, rows, length, scale, F16, scores, acc);
            store_row(acc, groups * dim, bf16, out, at);
        }
        free(rows);
        free(work);
    }
}

/* gate = SiLU(gate) * up, elementwise over count values (a multiple of 8), as
 * transformers computes it: silu(g) = g / (1 + exp(-g)), held, times up, held.
 * `wide`: silu_mul16, on CPUs with AVX-512. */
void ruvllm_silu_mul(void *gate, const void *up, i64 count, int bf16, int wide, int threads) {
    if (wide) {
        silu_mul16(gate, up, count, bf16, wide >= 2, threads);
        return;
    }
    const i64 chunk = 1024;   /* a one-row step's 4,864 values still split over the threads */
    const i64 chunks = (count + chunk - 1) / chunk;
    #pragma omp parallel for num_threads(threads) schedule(static) if (chunks > 1)
    for (i64 c = 0; c < chunks; ++c) {
        float g[chunk], u[chunk];
        const i64 start = c * chunk, n = count - start < chunk ? count - start : chunk;
        load_row(gate, start, n, bf16, g);
        load_row(up, start, n, bf16, u);
        const __m256 one = _mm256_set1_ps(1.0f);
        for (i64 i = 0; i < n; i += 8) {
            const __m256 x = _mm256_loadu_ps(g + i);
            const __m256 silu = _mm256_div_ps(x, _mm256_add_ps(one, exp8(_mm256_sub_ps(_mm256_setzero_ps(), x))));
            _mm256_storeu_ps(g + i, silu);
        }
        if (bf16)
            for (i64 i = 0; i < n; ++i) g[i] = held(held(g[i], 1) * u[i], 1);
        else
            for (i64 i = 0; i < n; ++i) g[i] *= u[i];
        store_row(g, n, bf16, gate, start);
    }
}

/* Each row's index of its largest value, the first where several tie; a NaN counts as
 * larger than any number (torch.argmax's rule), so the first NaN wins. x: [rows, n]
 * float32 or bfloat16 (`bf16`: read as it is, no float32 copy); out: [rows]. torch's
 * argmax took 2.1 ms over 16 rows of a 152k vocabulary (amax 0.17): one pass for the
 * largest value, one to find where it first is. */
static inline __attribute__((always_inline)) i64 argmax_row(const void *x, i64 n, int bf16) {
    __m256 top = _mm256_set1_ps(-INFINITY), nan = _mm256_setzero_ps();
    i64 i = 0;
    for (; i + 8 <= n; i += 8) {
        const __m256 v = load8(x, i, bf16);
        top = _mm256_max_ps(top, v);
        nan = _mm256_or_ps(nan, _mm256_cmp_ps(v, v, _CMP_UNORD_Q));
    }
    float lanes[8], best = -INFINITY;
    _mm256_storeu_ps(lanes, top);
    for (int lane = 0; lane < 8; ++lane) best = lanes[lane] > best ? lanes[lane] : best;
    int unordered = !_mm256_testz_ps(nan, nan);
    for (i64 j = i; j < n; ++j) {
        const float v = bf16 ? bf16_load(((const uint16_t *)x)[j]) : ((const float *)x)[j];
        if (v != v) unordered = 1;
        else if (v > best) best = v;
    }
    const __m256 target = _mm256_set1_ps(best);
    for (i = 0; i + 8 <= n; i += 8) {
        const __m256 v = load8(x, i, bf16);
        const __m256 hit = unordered ? _mm256_cmp_ps(v, v, _CMP_UNORD_Q) : _mm256_cmp_ps(v, target, _CMP_EQ_OQ);
        if (_mm256_movemask_ps(hit)) break;
    }
    for (; i < n; ++i) {
        const float v = bf16 ? bf16_load(((const uint16_t *)x)[i]) : ((const float *)x)[i];
        if (unordered ? v != v : v == best) break;
    }
    return i;
}

/* The first largest value of x[start, end) and where it is, in sixteen lanes and four
 * chains (`nan`: where the first NaN is, or -1). Each lane keeps the first of its
 * largest values (only a greater one replaces it); the first of the lanes holding the
 * largest wins. One pass, where argmax_row takes two. */
typedef struct { float best; i64 at, nan; } Peak;

AVX512_OUTER Peak peak16(const void *x, i64 start, i64 end, int bf16) {
    const int kind = bf16 ? BF16 : F32;
    const __m512i lanes = _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
    __m512 top[4];
    __m512i at[4], index[4];
    __mmask16 unordered = 0;
    for (int c = 0; c < 4; ++c) {
        top[c] = _mm512_set1_ps(-INFINITY);
        at[c] = index[c] = _mm512_add_epi32(lanes, _mm512_set1_epi32((int)(start + 16 * c)));
    }
    i64 i = start;
    for (; i + 64 <= end; i += 64)
        for (int c = 0; c < 4; ++c) {
            const __m512 v = load16(x, i + 16 * c, kind);
            const __mmask16 greater = _mm512_cmp_ps_mask(v, top[c], _CMP_GT_OQ);
            top[c] = _mm512_mask_mov_ps(top[c], greater, v);
            at[c] = _mm512_mask_mov_epi32(at[c], greater, index[c]);
            unordered |= _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q);
            index[c] = _mm512_add_epi32(index[c], _mm512_set1_epi32(64));
        }
    for (; i + 16 <= end; i += 16) {   /* chain 0 holds the lowest indices still to come */
        const __m512 v = load16(x, i, kind);
        const __mmask16 greater = _mm512_cmp_ps_mask(v, top[0], _CMP_GT_OQ);
        top[0] = _mm512_mask_mov_ps(top[0], greater, v);
        at[0] = _mm512_mask_mov_epi32(at[0], greater, _mm512_add_epi32(lanes, _mm512_set1_epi32((int)i)));
        unordered |= _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q);
    }
    for (int c = 1; c < 4; ++c) {   /* per lane: the larger, or the earlier of equals */
        const __mmask16 take = _mm512_cmp_ps_mask(top[c], top[0], _CMP_GT_OQ)
            | (_mm512_cmp_ps_mask(top[c], top[0], _CMP_EQ_OQ) & _mm512_cmp_epi32_mask(at[c], at[0], _MM_CMPINT_LT));
        top[0] = _mm512_mask_mov_ps(top[0], take, top[c]);
        at[0] = _mm512_mask_mov_epi32(at[0], take, at[c]);
    }
    Peak peak = {_mm512_reduce_max_ps(top[0]), 0, -1};
    peak.at = _mm512_mask_reduce_min_epi32(_mm512_cmp_ps_mask(top[0], _mm512_set1_ps(peak.best), _CMP_EQ_OQ), at[0]);
    for (; i < end; ++i) {
        const float v = bf16 ? bf16_load(((const uint16_t *)x)[i]) : ((const float *)x)[i];
        if (v != v) unordered = 1;
        else if (v > peak.best) peak.best = v, peak.at = i;
    }
    if (unordered)
        for (i = start; i < end && peak.nan < 0; ++i) {
            const float v = bf16 ? bf16_load(((const uint16_t *)x)[i]) : ((const float *)x)[i];
            if (v != v) peak.nan = i;
        }
    return peak;
}

/* LoRA's update of a linear layer's rows (engine/lora.py's LoRALinear), float32: out[m] +=
 * sum_w s[m, w] * b[w] where s[m, w] = <x[m], a[w]> * mask[m, w]; a [W, K] (the slots'
 * stacked A), b [W, N] (their B transposed, times the scaling), mask [M, W] 1 where the
 * column belongs to the row's slot, 0 elsewhere (those columns are skipped, and so is a
 * base-model row whole: its output stays as the base layer left it). Each row alone, in a
 * fixed order (eight lanes along K, then a fixed tree; each output's W products in order),
 * so a row gives the same bits in any batch. Four torch calls cost 30-50 us a layer
 * around 0.1-0.2 MFLOP of work at a decode step's few rows (design.md, section 11). */
void ruvllm_lora_add(const float *x, i64 M, i64 K, const float *a, i64 W, const float *mask, const float *b, i64 N,
                     float *out, int threads) {
    #pragma omp parallel for num_threads(threads) schedule(static) if (M >= 4)
    for (i64 m = 0; m < M; ++m) {
        const float *row = x + m * K, *keep = mask + m * W;
        float *o = out + m * N;
        i64 used = 0;
        float s[W > 0 ? W : 1];
        i64 at[W > 0 ? W : 1];
        for (i64 w = 0; w < W; ++w) {
            if (keep[w] == 0.0f) continue;
            const float *aw = a + w * K;
            __m256 acc = _mm256_setzero_ps();
            i64 k = 0;
            for (; k + 8 <= K; k += 8) acc = _mm256_fmadd_ps(_mm256_loadu_ps(row + k), _mm256_loadu_ps(aw + k), acc);
            __m128 h = _mm_add_ps(_mm256_castps256_ps128(acc), _mm256_extractf128_ps(acc, 1));
            h = _mm_add_ps(h, _mm_movehl_ps(h, h));
            h = _mm_add_ss(h, _mm_shuffle_ps(h, h, 1));
            float dot = _mm_cvtss_f32(h);
            for (; k < K; ++k) dot += row[k] * aw[k];
            s[used] = dot * keep[w];
            at[used++] = w;
        }
        if (used == 0) continue;
        i64 n = 0;
        for (; n + 8 <= N; n += 8) {
            __m256 acc = _mm256_loadu_ps(o + n);
            for (i64 u = 0; u < used; ++u) acc = _mm256_fmadd_ps(_mm256_set1_ps(s[u]), _mm256_loadu_ps(b + at[u] * N + n), acc);
            _mm256_storeu_ps(o + n, acc);
        }
        for (; n < N; ++n) {
            float v = o[n];
            for (i64 u = 0; u < used; ++u) v = fmaf(s[u], b[at[u] * N + n], v);
            o[n] = v;
        }
    }
}

/* Each row's argmax: `wide` (AVX-512), peak16 over pieces of the row, a row split over
 * the threads when there are fewer rows than threads; else argmax_row (AVX2). */
void ruvllm_argmax_rows(const void *x, i64 rows, i64 n, int bf16, i64 *out, int wide, int threads) {
    const size_t item = bf16 ? 2 : 4;
    if (!wide || n >= ((i64)1 << 31)) {
        #pragma omp parallel for num_threads(threads) schedule(static) if (rows > 1)
        for (i64 r = 0; r < rows; ++r) {
            const void *row = (const char *)x + (size_t)(r * n) * item;
            out[r] = bf16 ? argmax_row(row, n, 1) : argmax_row(row, n, 0);
        }
        return;
    }
    const i64 pieces = rows >= threads || n < 4096 ? 1 : (threads + rows - 1) / rows, step = (n + pieces - 1) / pieces;
    Peak *found = malloc((size_t)(rows * pieces) * sizeof(Peak));
    #pragma omp parallel for num_threads(threads) schedule(static) if (rows * pieces > 1)
    for (i64 task = 0; task < rows * pieces; ++task) {
        const i64 r = task / pieces, start = task % pieces * step, end = start + step < n ? start + step : n;
        found[task] = peak16((const char *)x + (size_t)(r * n) * item, start, end, bf16);
    }
    for (i64 r = 0; r < rows; ++r) {   /* the pieces in order: the first NaN, else the first largest */
        const Peak *p = found + r * pieces;
        i64 best = 0, nan = -1;
        for (i64 k = 0; k < pieces && nan < 0; ++k) {
            if (p[k].nan >= 0) nan = p[k].nan;
            else if (p[k].best > p[best].best) best = k;
        }
        out[r] = nan >= 0 ? nan : p[best].at;
    }
    free(found);
}

/* What a decode step's RoPE + attention calls share across the layers, set once a step
 * (fused.py's AttendStep mirrors it): ctypes converts each argument of a call one by
 * one, 23 of them took about 5 us a call, 120 us a step. */
typedef struct {
    const void *cos, *sin;
    i64 rows, q_heads, kv_heads, dim, cache_slots;
    const i64 *slots;
    const int32_t *tables;
    i64 width;
    const int32_t *lengths;
    i64 block_size;
    float scale;
    void *out;
    int bf16, kv, wide, threads;
    i64 window;   /* > 0: every layer's sliding window (Mistral v0.1, Phi-3 4k) */
    const float *lora_mask;   /* LoRA rows this step: ruvllm_lora_add's mask [rows, lora_width]; NULL: none */
    i64 lora_width;
} AttendStep;

/* ruvllm_rope_store, then ruvllm_decode_attention over the same rows: one call a layer. */
void ruvllm_rope_attend(const AttendStep *s, void *q, const void *k, const void *v, void *k_cache, void *v_cache) {
    ruvllm_rope_store(q, k, v, s->cos, s->sin, s->rows, s->q_heads, s->kv_heads, s->dim, k_cache, v_cache,
                      s->cache_slots, s->slots, s->bf16, s->kv, s->threads);
    ruvllm_decode_attention(q, k_cache, v_cache, s->cache_slots, s->tables, s->width, s->lengths, s->rows,
                            s->block_size, s->q_heads, s->kv_heads, s->dim, s->scale, s->out, s->bf16, s->kv,
                            s->wide, s->threads, s->window);
}

/* ---- Every layer of a decode step in one call, where each linear layer is one of our
 * kernels (fused.py's LayerPlan): the Python around 169 linear modules (each a call
 * converting its arguments, an output tensor, checks) cost about 8 us a module, more
 * than a small layer's kernel. The kernels are those the modules call, on the same
 * arrays in the same order, so the same bits. ---- */

/* A linear layer: which kernel (the step's `fns` table), its weights and shape. */
enum { LINEAR_Q8 = 0, LINEAR_BF16 = 1, LINEAR_INT4 = 2, LINEAR_F16 = 3 };
typedef struct {
    i64 kind, out, in, group;
    const void *weight, *scales, *bias;
    const float *lora_a, *lora_b;   /* an adapter wrapper's slots (ruvllm_lora_add's a, b); NULL: none */
} LinearPlan;

typedef struct {
    LinearPlan q, k, v, o, gate, up, down;
    const void *norm_in, *norm_post;   /* the two RMSNorms' weights */
    float eps_in, eps_post;
    void *k_cache, *v_cache;
} LayerPlan;

/* The kernels' own signatures (int8_gemm.c, bf16_gemm.c, int4_gemm.c, half_gemm.c). */
typedef void (*Q8Linear)(const float *, i64, i64, const int8_t *, const float *, i64, const float *, float *,
                         int8_t *, int);
typedef void (*Bf16Linear)(const uint16_t *, i64, i64, const uint16_t *, i64, const float *, uint16_t *, float *, int);
typedef void (*Int4Linear)(const uint16_t *, i64, i64, const uint8_t *, i64, const uint16_t *, i64, const uint16_t *,
                           uint16_t *, float *, int);
typedef void (*F16Linear)(const float *, i64, i64, const uint16_t *, i64, const float *, float *, float *, int);

static void run_linear_base(const LinearPlan *l, void *const *fns, const void *x, i64 rows, void *out, void *room,
                            int threads);

/* A linear layer, then its adapters' update where the step has LoRA rows (float32
 * activations: fused.py sends a step with LoRA rows here only then), as LoRALinear's
 * forward adds it. */
static void run_linear(const AttendStep *s, const LinearPlan *l, void *const *fns, const void *x, i64 rows,
                       void *out, void *room, int threads) {
    run_linear_base(l, fns, x, rows, out, room, threads);
    if (l->lora_a != NULL && s->lora_mask != NULL && fns[l->kind] != NULL)
        ruvllm_lora_add(x, rows, l->in, l->lora_a, s->lora_width, s->lora_mask, l->lora_b, l->out, out, threads);
}

static void run_linear_base(const LinearPlan *l, void *const *fns, const void *x, i64 rows, void *out, void *room,
                            int threads) {
    if (fns[l->kind] == NULL) return;   /* no kernel: `out` keeps the zeros it was given (bench_fused.py's "other") */
    switch (l->kind) {
        case LINEAR_Q8:
            ((Q8Linear)fns[LINEAR_Q8])(x, rows, l->in, l->weight, l->scales, l->out, l->bias, out, room, threads);
            break;
        case LINEAR_BF16:
            ((Bf16Linear)fns[LINEAR_BF16])(x, rows, l->in, l->weight, l->out, l->bias, out, room, threads);
            break;
        case LINEAR_INT4:
            ((Int4Linear)fns[LINEAR_INT4])(x, rows, l->in, l->weight, l->out, l->scales, l->group, l->bias, out, room,
                                           threads);
            break;
        default:
            ((F16Linear)fns[LINEAR_F16])(x, rows, l->in, l->weight, l->out, l->bias, out, rows > 1 ? room : NULL,
                                         threads);
    }
}

/* fused.py's layer loop: x (the residual stream) in place, h ends as the final norm of
 * x (the LM head's input). q, k, v, o, gate, up, down: each linear layer's output rows;
 * the attention writes s->out; room: the kernels' scratch (the largest any asks). */
void ruvllm_decode_layers(const AttendStep *s, const LayerPlan *layers, i64 count, void *const *fns, void *x,
                          void *h, void *q, void *k, void *v, void *o, void *gate, void *up, void *down, void *room,
                          i64 hidden, const void *final_norm, float final_eps) {
    const i64 rows = s->rows;
    const int threads = s->threads, bf16 = s->bf16, wide = s->wide;
    const void *delta = NULL;
    for (i64 index = 0; index < count; ++index) {
        const LayerPlan *p = layers + index;
        ruvllm_add_rms_norm(x, delta, p->norm_in, h, rows, hidden, p->eps_in, bf16, wide, threads);
        run_linear(s, &p->q, fns, h, rows, q, room, threads);
        run_linear(s, &p->k, fns, h, rows, k, room, threads);
        run_linear(s, &p->v, fns, h, rows, v, room, threads);
        ruvllm_rope_attend(s, q, k, v, p->k_cache, p->v_cache);
        run_linear(s, &p->o, fns, s->out, rows, o, room, threads);
        ruvllm_add_rms_norm(x, o, p->norm_post, h, rows, hidden, p->eps_post, bf16, wide, threads);
        run_linear(s, &p->gate, fns, h, rows, gate, room, threads);
        run_linear(s, &p->up, fns, h, rows, up, room, threads);
        ruvllm_silu_mul(gate, up, rows * p->gate.out, bf16, wide, threads);
        run_linear(s, &p->down, fns, gate, rows, down, room, threads);
        delta = down;
    }
    ruvllm_add_rms_norm(x, delta, final_norm, h, rows, hidden, final_eps, bf16, wide, threads);
}
