/* y = x W^T with W kept in GGML's block-quantized formats (Q4_1, Q5_0, Q8_0, Q4_K, Q6_K; the block layouts are
 * documented in models/ggml_quant.py), x and y in fp32.
 *
 * W is read as the GGUF file stores it: n rows, each k / 32 (or k / 256) blocks. A thread takes a chunk of weight
 * rows, four at a time, and dequantizes them with the reference's arithmetic step for step (the same fp32 products
 * and sums, none fused: bitwise the values of ggml_quant.dequantize):
 *   - up to four rows of x (AVX-512 build): in registers, 32 values at a time, each multiplied at once by every row
 *     of x (fused: a decode step reads the quantized bytes and nothing else);
 *   - otherwise into an fp32 buffer (k floats a row: L1 for the models served here, L2 at worst), then multiplied
 *     by the rows of x in register tiles (four weight rows by up to four rows of x): every weight is decoded once
 *     per call whatever the number of rows.
 * Each output is one dot product over k summed in vector lanes, then across them: results differ from the torch
 * reference (dequantize, then F.linear) only by the order of the fp32 sums (~1e-6 relative).
 *
 * Two more entry points change the numerics on purpose (models/quant_linear.py chooses; tests bound each):
 *   - tf_quant_linear_q8 (Q4_1, Q8_0): x quantized to int8 per 32 values, integer dot products (llama.cpp's way);
 *   - tf_quant_linear_bf16 (AVX-512 BF16 builds): bf16 x times the weight rounded to bf16, with vdpbf16ps.
 * tf_quant_dequantize writes the fp32 values (the prefill path hands them to torch's matmul).
 *
 * Builds: AVX-512 (-march=native on CPUs with avx512f), AVX2 + FMA (-DTF_NO_AVX512, or CPUs without AVX-512),
 * portable C (-DTF_PORTABLE_ONLY); tf_quant_linear_build() says which.
 *
 * Layouts (row-major, contiguous): x [m, k], w [n, k / block_elems * block_bytes] bytes, y [m, n]. Rows of the
 * weight are shared out over the caller's OpenMP threads (torch's).
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VL__) && defined(__F16C__) && \
    !defined(TF_PORTABLE_ONLY) && !defined(TF_NO_AVX512)
#define TF_QUANT_AVX512 1
#include <immintrin.h>
#elif defined(__AVX2__) && defined(__FMA__) && defined(__F16C__) && !defined(TF_PORTABLE_ONLY)
#define TF_QUANT_AVX2 1
#include <immintrin.h>
#endif

enum { Q4_1 = 3, Q5_0 = 6, Q8_0 = 8, Q4_K = 12, Q6_K = 14 };  /* ggml_type ids, as GGMLType.type_id */
#define NR 4  /* weight rows dequantized together and multiplied in one register tile */

/* Little-endian fp16 at p, as float (exact: every fp16 is a float). */
static inline float f16(const uint8_t *p) {
    const uint16_t h = (uint16_t)(p[0] | p[1] << 8);
#if defined(__F16C__) && !defined(TF_PORTABLE_ONLY)
    return _cvtsh_ss(h);
#else
    const uint32_t sign = (uint32_t)(h & 0x8000u) << 16, exp = (h >> 10) & 0x1fu, man = h & 0x3ffu;
    uint32_t bits;
    if (exp == 0) {  /* zero or subnormal: man * 2^-24, exact in float */
        const float v = (float)man * 5.9604644775390625e-8f;
        return sign ? -v : v;
    }
    bits = sign | (exp == 0x1f ? 0x7f800000u | man << 13 : (exp + 112) << 23 | man << 13);
    float f;
    memcpy(&f, &bits, sizeof f);
    return f;
#endif
}

/* Row decoders: k values of one weight row into out, as ggml_quant.dequantize computes them. Plain C loops over
 * one block's values, which the compiler vectorizes (no reduction in them). */
static void row_q8_0(const uint8_t *w, int64_t k, float *restrict out) {
    for (int64_t b = 0; b < k / 32; b++, w += 34, out += 32) {
        const float d = f16(w);
        const int8_t *q = (const int8_t *)(w + 2);
        for (int i = 0; i < 32; i++) out[i] = (float)q[i] * d;
    }
}

static void row_q4_1(const uint8_t *w, int64_t k, float *restrict out) {
    for (int64_t b = 0; b < k / 32; b++, w += 20, out += 32) {
        const float d = f16(w), m = f16(w + 2);
        const uint8_t *q = w + 4;
        for (int i = 0; i < 16; i++) {
            out[i] = d * (float)(q[i] & 15) + m;
            out[i + 16] = d * (float)(q[i] >> 4) + m;
        }
    }
}

static void row_q5_0(const uint8_t *w, int64_t k, float *restrict out) {
    for (int64_t b = 0; b < k / 32; b++, w += 22, out += 32) {
        const float d = f16(w);
        uint32_t qh;
        memcpy(&qh, w + 2, 4);
        const uint8_t *q = w + 6;
        for (int i = 0; i < 16; i++) {
            out[i] = d * (float)((int)((q[i] & 15) | ((qh >> i) & 1) << 4) - 16);
            out[i + 16] = d * (float)((int)((q[i] >> 4) | ((qh >> (i + 16)) & 1) << 4) - 16);
        }
    }
}

/* Q4_K's sub-block j (0..7): 6-bit scale and min from the 12 packed bytes s (see ggml_quant._k_scale_min). */
static inline void k_scale_min(const uint8_t *s, int j, int *sc, int *mn) {
    if (j < 4) {
        *sc = s[j] & 63;
        *mn = s[j + 4] & 63;
    } else {
        *sc = (s[j + 4] & 15) | (s[j - 4] >> 6) << 4;
        *mn = (s[j + 4] >> 4) | (s[j] >> 6) << 4;
    }
}

static void row_q4_k(const uint8_t *w, int64_t k, float *restrict out) {
    for (int64_t b = 0; b < k / 256; b++, w += 144) {
        const float d = f16(w), dmin = f16(w + 2);
        for (int j = 0; j < 8; j++, out += 32) {
            int sc, mn;
            k_scale_min(w + 4, j, &sc, &mn);
            const float ds = d * (float)sc, dm = dmin * (float)mn;
            const uint8_t *q = w + 16 + (j / 2) * 32;  /* per 64 values: 32 bytes, low nibbles first */
            const int shift = (j & 1) * 4;
            for (int i = 0; i < 32; i++) out[i] = ds * (float)((q[i] >> shift) & 15) - dm;
        }
    }
}

