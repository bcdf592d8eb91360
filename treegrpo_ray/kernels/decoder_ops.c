/* The small operations of a decoder layer, each one pass over its rows (tokens): the residual
 * add with the RMS norm, the rotary embedding with the KV write, SiLU(gate) * up. float32, AVX2
 * and FMA; one thread up to PARALLEL_ROWS rows (a decode step's rows are a few KB each), the
 * rows split between `threads` above. Each row is computed alone, so a row's results do not
 * depend on the others.
 */
#include <immintrin.h>
#include <math.h>
#include <stdint.h>

#include "vector_math.h"

#define PARALLEL_ROWS 32

/* residual += x (x NULL: nothing added), then out = weight * (residual / rms(residual)),
 * rms = sqrt(mean(residual^2) + eps), as Llama's RMSNorm. residual, x, out: (rows, hidden). */
void add_rms_norm(float *residual, const float *x, const float *weight, float eps, int64_t rows,
                  int64_t hidden, float *out, int threads) {
#pragma omp parallel for if (rows > PARALLEL_ROWS) num_threads(threads)
    for (int64_t r = 0; r < rows; r++) {
        float *h = residual + r * hidden, *y = out + r * hidden;
        const float *add = x ? x + r * hidden : 0;
        __m256 squares = _mm256_setzero_ps();
        int64_t i = 0;
        for (; i + 8 <= hidden; i += 8) {
            __m256 v = _mm256_loadu_ps(h + i);
            if (add) {
                v = _mm256_add_ps(v, _mm256_loadu_ps(add + i));
                _mm256_storeu_ps(h + i, v);
            }
            squares = _mm256_fmadd_ps(v, v, squares);
        }
        float total = sum8(squares);
        for (; i < hidden; i++) {
            if (add) h[i] += add[i];
            total += h[i] * h[i];
        }
        const float inverse = 1.0f / sqrtf(total / (float)hidden + eps);
        for (i = 0; i < hidden; i++) y[i] = weight[i] * (h[i] * inverse);
    }
}

/* x (D) rotated by the row's cos and sin (D): out = x * cos + rotate_half(x) * sin, with
 * rotate_half(x) = (-x[D/2:], x[:D/2]). */
static void rotate(const float *x, const float *cos, const float *sin, int64_t D, float *out) {
    const int64_t half = D / 2;
    for (int64_t i = 0; i < half; i++) {
        out[i] = x[i] * cos[i] - x[i + half] * sin[i];
        out[i + half] = x[i + half] * cos[i + half] + x[i] * sin[i + half];
    }
}

/* Row r's projections qkv[r] = (q: heads x D, k: kv_heads x D, v: kv_heads x D): q rotated into
 * query[r] (heads, D); k rotated and v written into slot slots[r] (slots NULL: slot r) of the
 * layer's buffers keys, values (slots, kv_heads, capacity, D) at column columns[r] (no two rows
 * at the same slot and column). cos, sin: (rows, D). */
void rotary_store(const float *qkv, const float *cos, const float *sin, const int64_t *columns,
                  const int64_t *slots, int64_t rows, int64_t heads, int64_t kv_heads, int64_t D,
                  int64_t capacity, float *query, float *keys, float *values, int threads) {
    const int64_t width = (heads + 2 * kv_heads) * D;
#pragma omp parallel for if (rows > PARALLEL_ROWS) num_threads(threads)
    for (int64_t r = 0; r < rows; r++) {
        const float *q = qkv + r * width, *k = q + heads * D, *v = k + kv_heads * D;
        const float *c = cos + r * D, *s = sin + r * D;
        for (int64_t h = 0; h < heads; h++) rotate(q + h * D, c, s, D, query + (r * heads + h) * D);
        for (int64_t h = 0; h < kv_heads; h++) {
            const int64_t slot = slots ? slots[r] : r;
            const int64_t at = ((slot * kv_heads + h) * capacity + columns[r]) * D;
            rotate(k + h * D, c, s, D, keys + at);
            for (int64_t i = 0; i < D; i++) values[at + i] = v[h * D + i];
        }
    }
}

/* out = silu(gate) * up, silu(g) = g / (1 + e^-g); gate_up: (rows, 2 * width), each row's gate
 * then its up; out: (rows, width). */
void silu_mul(const float *gate_up, int64_t rows, int64_t width, float *out, int threads) {
    const __m256 one = _mm256_set1_ps(1.0f);
#pragma omp parallel for if (rows > PARALLEL_ROWS) num_threads(threads)
    for (int64_t r = 0; r < rows; r++) {
        const float *gate = gate_up + r * 2 * width, *up = gate + width;
        float *y = out + r * width;
        int64_t i = 0;
        for (; i + 8 <= width; i += 8) {
            __m256 g = _mm256_loadu_ps(gate + i);
            __m256 e = exp8(_mm256_sub_ps(_mm256_setzero_ps(), g));
            __m256 silu = _mm256_div_ps(g, _mm256_add_ps(one, e));
            _mm256_storeu_ps(y + i, _mm256_mul_ps(silu, _mm256_loadu_ps(up + i)));
        }
        for (; i < width; i++) y[i] = gate[i] / (1.0f + expf(-gate[i])) * up[i];
    }
}
