/* y = x W^T in fp32 for a few rows of x (decode steps): a weight-streaming matrix-vector product.
 *
 * With one to a few rows, a linear layer reads every weight once and does two flops per weight and row: it is
 * bound by memory bandwidth, not arithmetic. MKL's sgemm / sgemv with one row streamed this CPU's weights at
 * ~14 GB/s on 2 threads where a plain sum over the same bytes reads ~27 GB/s; this kernel streams each
 * thread's contiguous share of the weight's rows once, every row of x multiplying a weight row while it sits in
 * L1.
 *
 * Layouts (row-major, contiguous): x [m, k], w [n, k] (PyTorch's linear weight), y [m, n]. Each output is one
 * dot product over k, summed in 8 lanes then across them (another order than MKL's: results differ by fp32
 * rounding, ~1e-6 relative). Rows of the weight are shared out over the caller's OpenMP threads (torch's).
 */
#include <stdint.h>

#define TILE_ROWS 8  /* x rows one pass over a weight row serves (accumulators in registers) */
#define MAX_M 32      /* more rows: the general matmul (MKL) is faster */

#if defined(__AVX2__) && defined(__FMA__) && !defined(TF_PORTABLE_ONLY)
#include <immintrin.h>

static inline float hsum8(__m256 v) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s = _mm_add_ss(s, _mm_movehdup_ps(s));
    return _mm_cvtss_f32(s);
}

/* Weight rows r0 .. r1 against M rows of x (M a constant at each call site below, so the accumulators live in
 * registers); k a multiple of 8 handled by vectors, the rest by scalars. */
static inline __attribute__((always_inline)) void rows_m(const float *x, const float *w, float *y, const int M,
                                                         int64_t k, int64_t n, int64_t r0, int64_t r1) {
    const int64_t kv = k / 8 * 8;
    for (int64_t r = r0; r < r1; r++) {
        const float *wr = w + r * k;
        __m256 acc[TILE_ROWS];
        for (int j = 0; j < M; j++) acc[j] = _mm256_setzero_ps();
        for (int64_t i = 0; i < kv; i += 8) {
            const __m256 wv = _mm256_loadu_ps(wr + i);
            for (int j = 0; j < M; j++) acc[j] = _mm256_fmadd_ps(wv, _mm256_loadu_ps(x + j * k + i), acc[j]);
        }
        for (int j = 0; j < M; j++) {
            float s = hsum8(acc[j]);
            for (int64_t i = kv; i < k; i++) s += wr[i] * x[j * k + i];
            y[j * n + r] = s;
        }
    }
}

static void rows_block(const float *x, const float *w, float *y, int64_t m, int64_t k, int64_t n, int64_t r0,
                       int64_t r1) {
    for (int64_t j = 0; j < m; j += 8) {
        const float *xj = x + j * k;
        float *yj = y + j * n;
        switch (m - j < 8 ? m - j : 8) {
        case 1: rows_m(xj, w, yj, 1, k, n, r0, r1); break;
        case 2: rows_m(xj, w, yj, 2, k, n, r0, r1); break;
        case 3: rows_m(xj, w, yj, 3, k, n, r0, r1); break;
        case 4: rows_m(xj, w, yj, 4, k, n, r0, r1); break;
        case 5: rows_m(xj, w, yj, 5, k, n, r0, r1); break;
        case 6: rows_m(xj, w, yj, 6, k, n, r0, r1); break;
        case 7: rows_m(xj, w, yj, 7, k, n, r0, r1); break;
        default: rows_m(xj, w, yj, 8, k, n, r0, r1); break;
        }
    }
}
#define TF_SKINNY_BUILD 1
#else
static void rows_block(const float *x, const float *w, float *y, int64_t m, int64_t k, int64_t n, int64_t r0,
                       int64_t r1) {
    for (int64_t r = r0; r < r1; r++)
        for (int64_t j = 0; j < m; j++) {
            const float *wr = w + r * k, *xj = x + j * k;
            float lanes[8] = {0};
            int64_t i = 0;
            for (; i + 8 <= k; i += 8)
                for (int l = 0; l < 8; l++) lanes[l] += wr[i + l] * xj[i + l];
            float s = 0.0f;
            for (int l = 0; l < 8; l++) s += lanes[l];
            for (; i < k; i++) s += wr[i] * xj[i];
            y[j * n + r] = s;
        }
}
#define TF_SKINNY_BUILD 0
#endif

/* Which code this build holds: 0 portable C, 1 AVX2 + FMA. */
int tf_skinny_linear_build(void) { return TF_SKINNY_BUILD; }

int tf_skinny_linear_max_rows(void) { return MAX_M; }

/* Returns 0, or -1 when m is out of range (the caller uses its general matmul). */
int tf_skinny_linear(const float *x, const float *w, float *y, int64_t m, int64_t k, int64_t n, int num_threads) {
    if (m < 1 || m > MAX_M || k < 1 || n < 1) return -1;
    /* Chunks of weight rows handed out one at a time (dynamic): on a machine whose cores also run the server's other
     * threads, a thread that loses its core for a while leaves its share to the others instead of holding up the
     * whole step at the loop's end. About 8 chunks per thread, at least 16 rows each. */
    const int threads = n * k < (1 << 16) ? 1 : num_threads;
    int64_t chunk = n / (8 * (int64_t)threads);
    chunk = chunk < 16 ? 16 : (chunk + 15) / 16 * 16;
    const int64_t chunks = (n + chunk - 1) / chunk;
#pragma omp parallel for schedule(dynamic, 1) num_threads(threads)
    for (int64_t c = 0; c < chunks; c++) {
        const int64_t r0 = c * chunk, r1 = r0 + chunk < n ? r0 + chunk : n;
        rows_block(x, w, y, m, k, n, r0, r1);
    }
    return 0;
}