static void row_q6_k(const uint8_t *w, int64_t k, float *restrict out) {
    for (int64_t b = 0; b < k / 256; b++, w += 210) {
        const float d = f16(w + 208);
        const int8_t *sc = (const int8_t *)(w + 192);
        for (int c = 0; c < 8; c++, out += 32) {  /* values 32c .. 32c + 31 */
            /* per 128 values: 64 bytes of low 4 bits (low nibbles the first 64 values) and 32 bytes of high 2 bits
             * (bit pairs 0, 2, 4, 6: values 0-31, 32-63, 64-95, 96-127) */
            const uint8_t *lo = w + (c / 4) * 64 + (c % 2) * 32, *hi = w + 128 + (c / 4) * 32;
            const int lshift = 4 * ((c / 2) % 2), hshift = 2 * (c % 4);
            const float d0 = d * (float)sc[2 * c], d1 = d * (float)sc[2 * c + 1];
            for (int i = 0; i < 16; i++)
                out[i] = d0 * (float)((int)(((lo[i] >> lshift) & 15) | ((hi[i] >> hshift) & 3) << 4) - 32);
            for (int i = 16; i < 32; i++)
                out[i] = d1 * (float)((int)(((lo[i] >> lshift) & 15) | ((hi[i] >> hshift) & 3) << 4) - 32);
        }
    }
}

typedef void (*row_decoder)(const uint8_t *, int64_t, float *restrict);

static row_decoder decoder(int type, int64_t k, int64_t *row_bytes) {
    switch (type) {
    case Q4_1: *row_bytes = k / 32 * 20; return k % 32 ? 0 : row_q4_1;
    case Q5_0: *row_bytes = k / 32 * 22; return k % 32 ? 0 : row_q5_0;
    case Q8_0: *row_bytes = k / 32 * 34; return k % 32 ? 0 : row_q8_0;
    case Q4_K: *row_bytes = k / 256 * 144; return k % 256 ? 0 : row_q4_k;
    case Q6_K: *row_bytes = k / 256 * 210; return k % 256 ? 0 : row_q6_k;
    default: return 0;
    }
}

/* Dot products of NR dequantized weight rows wb (NR x k, contiguous) with rows of x: y[j * n + r] for the first
 * `rows` weight rows (the others are padding). MR, the rows of x per pass, is a constant at each call site so the
 * accumulators live in registers. k is a multiple of 32. */
#if defined(TF_QUANT_AVX512)
#define MR_MAX 4
/* y[j * n + r] = the sum of acc[r][j]'s lanes, r < rows, j < MR. From two rows of x, the sixteen vectors are
 * reduced together (pairwise adds of unpacked and shuffled halves, ~45 instructions for sixteen sums instead of
 * ~160 for sixteen separate reductions: at k = 576 those were a third of a tile's work). The sums' order differs
 * from _mm512_reduce_add_ps's; one row of x keeps that (the fp32 path's decode-step numerics). */
_Static_assert(NR == 4 && MR_MAX == 4, "store_sums reduces sixteen accumulators: NR x MR_MAX must be 4 x 4");
static inline __attribute__((always_inline)) void store_sums(__m512 acc[NR][MR_MAX], const int MR, float *y,
                                                             int64_t n, int rows) {
    if (MR == 1) {
        for (int r = 0; r < rows; r++) y[r] = _mm512_reduce_add_ps(acc[r][0]);
        return;
    }
    __m512 v[16], h[8], q[4], w[2];
    for (int r = 0; r < NR; r++)
        for (int j = 0; j < 4; j++) v[r * 4 + j] = j < MR ? acc[r][j] : _mm512_setzero_ps();
    for (int i = 0; i < 8; i++) /* per 128-bit lane: (a0+a2, b0+b2, a1+a3, b1+b3) */
        h[i] = _mm512_add_ps(_mm512_unpacklo_ps(v[2 * i], v[2 * i + 1]), _mm512_unpackhi_ps(v[2 * i], v[2 * i + 1]));
    for (int i = 0; i < 4; i++) { /* per 128-bit lane: partial sums of v[4i .. 4i+3], in that order */
        const __m512d a = _mm512_castps_pd(h[2 * i]), b = _mm512_castps_pd(h[2 * i + 1]);
        q[i] = _mm512_add_ps(_mm512_castpd_ps(_mm512_unpacklo_pd(a, b)), _mm512_castpd_ps(_mm512_unpackhi_pd(a, b)));
    }
    for (int i = 0; i < 2; i++) /* lanes: q[2i] (0+1), q[2i] (2+3), q[2i+1] (0+1), q[2i+1] (2+3) */
        w[i] = _mm512_add_ps(_mm512_shuffle_f32x4(q[2 * i], q[2 * i + 1], 0x88),
                             _mm512_shuffle_f32x4(q[2 * i], q[2 * i + 1], 0xDD));
    float sums[16]; /* sums[4r + j]: lane 4 * (r) + j holds v[4r + j]'s total */
    _mm512_storeu_ps(sums, _mm512_add_ps(_mm512_shuffle_f32x4(w[0], w[1], 0x88), _mm512_shuffle_f32x4(w[0], w[1], 0xDD)));
    for (int r = 0; r < rows; r++)
        for (int j = 0; j < MR; j++) y[j * n + r] = sums[r * 4 + j];
}

static inline __attribute__((always_inline)) void tile(const float *wb, const float *x, float *y, const int MR,
                                                       int64_t k, int64_t n, int rows) {
    __m512 acc[NR][MR_MAX];
    for (int r = 0; r < NR; r++)
        for (int j = 0; j < MR; j++) acc[r][j] = _mm512_setzero_ps();
    for (int64_t i = 0; i < k; i += 16) {
        __m512 xv[MR_MAX];
        for (int j = 0; j < MR; j++) xv[j] = _mm512_loadu_ps(x + j * k + i);
        for (int r = 0; r < NR; r++) {
            const __m512 wv = _mm512_loadu_ps(wb + r * k + i);
            for (int j = 0; j < MR; j++) acc[r][j] = _mm512_fmadd_ps(wv, xv[j], acc[r][j]);
        }
    }
    store_sums(acc, MR, y, n, rows);
}
#define TF_QUANT_BUILD 2
#elif defined(TF_QUANT_AVX2)
#define MR_MAX 2  /* 16 ymm registers: 8 accumulators, 2 rows of x, a weight vector */
static inline float hsum8(__m256 v) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s = _mm_add_ss(s, _mm_movehdup_ps(s));
    return _mm_cvtss_f32(s);
}

