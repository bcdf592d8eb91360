/* y = x @ W^T (+ bias) for a few rows of x, float32, AVX2 and FMA.
 *
 * x: (M, K) row-major; W: (N, K) stored blocked as (N / 16, K, 16), so that one block's 16
 * outputs read their weights as one contiguous stream; y: (M, N) row-major. Each thread takes
 * a contiguous run of blocks and streams its weights once; up to 6 rows share each weight load
 * (12 accumulators, 2 weight registers and a broadcast fill the 16 AVX2 registers). A row's
 * outputs are summed in the same order whatever M is, so they do not depend on the other rows.
 */
#include <immintrin.h>
#include <stdint.h>

#define BLOCK 16       /* outputs per block: two 8-float registers */
#define MAX_ROWS 6     /* rows a tile holds in registers */
#define K_CHUNK 256    /* for more than MAX_ROWS rows: a 16 KB slice of a block stays in L1 */
#define PREFETCH 16    /* weight rows (64 bytes each) fetched ahead */

#define INIT(i)                                                                     \
    __m256 a##i##0 = _mm256_setzero_ps(), a##i##1 = _mm256_setzero_ps();            \
    if (rows > i && start) {                                                        \
        a##i##0 = _mm256_loadu_ps(start + (from_y ? i * N : 0));                     \
        a##i##1 = _mm256_loadu_ps(start + (from_y ? i * N : 0) + 8);                 \
    }
#define STEP(i)                                                                     \
    if (rows > i) {                                                                 \
        __m256 xi = _mm256_broadcast_ss(x + i * K + k);                             \
        a##i##0 = _mm256_fmadd_ps(xi, w0, a##i##0);                                 \
        a##i##1 = _mm256_fmadd_ps(xi, w1, a##i##1);                                 \
    }
#define STORE(i)                                                                    \
    if (rows > i) {                                                                 \
        _mm256_storeu_ps(y + i * N, a##i##0);                                       \
        _mm256_storeu_ps(y + i * N + 8, a##i##1);                                   \
    }

/* One block's 16 outputs for `rows` rows over k in [k0, k1), starting from `start`: the bias,
 * the partial sums in y (from_y), or zero (NULL). Inlined with `rows` a constant, so the
 * accumulators stay in registers. */
static inline __attribute__((always_inline)) void tile(
    const int rows, const float *x, int64_t K, int64_t k0, int64_t k1, const float *w,
    float *y, int64_t N, const float *start, int from_y) {
    INIT(0) INIT(1) INIT(2) INIT(3) INIT(4) INIT(5)
    for (int64_t k = k0; k < k1; k++) {
        _mm_prefetch((const char *)(w + (k + PREFETCH) * BLOCK), _MM_HINT_T0);
        __m256 w0 = _mm256_load_ps(w + k * BLOCK), w1 = _mm256_load_ps(w + k * BLOCK + 8);
        STEP(0) STEP(1) STEP(2) STEP(3) STEP(4) STEP(5)
    }
    STORE(0) STORE(1) STORE(2) STORE(3) STORE(4) STORE(5)
}

typedef void (*tile_fn)(const float *, int64_t, int64_t, int64_t, const float *, float *,
                        int64_t, const float *, int);
#define TILE(R)                                                                     \
    static void tile##R(const float *x, int64_t K, int64_t k0, int64_t k1,          \
                        const float *w, float *y, int64_t N, const float *s, int f) {   \
        tile(R, x, K, k0, k1, w, y, N, s, f);                                       \
    }
TILE(1) TILE(2) TILE(3) TILE(4) TILE(5) TILE(6)
static const tile_fn TILES[MAX_ROWS + 1] = {0, tile1, tile2, tile3, tile4, tile5, tile6};

void small_rows_linear(const float *x, int64_t M, int64_t K, const float *blocked, int64_t N,
                       const float *bias, float *y, int threads) {
    const int64_t k_chunk = M <= MAX_ROWS ? K : K_CHUNK;
#pragma omp parallel for schedule(static) num_threads(threads)
    for (int64_t block = 0; block < N / BLOCK; block++) {
        const float *w = blocked + block * K * BLOCK;
        const float *b = bias ? bias + block * BLOCK : 0;
        for (int64_t k0 = 0; k0 < K; k0 += k_chunk) {
            const int64_t k1 = k0 + k_chunk < K ? k0 + k_chunk : K;
            for (int64_t m = 0; m < M; m += MAX_ROWS) {
                const int rows = M - m < MAX_ROWS ? (int)(M - m) : MAX_ROWS;
                float *out = y + m * N + block * BLOCK;
                TILES[rows](x + m * K, K, k0, k1, w, out, N, k0 ? out : b, k0 > 0);
            }
        }
    }
}
