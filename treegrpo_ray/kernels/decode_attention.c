/* Attention over KV slots: each query row attends its slot's first counts[row] columns, the G
 * query heads of a KV head together. float32, AVX2 and FMA.
 *
 * q: (rows, kv_heads, G, D); k, v: (slots, kv_heads, capacity, D), row r in slot slots[r] (slots
 * NULL: slot r); out: (rows, kv_heads, G, D). D a multiple of 8. A decoding row is one query
 * row; a joining row's prefix is one query row per token, each over the columns up to its own
 * (causal). One task per (row, KV head): its keys and values are read once for the G heads (the
 * second reads hit the cache), and a row reads only its own columns, not the longest row's.
 * Scores, then an exact softmax (max subtracted, exp by a polynomial to ~2 ulp), then the values
 * weighted.
 */
#include <immintrin.h>
#include <math.h>
#include <stdint.h>
#include <stdlib.h>

#include "vector_math.h"

/* The sums of a, b, c, d's lanes, as one 4-lane vector. */
static inline __m128 sum4(__m256 a, __m256 b, __m256 c, __m256 d) {
    __m256 abcd = _mm256_hadd_ps(_mm256_hadd_ps(a, b), _mm256_hadd_ps(c, d));
    return _mm_add_ps(_mm256_castps256_ps128(abcd), _mm256_extractf128_ps(abcd, 1));
}

/* scores[t] = scale * q . k_t for t < n. */
static void score(const float *q, const float *k, int64_t n, int64_t D, float scale,
                  float *scores) {
    int64_t t = 0;
    for (; t + 4 <= n; t += 4) {
        __m256 a = _mm256_setzero_ps(), b = a, c = a, d = a;
        for (int64_t i = 0; i < D; i += 8) {
            __m256 qi = _mm256_loadu_ps(q + i);
            a = _mm256_fmadd_ps(qi, _mm256_loadu_ps(k + t * D + i), a);
            b = _mm256_fmadd_ps(qi, _mm256_loadu_ps(k + (t + 1) * D + i), b);
            c = _mm256_fmadd_ps(qi, _mm256_loadu_ps(k + (t + 2) * D + i), c);
            d = _mm256_fmadd_ps(qi, _mm256_loadu_ps(k + (t + 3) * D + i), d);
        }
        _mm_storeu_ps(scores + t, _mm_mul_ps(sum4(a, b, c, d), _mm_set1_ps(scale)));
    }
    for (; t < n; t++) {
        __m256 a = _mm256_setzero_ps();
        for (int64_t i = 0; i < D; i += 8)
            a = _mm256_fmadd_ps(_mm256_loadu_ps(q + i), _mm256_loadu_ps(k + t * D + i), a);
        scores[t] = sum8(a) * scale;
    }
}

/* scores[t] <- e^(scores[t] - max), returns their sum. */
static float softmax_numerators(float *scores, int64_t n) {
    float top = -INFINITY;
    for (int64_t t = 0; t < n; t++) top = scores[t] > top ? scores[t] : top;
    __m256 total = _mm256_setzero_ps(), shift = _mm256_set1_ps(top);
    int64_t t = 0;
    for (; t + 8 <= n; t += 8) {
        __m256 e = exp8(_mm256_sub_ps(_mm256_loadu_ps(scores + t), shift));
        _mm256_storeu_ps(scores + t, e);
        total = _mm256_add_ps(total, e);
    }
    float sum = sum8(total);
    for (; t < n; t++) {
        scores[t] = expf(scores[t] - top);
        sum += scores[t];
    }
    return sum;
}

/* out = (sum_t weights[t] v_t) / total: 32 outputs at a time in 4 registers, then 8 at a time. */
static void weigh(const float *weights, const float *v, int64_t n, int64_t D, float total,
                  float *out) {
    const __m256 inverse = _mm256_set1_ps(1.0f / total);
    int64_t i = 0;
    for (; i + 32 <= D; i += 32) {
        __m256 a = _mm256_setzero_ps(), b = a, c = a, d = a;
        for (int64_t t = 0; t < n; t++) {
            const __m256 w = _mm256_broadcast_ss(weights + t);
            const float *row = v + t * D + i;
            a = _mm256_fmadd_ps(w, _mm256_loadu_ps(row), a);
            b = _mm256_fmadd_ps(w, _mm256_loadu_ps(row + 8), b);
            c = _mm256_fmadd_ps(w, _mm256_loadu_ps(row + 16), c);
            d = _mm256_fmadd_ps(w, _mm256_loadu_ps(row + 24), d);
        }
        _mm256_storeu_ps(out + i, _mm256_mul_ps(a, inverse));
        _mm256_storeu_ps(out + i + 8, _mm256_mul_ps(b, inverse));
        _mm256_storeu_ps(out + i + 16, _mm256_mul_ps(c, inverse));
        _mm256_storeu_ps(out + i + 24, _mm256_mul_ps(d, inverse));
    }
    for (; i < D; i += 8) {
        __m256 a = _mm256_setzero_ps();
        for (int64_t t = 0; t < n; t++)
            a = _mm256_fmadd_ps(_mm256_broadcast_ss(weights + t), _mm256_loadu_ps(v + t * D + i), a);
        _mm256_storeu_ps(out + i, _mm256_mul_ps(a, inverse));
    }
}

void decode_attention(const float *q, const float *k, const float *v, const int64_t *counts,
                      const int64_t *slots, int64_t rows, int64_t kv_heads, int64_t G,
                      int64_t capacity, int64_t D, float scale, float *out, int threads) {
    int64_t longest = 0;
    for (int64_t r = 0; r < rows; r++) longest = counts[r] > longest ? counts[r] : longest;
#pragma omp parallel num_threads(threads)
    {
        float *scores = malloc(sizeof(float) * (size_t)(longest > 0 ? longest : 1));
#pragma omp for schedule(dynamic)
        for (int64_t task = 0; task < rows * kv_heads; task++) {
            const int64_t row = task / kv_heads, n = counts[row];
            const int64_t slot = slots ? slots[row] : row;
            const int64_t at_slot = (slot * kv_heads + task % kv_heads) * capacity * D;
            const float *keys = k + at_slot, *values = v + at_slot;
            for (int64_t g = 0; g < G; g++) {
                const int64_t at = (task * G + g) * D;
                score(q + at, keys, n, D, scale, scores);
                weigh(scores, values, n, D, softmax_numerators(scores, n), out + at);
            }
        }
        free(scores);
    }
}