static inline __attribute__((always_inline)) void tile(const float *wb, const float *x, float *y, const int MR,
                                                       int64_t k, int64_t n, int rows) {
    __m256 acc[NR][MR_MAX];
    for (int r = 0; r < NR; r++)
        for (int j = 0; j < MR; j++) acc[r][j] = _mm256_setzero_ps();
    for (int64_t i = 0; i < k; i += 8) {
        __m256 xv[MR_MAX];
        for (int j = 0; j < MR; j++) xv[j] = _mm256_loadu_ps(x + j * k + i);
        for (int r = 0; r < NR; r++) {
            const __m256 wv = _mm256_loadu_ps(wb + r * k + i);
            for (int j = 0; j < MR; j++) acc[r][j] = _mm256_fmadd_ps(wv, xv[j], acc[r][j]);
        }
    }
    for (int r = 0; r < rows; r++)
        for (int j = 0; j < MR; j++) y[j * n + r] = hsum8(acc[r][j]);
}
#define TF_QUANT_BUILD 1
#else
#define MR_MAX 1
static void tile(const float *wb, const float *x, float *y, const int MR, int64_t k, int64_t n, int rows) {
    (void)MR;
    for (int r = 0; r < rows; r++) {
        const float *w = wb + r * k;
        float lanes[8] = {0};
        for (int64_t i = 0; i < k; i += 8)
            for (int l = 0; l < 8; l++) lanes[l] += w[i + l] * x[i + l];
        float s = 0.0f;
        for (int l = 0; l < 8; l++) s += lanes[l];
        y[r] = s;
    }
    (void)n;
}
#define TF_QUANT_BUILD 0
#endif

/* Up to MR_MAX rows of x (decode steps): the blocks are dequantized in registers as they stream in, four weight rows
 * at a time against every row of x, with no buffer in between (fused). Only the AVX-512 build has this path. */
typedef void (*fused_fn)(const uint8_t *const *wr, const float *x, float *y, int64_t m, int64_t k, int64_t n, int rows);

#if defined(TF_QUANT_AVX512)
/* Decoders: chunk c (values 32c .. 32c + 31) of weight row w as two vectors of 16, the reference's values bitwise
 * (the same fp32 steps as the row decoders above). */
static inline __attribute__((always_inline)) __m512i u8x16(const uint8_t *p) {
    return _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)p));
}

static inline __attribute__((always_inline)) void dec_q8_0(const uint8_t *w, int64_t c, __m512 *v0, __m512 *v1) {
    const uint8_t *b = w + c * 34;
    const __m512 d = _mm512_set1_ps(f16(b));
    *v0 = _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)(b + 2)))), d);
    *v1 = _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)(b + 18)))), d);
}

/* the two fp16 at p (Q4_1's d and m), converted together, each broadcast */
static inline __attribute__((always_inline)) void f16_pair(const uint8_t *p, __m512 *a, __m512 *b) {
    uint32_t v;
    memcpy(&v, p, 4);
    const __m128 f = _mm_cvtph_ps(_mm_cvtsi32_si128((int)v));
    *a = _mm512_broadcastss_ps(f);
    *b = _mm512_broadcastss_ps(_mm_movehdup_ps(f));
}

static inline __attribute__((always_inline)) void dec_q4_1(const uint8_t *w, int64_t c, __m512 *v0, __m512 *v1) {
    const uint8_t *b = w + c * 20;
    __m512 d, m;
    f16_pair(b, &d, &m);
    const __m512i q = u8x16(b + 4), low = _mm512_set1_epi32(15);
    *v0 = _mm512_add_ps(_mm512_mul_ps(d, _mm512_cvtepi32_ps(_mm512_and_si512(q, low))), m);
    *v1 = _mm512_add_ps(_mm512_mul_ps(d, _mm512_cvtepi32_ps(_mm512_srli_epi32(q, 4))), m);
}

/* 32 bytes as 32 floats (unsigned, or signed: `sgn`), two vectors of 16 */
static inline __attribute__((always_inline)) void bytes_f32(__m256i q, const int sgn, __m512 *v0, __m512 *v1) {
    const __m128i a = _mm256_castsi256_si128(q), b = _mm256_extracti128_si256(q, 1);
    *v0 = _mm512_cvtepi32_ps(sgn ? _mm512_cvtepi8_epi32(a) : _mm512_cvtepu8_epi32(a));
    *v1 = _mm512_cvtepi32_ps(sgn ? _mm512_cvtepi8_epi32(b) : _mm512_cvtepu8_epi32(b));
}

/* The K-quants and Q5_0 build a chunk's 32 integers as bytes (one 256-bit op per step for 32 values) before widening
 * them: half the 512-bit operations of widening first. The shifts are 16-bit ones; the masks keep each byte's own
 * bits. */
static inline __attribute__((always_inline)) void dec_q5_0(const uint8_t *w, int64_t c, __m512 *v0, __m512 *v1) {
    const uint8_t *b = w + c * 22;
    const __m512 d = _mm512_set1_ps(f16(b));
    uint32_t qh;
    memcpy(&qh, b + 2, 4);
    const __m128i v = _mm_loadu_si128((const __m128i *)(b + 6));
    const __m256i nib = _mm256_and_si256(_mm256_inserti128_si256(_mm256_castsi128_si256(v), _mm_srli_epi16(v, 4), 1),
                                         _mm256_set1_epi8(15));
    const __m256i q = _mm256_or_si256(nib, _mm256_maskz_mov_epi8((__mmask32)qh, _mm256_set1_epi8(16)));
    bytes_f32(_mm256_sub_epi8(q, _mm256_set1_epi8(16)), 1, v0, v1);
    *v0 = _mm512_mul_ps(d, *v0);
    *v1 = _mm512_mul_ps(d, *v1);
}

/* Sub-block j (0..7) of the K-quant super-block at b (the K-quant tiles below call these with j a constant). */
static inline __attribute__((always_inline)) void dec_q4_k_j(const uint8_t *b, const int j, __m512 *v0, __m512 *v1) {
    int sc, mn;
    k_scale_min(b + 4, j, &sc, &mn);
    const __m512 ds = _mm512_set1_ps(f16(b) * (float)sc), dm = _mm512_set1_ps(f16(b + 2) * (float)mn);
    const __m256i raw = _mm256_loadu_si256((const __m256i *)(b + 16 + (j / 2) * 32));
    const __m256i q = _mm256_and_si256(j & 1 ? _mm256_srli_epi16(raw, 4) : raw, _mm256_set1_epi8(15));
    bytes_f32(q, 0, v0, v1);
    *v0 = _mm512_sub_ps(_mm512_mul_ps(ds, *v0), dm);
    *v1 = _mm512_sub_ps(_mm512_mul_ps(ds, *v1), dm);
}

static inline __attribute__((always_inline)) void dec_q4_k(const uint8_t *w, int64_t c, __m512 *v0, __m512 *v1) {
    dec_q4_k_j(w + (c / 8) * 144, (int)(c % 8), v0, v1);
}

static inline __attribute__((always_inline)) void dec_q6_k_j(const uint8_t *b, const int cc, __m512 *v0, __m512 *v1) {
    const float d = f16(b + 208);
    const int8_t *sc = (const int8_t *)(b + 192);
    const __m256i lo = _mm256_loadu_si256((const __m256i *)(b + (cc / 4) * 64 + (cc % 2) * 32));
    const __m256i hi = _mm256_loadu_si256((const __m256i *)(b + 128 + (cc / 4) * 32));
    const __m256i l = _mm256_and_si256((cc / 2) % 2 ? _mm256_srli_epi16(lo, 4) : lo, _mm256_set1_epi8(15));
    const __m256i h = _mm256_and_si256(_mm256_srl_epi16(hi, _mm_cvtsi32_si128(2 * (cc % 4))), _mm256_set1_epi8(3));
    const __m256i q = _mm256_sub_epi8(_mm256_or_si256(l, _mm256_slli_epi16(h, 4)), _mm256_set1_epi8(32));
    bytes_f32(q, 1, v0, v1);
    *v0 = _mm512_mul_ps(_mm512_set1_ps(d * (float)sc[2 * cc]), *v0);
    *v1 = _mm512_mul_ps(_mm512_set1_ps(d * (float)sc[2 * cc + 1]), *v1);
}

static inline __attribute__((always_inline)) void dec_q6_k(const uint8_t *w, int64_t c, __m512 *v0, __m512 *v1) {
    dec_q6_k_j(w + (c / 8) * 210, (int)(c % 8), v0, v1);
}

/* NR weight rows wr[] (the first `rows` real, the others repeat the last real one) against MR rows of x. */
#define DEFINE_FUSED(T)                                                                                               \
    static inline __attribute__((always_inline)) void fused_tile_##T(const uint8_t *const *wr, const float *x,       \
                                                                     float *y, const int MR, int64_t k, int64_t n,  \
                                                                     int rows) {                                     \
        __m512 acc[NR][MR_MAX];                                                                                       \
        for (int r = 0; r < NR; r++)                                                                                  \
            for (int j = 0; j < MR; j++) acc[r][j] = _mm512_setzero_ps();                                             \
        for (int64_t c = 0; c < k / 32; c++) {                                                                        \
            __m512 x0[MR_MAX], x1[MR_MAX];                                                                            \
            for (int j = 0; j < MR; j++) {                                                                            \
                x0[j] = _mm512_loadu_ps(x + j * k + 32 * c);                                                          \
                x1[j] = _mm512_loadu_ps(x + j * k + 32 * c + 16);                                                     \
            }                                                                                                         \
            for (int r = 0; r < NR; r++) {                                                                            \
                __m512 v0, v1;                                                                                        \
                dec_##T(wr[r], c, &v0, &v1);                                                                          \
                for (int j = 0; j < MR; j++)                                                                          \
                    acc[r][j] = _mm512_fmadd_ps(v1, x1[j], _mm512_fmadd_ps(v0, x0[j], acc[r][j]));                    \
            }                                                                                                         \
        }                                                                                                             \
        store_sums(acc, MR, y, n, rows);                                                                              \
    }                                                                                                                 \
    static void fused_##T(const uint8_t *const *wr, const float *x, float *y, int64_t m, int64_t k, int64_t n,       \
                          int rows) {                                                                                 \
        switch (m) {                                                                                                  \
        case 1: fused_tile_##T(wr, x, y, 1, k, n, rows); break;                                                       \
        case 2: fused_tile_##T(wr, x, y, 2, k, n, rows); break;                                                       \
        case 3: fused_tile_##T(wr, x, y, 3, k, n, rows); break;                                                       \
        default: fused_tile_##T(wr, x, y, 4, k, n, rows); break;                                                      \
        }                                                                                                             \
    }
DEFINE_FUSED(q8_0)
DEFINE_FUSED(q4_1)
DEFINE_FUSED(q5_0)

/* The same for the K-quants, a super-block (eight chunks) at a time, unrolled: each chunk's shifts and scale
 * unpacking are constants, and the super-block's fp16 scales are loaded once (one-row Q4_K ~1.5x). */
#define DEFINE_FUSED_K(T, BB)                                                                                         \
    static inline __attribute__((always_inline)) void fused_tile_##T(const uint8_t *const *wr, const float *x,       \
                                                                     float *y, const int MR, int64_t k, int64_t n,  \
                                                                     int rows) {                                     \
        __m512 acc[NR][MR_MAX];                                                                                       \
        for (int r = 0; r < NR; r++)                                                                                  \
            for (int j = 0; j < MR; j++) acc[r][j] = _mm512_setzero_ps();                                             \
        for (int64_t s = 0; s < k / 256; s++) {                                                                       \
            _Pragma("GCC unroll 8") for (int u = 0; u < 8; u++) {                                                     \
                const int64_t c = s * 8 + u;                                                                          \
                __m512 x0[MR_MAX], x1[MR_MAX];                                                                        \
                for (int j = 0; j < MR; j++) {                                                                        \
                    x0[j] = _mm512_loadu_ps(x + j * k + 32 * c);                                                      \
                    x1[j] = _mm512_loadu_ps(x + j * k + 32 * c + 16);                                                 \
                }                                                                                                     \
                for (int r = 0; r < NR; r++) {                                                                        \
                    __m512 v0, v1;                                                                                    \
                    dec_##T##_j(wr[r] + s * (BB), u, &v0, &v1);                                                       \
                    for (int j = 0; j < MR; j++)                                                                      \
                        acc[r][j] = _mm512_fmadd_ps(v1, x1[j], _mm512_fmadd_ps(v0, x0[j], acc[r][j]));                \
                }                                                                                                     \
            }                                                                                                         \
        }                                                                                                             \
        store_sums(acc, MR, y, n, rows);                                                                              \
    }                                                                                                                 \
    static void fused_##T(const uint8_t *const *wr, const float *x, float *y, int64_t m, int64_t k, int64_t n,       \
                          int rows) {                                                                                 \
        switch (m) {                                                                                                  \
        case 1: fused_tile_##T(wr, x, y, 1, k, n, rows); break;                                                       \
        case 2: fused_tile_##T(wr, x, y, 2, k, n, rows); break;                                                       \
        case 3: fused_tile_##T(wr, x, y, 3, k, n, rows); break;                                                       \
        default: fused_tile_##T(wr, x, y, 4, k, n, rows); break;                                                      \
        }                                                                                                             \
    }
DEFINE_FUSED_K(q4_k, 144)
DEFINE_FUSED_K(q6_k, 210)

/* Row decoders for the buffer path: the same values, 32 at a time. */
#define DEFINE_ROW512(T)                                                                                              \
    static void row512_##T(const uint8_t *w, int64_t k, float *restrict out) {                                        \
        for (int64_t c = 0; c < k / 32; c++) {                                                                        \
            __m512 v0, v1;                                                                                            \
            dec_##T(w, c, &v0, &v1);                                                                                  \
            _mm512_storeu_ps(out + 32 * c, v0);                                                                       \
            _mm512_storeu_ps(out + 32 * c + 16, v1);                                                                  \
        }                                                                                                             \
    }
DEFINE_ROW512(q8_0)
DEFINE_ROW512(q4_1)
DEFINE_ROW512(q5_0)
DEFINE_ROW512(q4_k)
DEFINE_ROW512(q6_k)

static row_decoder simd_decoder(int type, row_decoder portable) {
    switch (type) {
    case Q4_1: return row512_q4_1;
    case Q5_0: return row512_q5_0;
    case Q8_0: return row512_q8_0;
    case Q4_K: return row512_q4_k;
    case Q6_K: return row512_q6_k;
    default: return portable;
    }
}

static fused_fn fused_for(int type, int64_t m) {
    if (m > MR_MAX) return 0;
    switch (type) {
    case Q4_1: return fused_q4_1;
    case Q5_0: return fused_q5_0;
    case Q8_0: return fused_q8_0;
    case Q4_K: return fused_q4_k;
    case Q6_K: return fused_q6_k;
    default: return 0;
    }
}
#else
static row_decoder simd_decoder(int type, row_decoder portable) {
    (void)type;
    return portable;
}

static fused_fn fused_for(int type, int64_t m) {
    (void)type, (void)m;
    return 0;
}
#endif

/* NR dequantized weight rows (the first `rows` of them real) against all m rows of x. */
static void rows_times_x(const float *wb, const float *x, float *y, int64_t m, int64_t k, int64_t n, int rows) {
    for (int64_t j = 0; j < m; j += MR_MAX) {
        const float *xj = x + j * k;
        float *yj = y + j * n;
        switch (m - j < MR_MAX ? m - j : MR_MAX) {
#if MR_MAX >= 4
        case 4: tile(wb, xj, yj, 4, k, n, rows); break;
        case 3: tile(wb, xj, yj, 3, k, n, rows); break;
#endif
#if MR_MAX >= 2
        case 2: tile(wb, xj, yj, 2, k, n, rows); break;
#endif
        default: tile(wb, xj, yj, 1, k, n, rows); break;
        }
    }
}

/* Which code this build holds: 0 portable C, 1 AVX2 + FMA, 2 AVX-512. */
int tf_quant_linear_build(void) { return TF_QUANT_BUILD; }

/* Weight rows per chunk handed to a thread: about 8 chunks per thread (dynamic: a thread that loses its core for a
 * while leaves its share to the others), a multiple of NR, at least 16 rows. */
static int64_t chunk_rows(int64_t n, int threads) {
    int64_t chunk = n / (8 * (int64_t)threads);
    return chunk < 16 ? 16 : (chunk + 15) / 16 * 16;
}

/* The next group of weight rows, asked for while this one is computed: a group is NR short rows read side by side
 * (Q8_0 at k = 576: four streams of 612 bytes), too short for the hardware prefetcher to follow, so without this a
 * one-row step read its weights from memory at under half the rate it multiplies them from cache. Prefetching past
 * the weight's end is harmless (prefetches never fault). */
static inline void prefetch_group(const uint8_t *p, int64_t nbytes) {
    for (int64_t i = 0; i < nbytes; i += 64) __builtin_prefetch(p + i, 0, 3);
}

/* y [m, n] = x [m, k] W^T for W of ggml type `type`. Returns 0; -1 when the shapes or the type are not supported
 * (k not whole blocks), -2 when a thread's buffer could not be allocated. */
int tf_quant_linear(int type, const float *x, const uint8_t *w, float *y, int64_t m, int64_t k, int64_t n,
                    int num_threads) {
    int64_t row_bytes = 0;
    const row_decoder decode = simd_decoder(type, decoder(type, k, &row_bytes));
    if (!decoder(type, k, &row_bytes) || m < 1 || k < 1 || n < 1) return -1;
    const int threads = n * k < (1 << 16) || num_threads < 1 ? 1 : num_threads;
    const int64_t chunk = chunk_rows(n, threads), chunks = (n + chunk - 1) / chunk;
    const fused_fn fused = fused_for(type, m);
    int failed = 0;
#pragma omp parallel num_threads(threads)
    {
        float *wb = fused ? 0 : calloc((size_t)(NR * k), sizeof(float));
        if (!fused && !wb) {
#pragma omp atomic write
            failed = 1;
        }
#pragma omp for schedule(dynamic, 1)
        for (int64_t c = 0; c < chunks; c++) {
            if (!fused && !wb) continue;
            const int64_t r1 = (c + 1) * chunk < n ? (c + 1) * chunk : n;
            for (int64_t r = c * chunk; r < r1; r += NR) {
                const int rows = r1 - r < NR ? (int)(r1 - r) : NR;
                prefetch_group(w + (r + NR) * row_bytes, NR * row_bytes);
                if (fused) {
                    const uint8_t *wr[NR];
                    for (int i = 0; i < NR; i++) wr[i] = w + (r + (i < rows ? i : rows - 1)) * row_bytes;
                    fused(wr, x, y + r, m, k, n, rows);
                    continue;
                }
                for (int i = 0; i < rows; i++) decode(w + (r + i) * row_bytes, k, wb + i * k);
                rows_times_x(wb, x, y + r, m, k, n, rows);
            }
        }
        free(wb);
    }
    return failed ? -2 : 0;
}

/* out [n, k] fp32 = the dequantized W (as ggml_quant.dequantize), rows shared out over the threads. Returns 0, or -1
 * as tf_quant_linear. */
int tf_quant_dequantize(int type, const uint8_t *w, float *out, int64_t n, int64_t k, int num_threads) {
    int64_t row_bytes = 0;
    const row_decoder decode = simd_decoder(type, decoder(type, k, &row_bytes));
    if (!decoder(type, k, &row_bytes) || k < 1 || n < 0) return -1;
    const int threads = n * k < (1 << 16) || num_threads < 1 ? 1 : num_threads;
#pragma omp parallel for schedule(static) num_threads(threads)
    for (int64_t r = 0; r < n; r++) decode(w + r * row_bytes, k, out + r * k);
    return 0;
}

/* ---- bf16 activations (AVX-512 BF16 builds): y = x W^T with x bf16 and W rounded to bf16 ----
 *
 * For a bf16 model's steps of several rows: the weight rows are dequantized as above, rounded to bf16 (to nearest
 * even: the values ggml_quant.dequantize(w, torch.bfloat16) holds) into a buffer, and multiplied with vdpbf16ps,
 * 32 products per instruction summed in fp32 (twice the fp32 FMA's): the numerics of dequantizing the weight to
 * bf16 and multiplying with oneDNN, the path this replaces for up to a few dozen rows. */
#if defined(TF_QUANT_AVX512) && defined(__AVX512BF16__)
#define DEFINE_ROW_BF16(T)                                                                                            \
    static void row_bf16_##T(const uint8_t *w, int64_t k, uint16_t *out) {                                            \
        for (int64_t c = 0; c < k / 32; c++) {                                                                        \
            __m512 v0, v1;                                                                                            \
            dec_##T(w, c, &v0, &v1);                                                                                  \
            _mm512_storeu_si512((void *)(out + 32 * c), (__m512i)_mm512_cvtne2ps_pbh(v1, v0));                        \
        }                                                                                                             \
    }
DEFINE_ROW_BF16(q8_0)
DEFINE_ROW_BF16(q4_1)
DEFINE_ROW_BF16(q5_0)
DEFINE_ROW_BF16(q4_k)
DEFINE_ROW_BF16(q6_k)

typedef void (*row_bf16_fn)(const uint8_t *, int64_t, uint16_t *);

static row_bf16_fn bf16_decoder(int type) {
    switch (type) {
    case Q4_1: return row_bf16_q4_1;
    case Q5_0: return row_bf16_q5_0;
    case Q8_0: return row_bf16_q8_0;
    case Q4_K: return row_bf16_q4_k;
    case Q6_K: return row_bf16_q6_k;
    default: return 0;
    }
}

/* NR bf16 weight rows wb (NR x k) against MR rows of bf16 x; k a multiple of 32. */
static inline __attribute__((always_inline)) void bf16_tile(const uint16_t *wb, const uint16_t *x, float *y,
                                                            const int MR, int64_t k, int64_t n, int rows) {
    __m512 acc[NR][MR_MAX];
    for (int r = 0; r < NR; r++)
        for (int j = 0; j < MR; j++) acc[r][j] = _mm512_setzero_ps();
    for (int64_t i = 0; i < k; i += 32) {
        __m512bh xv[4];
        for (int j = 0; j < MR; j++) xv[j] = (__m512bh)_mm512_loadu_si512((const void *)(x + j * k + i));
        for (int r = 0; r < NR; r++) {
            const __m512bh wv = (__m512bh)_mm512_loadu_si512((const void *)(wb + r * k + i));
            for (int j = 0; j < MR; j++) acc[r][j] = _mm512_dpbf16_ps(acc[r][j], wv, xv[j]);
        }
    }
    store_sums(acc, MR, y, n, rows);
}

int tf_quant_linear_has_bf16(void) { return 1; }

/* out [n, k] bf16 = W's values rounded to bf16 (to nearest even), for the prefill path of a bf16 model: half the
 * bytes written of dequantizing to fp32 and converting. Returns 0; -1 for types or shapes out of range. */
int tf_quant_dequantize_bf16(int type, const uint8_t *w, uint16_t *out, int64_t n, int64_t k, int num_threads) {
    int64_t row_bytes = 0;
    const row_bf16_fn decode = bf16_decoder(type);
    if (!decode || !decoder(type, k, &row_bytes) || k < 1 || n < 0) return -1;
    const int threads = n * k < (1 << 16) || num_threads < 1 ? 1 : num_threads;
#pragma omp parallel for schedule(static) num_threads(threads)
    for (int64_t r = 0; r < n; r++) decode(w + r * row_bytes, k, out + r * k);
    return 0;
}

/* y [m, n] fp32 = x [m, k] bf16 times W^T rounded to bf16. Returns 0; -1 for shapes or types out of range (or a
 * build without AVX-512 BF16), -2 when a thread's buffer could not be allocated. */
int tf_quant_linear_bf16(int type, const uint16_t *x, const uint8_t *w, float *y, int64_t m, int64_t k, int64_t n,
                         int num_threads) {
    int64_t row_bytes = 0;
    const row_bf16_fn decode = bf16_decoder(type);
    if (!decode || !decoder(type, k, &row_bytes) || m < 1 || k < 1 || n < 1) return -1;
    const int threads = n * k < (1 << 16) || num_threads < 1 ? 1 : num_threads;
    const int64_t chunk = chunk_rows(n, threads), chunks = (n + chunk - 1) / chunk;
    int failed = 0;
#pragma omp parallel num_threads(threads)
    {
        uint16_t *wb = calloc((size_t)(NR * k), sizeof(uint16_t));
        if (!wb) {
#pragma omp atomic write
            failed = 1;
        }
#pragma omp for schedule(dynamic, 1)
        for (int64_t c = 0; c < chunks; c++) {
            if (!wb) continue;
            const int64_t r1 = (c + 1) * chunk < n ? (c + 1) * chunk : n;
            for (int64_t r = c * chunk; r < r1; r += NR) {
                const int rows = r1 - r < NR ? (int)(r1 - r) : NR;
                prefetch_group(w + (r + NR) * row_bytes, NR * row_bytes);
                for (int i = 0; i < rows; i++) decode(w + (r + i) * row_bytes, k, wb + i * k);
                for (int64_t j = 0; j < m; j += 4) {
                    const uint16_t *xj = x + j * k;
                    float *yj = y + j * n + r;
                    switch (m - j < 4 ? m - j : 4) {
                    case 1: bf16_tile(wb, xj, yj, 1, k, n, rows); break;
                    case 2: bf16_tile(wb, xj, yj, 2, k, n, rows); break;
                    case 3: bf16_tile(wb, xj, yj, 3, k, n, rows); break;
                    default: bf16_tile(wb, xj, yj, 4, k, n, rows); break;
                    }
                }
            }
        }
        free(wb);
    }
    return failed ? -2 : 0;
}
#else
int tf_quant_linear_has_bf16(void) { return 0; }

int tf_quant_dequantize_bf16(int type, const uint8_t *w, uint16_t *out, int64_t n, int64_t k, int num_threads) {
    (void)type, (void)w, (void)out, (void)n, (void)k, (void)num_threads;
    return -1;
}

int tf_quant_linear_bf16(int type, const uint16_t *x, const uint8_t *w, float *y, int64_t m, int64_t k, int64_t n,
                         int num_threads) {
    (void)type, (void)x, (void)w, (void)y, (void)m, (void)k, (void)n, (void)num_threads;
    return -1;
}
#endif

/* ---- int8 activations (Q4_1 and Q8_0): y = x W^T with x quantized per 32 values, as llama.cpp computes it ----
 *
 * Each 32 values of a row of x become int8 q with one fp32 scale dx = max |x| / 127 (q = x / dx rounded to nearest),
 * so a block's dot product is an integer one (vpdpbusd with AVX-512 VNNI, vpmaddubsw + vpmaddwd with AVX2, exact
 * int32 either way) times dw * dx; Q4_1's offset m adds m times the block's exact fp32 sum of x. Faster than the
 * fp32 path, but x is rounded: each x_i moves by up to dx / 2, so an output moves by up to
 * sum_i |w_i| dx_block(i) / 2 (~0.5% of its scale for unit-normal x; callers check against that bound, models.
 * quant_linear). Builds agree on the quantized x bitwise (rounding to nearest even, the default mode) and differ
 * only in the order of fp32 sums. */

/* x [m, k] -> qx [m, k], dx and sx [m, k / 32] (scale, and the block's fp32 sum). */
static void quantize_x(const float *x, int64_t m, int64_t k, int8_t *qx, float *dx, float *sx) {
    for (int64_t b = 0; b < m * (k / 32); b++) {
        const float *v = x + b * 32;
        float amax = 0.0f, sum = 0.0f;
        for (int i = 0; i < 32; i++) {
            const float a = fabsf(v[i]);
            amax = a > amax ? a : amax;
            sum += v[i];
        }
        const float d = amax / 127.0f, id = d > 0.0f ? 1.0f / d : 0.0f;
        for (int i = 0; i < 32; i++) qx[b * 32 + i] = (int8_t)lrintf(v[i] * id);
        dx[b] = d;
        sx[b] = sum;
    }
}

#if defined(TF_QUANT_AVX512) || defined(TF_QUANT_AVX2)
#if defined(TF_QUANT_AVX512)
#define QMR 4  /* rows of x per tile */
#else
#define QMR 2  /* 16 ymm registers */
#endif
/* sum over 4-byte groups of u (unsigned) times s (signed), in 8 int32 lanes; exact for these operands (|u| <= 255,
 * the products' pairs within int16 for vpmaddubsw: Q4_1's u <= 15, Q8_0's |u| <= 128 against |s| <= 127). */
static inline __attribute__((always_inline)) __m256i dot_u8s8(__m256i u, __m256i s) {
#if defined(__AVX512VNNI__) && defined(__AVX512VL__) && defined(TF_QUANT_AVX512)
    return _mm256_dpbusd_epi32(_mm256_setzero_si256(), u, s);
#else
    return _mm256_madd_epi16(_mm256_maddubs_epi16(u, s), _mm256_set1_epi16(1));
#endif
}

static inline float hsum8q(__m256 v) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s = _mm_add_ss(s, _mm_movehdup_ps(s));
    return _mm_cvtss_f32(s);
}

/* NR weight rows wr[] (the first `rows` real) against MR rows of quantized x (nb blocks a row). */
static inline __attribute__((always_inline)) void q8_tile(int type, const uint8_t *const *wr, const int8_t *qx,
                                                          const float *dx, const float *sx, float *y, const int MR,
                                                          int64_t nb, int64_t n, int rows) {
    __m256 acc[NR][QMR];
    float msum[NR][QMR];
    for (int r = 0; r < NR; r++)
        for (int j = 0; j < MR; j++) acc[r][j] = _mm256_setzero_ps(), msum[r][j] = 0.0f;
    for (int64_t b = 0; b < nb; b++) {
        __m256i xq[QMR];
        for (int j = 0; j < MR; j++) xq[j] = _mm256_loadu_si256((const __m256i *)(qx + (j * nb + b) * 32));
        for (int r = 0; r < NR; r++) {
            if (type == Q8_0) {
                const uint8_t *blk = wr[r] + b * 34;
                const float d = f16(blk);
                const __m256i wq = _mm256_loadu_si256((const __m256i *)(blk + 2)), aw = _mm256_abs_epi8(wq);
                for (int j = 0; j < MR; j++) {
                    const __m256i s = dot_u8s8(aw, _mm256_sign_epi8(xq[j], wq));
                    acc[r][j] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(s), _mm256_set1_ps(d * dx[j * nb + b]), acc[r][j]);
                }
            } else {
                const uint8_t *blk = wr[r] + b * 20;
                const float d = f16(blk), mm = f16(blk + 2);
                const __m128i v = _mm_loadu_si128((const __m128i *)(blk + 4));
                const __m256i wq = _mm256_and_si256(
                    _mm256_inserti128_si256(_mm256_castsi128_si256(v), _mm_srli_epi16(v, 4), 1), _mm256_set1_epi8(15));
                for (int j = 0; j < MR; j++) {
                    const __m256i s = dot_u8s8(wq, xq[j]);
                    acc[r][j] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(s), _mm256_set1_ps(d * dx[j * nb + b]), acc[r][j]);
                    msum[r][j] += mm * sx[j * nb + b];
                }
            }
        }
    }
    for (int r = 0; r < rows; r++)
        for (int j = 0; j < MR; j++) y[j * n + r] = hsum8q(acc[r][j]) + msum[r][j];
}

/* One row of x (a decode step), eight blocks at a time: the eight blocks' integer dot products are summed across
 * their lanes together (a vphaddd tree: one vector of eight block sums), so the scales, converted eight at a time
 * (vcvtph2ps of eight fp16), multiply them in one instruction: fewer instructions per block than q8_tile (Q4_1
 * 15-20% faster in cache; Q8_0 measured slower, so only Q4_1 takes it). */
static inline __attribute__((always_inline)) __m256i block_sums8(const __m256i *s) {
    const __m256i h01 = _mm256_hadd_epi32(s[0], s[1]), h23 = _mm256_hadd_epi32(s[2], s[3]);
    const __m256i h45 = _mm256_hadd_epi32(s[4], s[5]), h67 = _mm256_hadd_epi32(s[6], s[7]);
    const __m256i q0 = _mm256_hadd_epi32(h01, h23), q1 = _mm256_hadd_epi32(h45, h67);
    return _mm256_add_epi32(_mm256_permute2x128_si256(q0, q1, 0x20), _mm256_permute2x128_si256(q0, q1, 0x31));
}

/* eight fp16 at p, p + stride, ... as floats */
static inline __attribute__((always_inline)) __m256 f16x8(const uint8_t *p, int64_t stride) {
    __m128i h = _mm_setzero_si128();
    uint16_t v;
#define TF_LANE(t) memcpy(&v, p + (t) * stride, 2), h = _mm_insert_epi16(h, v, t)
    TF_LANE(0); TF_LANE(1); TF_LANE(2); TF_LANE(3); TF_LANE(4); TF_LANE(5); TF_LANE(6); TF_LANE(7);
#undef TF_LANE
    return _mm256_cvtph_ps(h);
}

static inline __attribute__((always_inline)) void q8_one_row(const int type, const uint8_t *const *wr,
                                                             const int8_t *qx, const float *dx, const float *sx,
                                                             float *y, int64_t nb, int rows) {
    const int64_t bb = type == Q8_0 ? 34 : 20;
    for (int r = 0; r < NR; r++) {
        if (r >= rows) break;
        __m256 acc = _mm256_setzero_ps(), macc = _mm256_setzero_ps();
        int64_t b = 0;
        for (; b + 8 <= nb; b += 8) {
            const uint8_t *blk = wr[r] + b * bb;
            __m256i s[8];
            for (int t = 0; t < 8; t++) {
                const __m256i xq = _mm256_loadu_si256((const __m256i *)(qx + (b + t) * 32));
                if (type == Q8_0) {
                    const __m256i wq = _mm256_loadu_si256((const __m256i *)(blk + t * bb + 2));
                    s[t] = dot_u8s8(_mm256_abs_epi8(wq), _mm256_sign_epi8(xq, wq));
                } else {
                    const __m128i v = _mm_loadu_si128((const __m128i *)(blk + t * bb + 4));
                    const __m256i wq = _mm256_and_si256(
                        _mm256_inserti128_si256(_mm256_castsi128_si256(v), _mm_srli_epi16(v, 4), 1),
                        _mm256_set1_epi8(15));
                    s[t] = dot_u8s8(wq, xq);
                }
            }
            const __m256 scale = _mm256_mul_ps(f16x8(blk, bb), _mm256_loadu_ps(dx + b));
            acc = _mm256_fmadd_ps(_mm256_cvtepi32_ps(block_sums8(s)), scale, acc);
            if (type == Q4_1) macc = _mm256_fmadd_ps(f16x8(blk + 2, bb), _mm256_loadu_ps(sx + b), macc);
        }
        float tail = 0.0f;
        for (; b < nb; b++) {  /* the last nb % 8 blocks, one at a time */
            const uint8_t *blk = wr[r] + b * bb;
            const __m256i xq = _mm256_loadu_si256((const __m256i *)(qx + b * 32));
            __m256i sum;
            if (type == Q8_0) {
                const __m256i wq = _mm256_loadu_si256((const __m256i *)(blk + 2));
                sum = dot_u8s8(_mm256_abs_epi8(wq), _mm256_sign_epi8(xq, wq));
            } else {
                const __m128i v = _mm_loadu_si128((const __m128i *)(blk + 4));
                sum = dot_u8s8(_mm256_and_si256(_mm256_inserti128_si256(_mm256_castsi128_si256(v), _mm_srli_epi16(v, 4), 1),
                                                _mm256_set1_epi8(15)), xq);
                tail += f16(blk + 2) * sx[b];
            }
            tail += hsum8q(_mm256_cvtepi32_ps(sum)) * (f16(blk) * dx[b]);
        }
        y[r] = hsum8q(acc) + hsum8q(macc) + tail;
    }
}

static void q8_rows(int type, const uint8_t *const *wr, const int8_t *qx, const float *dx, const float *sx, float *y,
                    int64_t m, int64_t nb, int64_t n, int rows) {
    for (int64_t j = 0; j < m; j += QMR) {
        if (m == 1 && type == Q4_1) {  /* a decode step (Q8_0's measured slower this way: q8_tile serves it) */
            q8_one_row(Q4_1, wr, qx, dx, sx, y, nb, rows);
            return;
        }
        const int8_t *q = qx + j * nb * 32;
        const float *d = dx + j * nb, *s = sx + j * nb;
        float *yj = y + j * n;
        const int64_t left = m - j;
        if (type == Q8_0) {
            switch (left < QMR ? left : QMR) {
#if QMR >= 4
            case 4: q8_tile(Q8_0, wr, q, d, s, yj, 4, nb, n, rows); break;
            case 3: q8_tile(Q8_0, wr, q, d, s, yj, 3, nb, n, rows); break;
#endif
            case 2: q8_tile(Q8_0, wr, q, d, s, yj, 2, nb, n, rows); break;
            default: q8_tile(Q8_0, wr, q, d, s, yj, 1, nb, n, rows); break;
            }
        } else {
            switch (left < QMR ? left : QMR) {
#if QMR >= 4
            case 4: q8_tile(Q4_1, wr, q, d, s, yj, 4, nb, n, rows); break;
            case 3: q8_tile(Q4_1, wr, q, d, s, yj, 3, nb, n, rows); break;
#endif
            case 2: q8_tile(Q4_1, wr, q, d, s, yj, 2, nb, n, rows); break;
            default: q8_tile(Q4_1, wr, q, d, s, yj, 1, nb, n, rows); break;
            }
        }
    }
}
#else
static void q8_rows(int type, const uint8_t *const *wr, const int8_t *qx, const float *dx, const float *sx, float *y,
                    int64_t m, int64_t nb, int64_t n, int rows) {
    for (int r = 0; r < rows; r++)
        for (int64_t j = 0; j < m; j++) {
            float acc = 0.0f, msum = 0.0f;
            for (int64_t b = 0; b < nb; b++) {
                const int8_t *xq = qx + (j * nb + b) * 32;
                int32_t s = 0;
                if (type == Q8_0) {
                    const uint8_t *blk = wr[r] + b * 34;
                    const int8_t *qw = (const int8_t *)(blk + 2);  /* GCC 12.2 -O3 vectorized (int8_t)blk[i] * x as unsigned */
                    for (int i = 0; i < 32; i++) s += qw[i] * xq[i];
                    acc += (float)s * (f16(blk) * dx[j * nb + b]);
                } else {
                    const uint8_t *blk = wr[r] + b * 20;
                    for (int i = 0; i < 16; i++) s += (blk[4 + i] & 15) * xq[i] + (blk[4 + i] >> 4) * xq[i + 16];
                    acc += (float)s * (f16(blk) * dx[j * nb + b]);
                    msum += f16(blk + 2) * sx[j * nb + b];
                }
            }
            y[j * n + r] = acc + msum;
        }
}
#endif

/* y [m, n] = (x [m, k] quantized per 32 values) W^T for W in Q4_1 or Q8_0. Returns 0; -1 for another type or shapes
 * out of range, -2 when the quantized x could not be allocated. */
int tf_quant_linear_q8(int type, const float *x, const uint8_t *w, float *y, int64_t m, int64_t k, int64_t n,
                       int num_threads) {
    int64_t row_bytes = 0;
    if ((type != Q4_1 && type != Q8_0) || !decoder(type, k, &row_bytes) || m < 1 || k < 1 || n < 1) return -1;
    const int64_t nb = k / 32;
    int8_t *qx = malloc((size_t)(m * k));
    float *dx = malloc((size_t)(m * nb) * sizeof(float)), *sx = malloc((size_t)(m * nb) * sizeof(float));
    if (!qx || !dx || !sx) {
        free(qx), free(dx), free(sx);
        return -2;
    }
    quantize_x(x, m, k, qx, dx, sx);
    const int threads = n * k < (1 << 16) || num_threads < 1 ? 1 : num_threads;
    const int64_t chunk = chunk_rows(n, threads), chunks = (n + chunk - 1) / chunk;
#pragma omp parallel for schedule(dynamic, 1) num_threads(threads)
    for (int64_t c = 0; c < chunks; c++) {
        const int64_t r1 = (c + 1) * chunk < n ? (c + 1) * chunk : n;
        for (int64_t r = c * chunk; r < r1; r += NR) {
            const int rows = r1 - r < NR ? (int)(r1 - r) : NR;
            const uint8_t *wr[NR];
            for (int i = 0; i < NR; i++) wr[i] = w + (r + (i < rows ? i : rows - 1)) * row_bytes;
            if (m > 1 || type != Q4_1) /* q8_one_row streams Q4_1 at full speed without it (measured slower with) */
                prefetch_group(w + (r + NR) * row_bytes, NR * row_bytes);
            q8_rows(type, wr, qx, dx, sx, y + r, m, nb, n, rows);
        }
    }
    free(qx), free(dx), free(sx);
    return 0;
}
