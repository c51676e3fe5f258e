/* Paged attention for any number of query tokens per request (decode: one; speculative
 * verification: a few; prefill chunks: many), reading K/V blocks where they lie in the cache:
 * no gather, no padding.
 *
 * bf16 in, bf16 out; scores, softmax and the P.V accumulation in fp32 (one rounding, at the
 * output), as HF's SDPA kernels and vLLM's paged attention keep them. Or (kind = KIND_F32, the CPU's
 * default dtype) fp32 queries, caches and output, through the portable code.
 *
 * Layouts (row-major, contiguous):
 *   q, out        [num_queries, num_heads, head_dim]            bf16 as uint16
 *   k/v cache     [num_kv_heads, num_blocks, block_size, head_dim] bf16 as uint16
 *                 or (kind = KIND_FP8) FP8 rows [num_kv_heads, num_blocks, block_size, head_dim + FP8_ROW_PAD]
 *                 uint8: e4m3 values, the row's fp32 scale, zero padding (tokenfleet/models/kv_fp8.py)
 *   block_table   [num_requests, max_blocks]                    int64
 *   context_lens  [num_requests]  keys the request's last query token sees (its own included)
 *   query_start   [num_requests + 1]  request r owns query rows query_start[r] .. query_start[r+1]-1
 * Query row j (0-based) of a request with n query rows and context length L sees keys 0 .. L-n+j;
 * with a sliding window W > 0 (Gemma 3's local layers) only the last W of them: L-n+j-W+1 .. L-n+j.
 * Blocks the window no longer reaches may be the null block: they are never read.
 *
 * Work item: (request, kv head, up to ROWS_PER_ITEM of its query rows); the item's query heads
 * (GQA group) x rows share each K/V row as it is loaded, and keys past what the item's last row
 * sees are never read (causal). Items run on the caller's OpenMP runtime (torch's, loaded first):
 * num_threads is torch.get_num_threads().
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#define MAX_HEAD_DIM 256
#define FP8_ROW_PAD 16 /* kv_fp8.ROW_PAD: an FP8 row is head_dim e4m3 bytes, its fp32 scale, zeros to 16 bytes */
#define ROWS_PER_ITEM 32

enum { KIND_BF16 = 0, KIND_FP8 = 1, KIND_F32 = 2 }; /* what q, out and the caches hold */

typedef struct {
    const uint16_t *q, *k_cache, *v_cache; /* FP8 rows: the caches' bytes, cast */
    const int64_t *table; /* this request's block table */
    uint16_t *out;
    int64_t num_heads, num_kv_heads, head_dim, block_size, num_blocks;
    float scale;
    int64_t window; /* 0: every earlier key */
    int fp8;        /* the caches hold FP8 rows */
    int f32;        /* q, out and the caches are fp32 (the uint16_t pointers above point at floats) */
} Args;

typedef struct {
    int64_t request;
    int64_t kv_head;
    int64_t first_row;   /* the request's first query row in q / out */
    int64_t num_rows;    /* n: the request's query rows */
    int64_t context_len; /* L */
    int64_t row0, row1;  /* this item's rows, relative to the request */
} Item;

static inline float bf16_to_f32(uint16_t h) {
    uint32_t u = (uint32_t)h << 16;
    float f;
    memcpy(&f, &u, sizeof f);
    return f;
}

static inline uint16_t f32_to_bf16(float f) { /* round to nearest even */
    uint32_t u;
    memcpy(&u, &f, sizeof u);
    if ((u & 0x7f800000u) == 0x7f800000u) return (uint16_t)(u >> 16); /* inf / nan pass through */
    u += 0x7fffu + ((u >> 16) & 1u);
    return (uint16_t)(u >> 16);
}

/* exp(x) for x <= 0 (scores minus their row max): 2^t = 2^floor(t) * p(frac(t)), p a degree-5
 * least-squares fit of 2^f on [0, 1) (relative error < 1e-7, below fp32's epsilon). Plain float
 * code so the compiler vectorizes it. */
static inline float exp_nonpositive(float x) {
    float t = x * 1.4426950408889634f;
    t = t < -126.0f ? -126.0f : t;
    float fl = floorf(t);
    float f = t - fl;
    float p = 1.86718286e-3f;
    p = p * f + 9.01668762e-3f;
    p = p * f + 5.58004471e-2f;
    p = p * f + 2.40164154e-1f;
    p = p * f + 6.93151363e-1f;
    p = p * f + 1.0f;
    int32_t e = (int32_t)fl + 127;
    uint32_t bits = (uint32_t)e << 23;
    float scale;
    memcpy(&scale, &bits, sizeof scale);
    return p * scale;
}

/* In place: s[0..visible) -> exp(s - max), s[visible..len) -> 0. Returns the sum of the exps. */
static float softmax_row(float *s, int64_t len, int64_t visible) {
    float m = s[0];
    for (int64_t t = 1; t < visible; t++) m = s[t] > m ? s[t] : m;
    float sum = 0.0f;
#pragma omp simd reduction(+ : sum)
    for (int64_t t = 0; t < visible; t++) {
        float p = exp_nonpositive(s[t] - m);
        s[t] = p;
        sum += p;
    }
    for (int64_t t = visible; t < len; t++) s[t] = 0.0f;
    return sum;
}

static inline const uint16_t *cache_row(const Args *a, const uint16_t *cache, int64_t kv_head, int64_t t) {
    const int64_t block = a->table[t / a->block_size];
    return cache + ((kv_head * a->num_blocks + block) * a->block_size + t % a->block_size) * a->head_dim;
}

/* e4m3 (float8_e4m3fn) -> fp32, exactly: a normal value's exponent rebiased (7 -> 127), a subnormal's
 * mantissa times 2^-9. Branch-free selects, so the row loop below vectorizes. (0x7f/0xff, e4m3fn's NaN,
 * never occurs: rows are quantized with a clamp to +-448.) */
static inline float e4m3_to_f32(uint8_t b) {
    const uint32_t e = (b >> 3) & 0xFu, m = b & 7u, sign = (uint32_t)(b & 0x80u) << 24;
    const uint32_t normal = sign | ((e + 120u) << 23) | (m << 20);
    float f, sub = (float)m * 0.001953125f;
    memcpy(&f, &normal, sizeof f);
    sub = sign ? -sub : sub;
    return e ? f : sub;
}

/* Key or value t of a kv head as fp32: the cache's own row (fp32 caches), or a bf16 row converted, or an FP8 row
 * dequantized with its scale, into dst. */
static inline const float *load_row(const Args *a, const uint16_t *cache, int64_t kv_head, int64_t t, float *dst) {
    const int64_t hd = a->head_dim;
    const int64_t block = a->table[t / a->block_size];
    const int64_t index = (kv_head * a->num_blocks + block) * a->block_size + t % a->block_size;
    if (a->f32) return (const float *)(const void *)cache + index * hd;
    if (a->fp8) {
        const uint8_t *row = (const uint8_t *)cache + index * (hd + FP8_ROW_PAD);
        float scale;
        memcpy(&scale, row + hd, sizeof scale);
#pragma omp simd
        for (int64_t d = 0; d < hd; d++) dst[d] = e4m3_to_f32(row[d]) * scale;
        return dst;
    }
    const uint16_t *row = cache + index * hd;
    for (int64_t d = 0; d < hd; d++) dst[d] = bf16_to_f32(row[d]);
    return dst;
}

/* Query vector i of an item (rows row0.., then the group's heads): its row in q / out and head. */
static inline int64_t q_offset(const Args *a, const Item *it, int64_t i) {
    const int64_t group = a->num_heads / a->num_kv_heads;
    const int64_t row = it->first_row + it->row0 + i / group, head = it->kv_head * group + i % group;
    return (row * a->num_heads + head) * a->head_dim;
}

static inline int64_t visible_keys(const Item *it, int64_t i, int64_t group) {
    return it->context_len - it->num_rows + it->row0 + i / group + 1;
}
/* The first key query vector i sees (0 without a window). */
static inline int64_t first_key(const Args *a, const Item *it, int64_t i, int64_t group) {
    const int64_t lo = a->window ? visible_keys(it, i, group) - a->window : 0;
    return lo > 0 ? lo : 0;
}

/* The AVX-512 branch: compiled where the CPU has the instructions (-march=native), or, with TF_EMULATE_AVX512 (tests
 * only), on any x86-64 CPU through SIMDe's portable versions of the same intrinsics, so the branch's logic is
 * tested on machines without AVX-512 too. */
#if defined(TF_EMULATE_AVX512) && !defined(TF_PORTABLE_ONLY)
#include "simde_avx512.h"
#define HAVE_AVX512_BF16 2
#elif defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512BF16__) && !defined(TF_PORTABLE_ONLY)
#include <immintrin.h>
#define HAVE_AVX512_BF16 1
#endif
#ifdef HAVE_AVX512_BF16

/* r[j] = sum of a[j]'s 16 lanes, for 16 vectors at once (a transpose-and-add tree, ~45 ops). */
static inline __m512 reduce16(const __m512 a[16]) {
    __m512 s1[8], s2[4];
    for (int i = 0; i < 8; i++) /* per 128-bit lane: [a0+a2, b0+b2, a1+a3, b1+b3] */
        s1[i] = _mm512_add_ps(_mm512_unpacklo_ps(a[2 * i], a[2 * i + 1]), _mm512_unpackhi_ps(a[2 * i], a[2 * i + 1]));
    for (int i = 0; i < 4; i++) { /* per 128-bit lane: partial sums of 4 vectors */
        __m512d x = _mm512_castps_pd(s1[2 * i]), y = _mm512_castps_pd(s1[2 * i + 1]);
        s2[i] = _mm512_add_ps(_mm512_castpd_ps(_mm512_unpacklo_pd(x, y)), _mm512_castpd_ps(_mm512_unpackhi_pd(x, y)));
    }
    /* across 128-bit lanes */
    __m512 u = _mm512_add_ps(_mm512_shuffle_f32x4(s2[0], s2[1], 0x88), _mm512_shuffle_f32x4(s2[0], s2[1], 0xdd));
    __m512 v = _mm512_add_ps(_mm512_shuffle_f32x4(s2[2], s2[3], 0x88), _mm512_shuffle_f32x4(s2[2], s2[3], 0xdd));
    return _mm512_add_ps(_mm512_shuffle_f32x4(u, v, 0x88), _mm512_shuffle_f32x4(u, v, 0xdd));
}

static inline __m512 bf16x16_to_f32(const uint16_t *p) {
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)p)), 16));
}

/* 32 e4m3 codes -> 32 bf16 (exact: every e4m3 value is a bf16 value). Normal codes: the exponent rebiased
 * (7 -> 127) under the shifted mantissa; subnormal ones (exponent field 0: m * 2^-9) from an 8-entry table. */
static inline __m512i e4m3x32_to_bf16(const uint8_t *p) {
    const __m512i b = _mm512_cvtepu8_epi16(_mm256_loadu_si256((const __m256i *)p));
    const __m512i sign = _mm512_slli_epi16(_mm512_and_si512(b, _mm512_set1_epi16(0x80)), 8);
    const __m512i em = _mm512_and_si512(b, _mm512_set1_epi16(0x7f));
    const __m512i normal = _mm512_add_epi16(_mm512_slli_epi16(em, 4), _mm512_set1_epi16(120 << 7));
    /* bf16 of m * 2^-9, m = 0..7, in lanes 0..7 (the permute reads lanes by the code's low 5 bits) */
    const __m512i sub = _mm512_permutexvar_epi16(em, _mm512_set_epi16(0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0,
                                                                       0, 0, 0, 0, 0, 0, 0, 0, 0x3c60, 0x3c40, 0x3c20,
                                                                       0x3c00, 0x3bc0, 0x3b80, 0x3b00, 0));
    const __mmask32 is_sub = _mm512_cmplt_epu16_mask(em, _mm512_set1_epi16(8));
    return _mm512_or_si512(sign, _mm512_mask_blend_epi16(is_sub, normal, sub));
}

/* Keys t0 .. t0+15 of a kv head (one block) as 16 bf16 rows of HD64: the cache's own rows, or FP8 rows converted
 * into ``buf`` with their 16 scales in ``scales`` (left alone for bf16 caches). */
static inline const uint16_t *key_tile(const Args *a, int64_t kv_head, int64_t t0, uint16_t *buf, float *scales) {
    if (!a->fp8) return cache_row(a, a->k_cache, kv_head, t0);
    const int64_t block = a->table[t0 / a->block_size];
    const uint8_t *rows = (const uint8_t *)a->k_cache + ((kv_head * a->num_blocks + block) * a->block_size +
                                                         t0 % a->block_size) * (64 + FP8_ROW_PAD);
    for (int j = 0; j < 16; j++) {
        const uint8_t *row = rows + j * (64 + FP8_ROW_PAD);
        memcpy(scales + j, row + 64, sizeof(float));
        _mm512_storeu_si512(buf + j * 64, e4m3x32_to_bf16(row));
        _mm512_storeu_si512(buf + j * 64 + 32, e4m3x32_to_bf16(row + 32));
    }
    return buf;
}

/* Value t of a kv head as 4 x 16 fp32 (an FP8 row times its scale). */
static inline void value_row(const Args *a, int64_t kv_head, int64_t t, __m512 v[4]) {
    if (!a->fp8) {
        const uint16_t *row = cache_row(a, a->v_cache, kv_head, t);
        for (int c = 0; c < 4; c++) v[c] = bf16x16_to_f32(row + 16 * c);
        return;
    }
    const int64_t block = a->table[t / a->block_size];
    const uint8_t *row = (const uint8_t *)a->v_cache + ((kv_head * a->num_blocks + block) * a->block_size +
                                                        t % a->block_size) * (64 + FP8_ROW_PAD);
    float scale;
    memcpy(&scale, row + 64, sizeof scale);
    const __m512 s = _mm512_set1_ps(scale);
    for (int c = 0; c < 2; c++) {
        const __m512i h = e4m3x32_to_bf16(row + 32 * c); /* 32 bf16 -> two halves of 16 fp32 */
        const __m512 lo = _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm512_castsi512_si256(h)), 16));
        const __m512 hi = _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm512_extracti64x4_epi64(h, 1)), 16));
        v[2 * c] = _mm512_mul_ps(lo, s);
        v[2 * c + 1] = _mm512_mul_ps(hi, s);
    }
}

/* Scores of an item's query vectors (rows row0.., then the group's heads) over 16-key tiles, for
 * head_dim 64 with bf16 dot-product instructions (fp32 accumulation); row i of ``scores`` gets its
 * visible keys rounded up to 16 (the softmax masks the rest). Two strategies:
 *  - few vectors (decode: one row x the GQA group): 16 keys against one vector, summed across
 *    lanes by a transpose tree;
 *  - many (prefill chunks, speculative rows): the 16-key tile is packed once into dimension pairs
 *    x keys, then each vector's 32 pairs are broadcast against it: 16 scores per register with
 *    plain vector adds instead of lane shuffles, the packed tile shared by every vector that sees
 *    it. Both sum in the same order (bitwise equal results). */
enum { HD64 = 64, PACK_MIN_VECTORS = 12 };

/* s[0..visible) -> exp(s - max), s[visible..len) -> 0, for len a multiple of 16, in AVX-512 (the
 * plain-C softmax_row stays scalar: its max is a compare-and-select chain and the exp's clamp and
 * floor defeat the vectorizer). Same polynomial; the sums are row_sums' job. */
static void exp_row16(float *s, int64_t len, int64_t visible) {
    __m512 m = _mm512_set1_ps(-INFINITY);
    for (int64_t t = 0; t < visible; t += 16) {
        const __mmask16 k = visible - t >= 16 ? (__mmask16)0xffff : (__mmask16)((1u << (visible - t)) - 1);
        m = _mm512_mask_max_ps(m, k, m, _mm512_maskz_loadu_ps(k, s + t));
    }
    const __m512 mx = _mm512_set1_ps(_mm512_reduce_max_ps(m)), log2e = _mm512_set1_ps(1.4426950408889634f),
                 lo = _mm512_set1_ps(-126.0f);
    for (int64_t t = 0; t < len; t += 16) {
        const __mmask16 k = t >= visible ? 0
                            : visible - t >= 16 ? (__mmask16)0xffff
                                                : (__mmask16)((1u << (visible - t)) - 1);
        __m512 x = _mm512_max_ps(_mm512_mul_ps(_mm512_sub_ps(_mm512_loadu_ps(s + t), mx), log2e), lo);
        const __m512 fl = _mm512_roundscale_ps(x, _MM_FROUND_TO_NEG_INF | _MM_FROUND_NO_EXC);
        const __m512 f = _mm512_sub_ps(x, fl);
        __m512 p = _mm512_set1_ps(1.86718286e-3f);
        p = _mm512_add_ps(_mm512_mul_ps(p, f), _mm512_set1_ps(9.01668762e-3f));
        p = _mm512_add_ps(_mm512_mul_ps(p, f), _mm512_set1_ps(5.58004471e-2f));
        p = _mm512_add_ps(_mm512_mul_ps(p, f), _mm512_set1_ps(2.40164154e-1f));
        p = _mm512_add_ps(_mm512_mul_ps(p, f), _mm512_set1_ps(6.93151363e-1f));
        p = _mm512_add_ps(_mm512_mul_ps(p, f), _mm512_set1_ps(1.0f));
        _mm512_storeu_ps(s + t, _mm512_maskz_mov_ps(k, _mm512_scalef_ps(p, fl)));
    }
}

/* sums[i] = s_i[0] + s_i[1] + ... + s_i[visible_i - 1], one by one in that order (softmax_row's
 * bits: a vectorized sum moved the kernel's outputs by an ulp here and there, and greedy near-ties
 * with them), four rows' chains interleaved so the adds overlap instead of waiting on each other. */
static void row_sums(const float *scores, int64_t stride, const int64_t *visible, int64_t num_q, float *sums) {
    int64_t i = 0;
    for (; i + 4 <= num_q; i += 4) {
        const float *r0 = scores + i * stride, *r1 = r0 + stride, *r2 = r1 + stride, *r3 = r2 + stride;
        int64_t common = visible[i];
        for (int r = 1; r < 4; r++) common = visible[i + r] < common ? visible[i + r] : common;
        float s0 = 0.0f, s1 = 0.0f, s2 = 0.0f, s3 = 0.0f;
        for (int64_t t = 0; t < common; t++) {
            s0 += r0[t];
            s1 += r1[t];
            s2 += r2[t];
            s3 += r3[t];
        }
        for (int64_t t = common; t < visible[i]; t++) s0 += r0[t];
        for (int64_t t = common; t < visible[i + 1]; t++) s1 += r1[t];
        for (int64_t t = common; t < visible[i + 2]; t++) s2 += r2[t];
        for (int64_t t = common; t < visible[i + 3]; t++) s3 += r3[t];
        sums[i] = s0, sums[i + 1] = s1, sums[i + 2] = s2, sums[i + 3] = s3;
    }
    for (; i < num_q; i++) {
        float s = 0.0f;
        for (int64_t t = 0; t < visible[i]; t++) s += scores[i * stride + t];
        sums[i] = s;
    }
}

static void scores_hd64_reduce(const Args *a, const Item *it, const uint16_t *const *qs, int64_t num_q, float *scores,
                               int64_t stride) {
    const int64_t group = a->num_heads / a->num_kv_heads;
    const __m512 scale_v = _mm512_set1_ps(a->scale);
    for (int64_t i = 0; i < num_q; i++) {
        const __m512bh q0 = (__m512bh)_mm512_loadu_si512(qs[i]), q1 = (__m512bh)_mm512_loadu_si512(qs[i] + 32);
        const int64_t visible = visible_keys(it, i, group);
        float *s = scores + i * stride;
        for (int64_t t0 = 0; t0 < visible; t0 += 16) {
            uint16_t buf[16 * HD64];
            float ks[16];
            const uint16_t *k = key_tile(a, it->kv_head, t0, buf, ks); /* 16 rows in one block */
            __m512 acc[16];
            for (int j = 0; j < 16; j++) {
                acc[j] = _mm512_dpbf16_ps(_mm512_setzero_ps(), (__m512bh)_mm512_loadu_si512(k + j * HD64), q0);
                acc[j] = _mm512_dpbf16_ps(acc[j], (__m512bh)_mm512_loadu_si512(k + j * HD64 + 32), q1);
            }
            __m512 sc = _mm512_mul_ps(reduce16(acc), scale_v);
            if (a->fp8) sc = _mm512_mul_ps(sc, _mm512_loadu_ps(ks));
            _mm512_storeu_ps(s + t0, sc);
        }
    }
}

static void scores_hd64_packed(const Args *a, const Item *it, const uint16_t *const *qs, int64_t num_q, float *scores,
                               int64_t stride) {
    const int64_t group = a->num_heads / a->num_kv_heads;
    const __m512 scale_v = _mm512_set1_ps(a->scale);
    const int64_t widest = visible_keys(it, num_q - 1, group);
    const __m512i idx = _mm512_mullo_epi32(_mm512_set_epi32(15, 14, 13, 12, 11, 10, 9, 8, 7, 6, 5, 4, 3, 2, 1, 0),
                                           _mm512_set1_epi32(HD64 / 2));
    __m512i kp[HD64 / 2]; /* kp[p] lane j: dimensions 2p, 2p+1 of key t0 + j */
    int64_t first = 0;    /* the first vector that sees the tile (visible keys grow with i) */
    for (int64_t t0 = 0; t0 < widest; t0 += 16) {
        uint16_t buf[16 * HD64];
        float ks[16];
        const uint16_t *k = key_tile(a, it->kv_head, t0, buf, ks); /* 16 rows in one block */
        const __m512 key_scales = a->fp8 ? _mm512_loadu_ps(ks) : _mm512_set1_ps(1.0f);
        for (int p = 0; p < HD64 / 2; p++) kp[p] = _mm512_i32gather_epi32(idx, (const void *)(k + 2 * p), 4);
        while (visible_keys(it, first, group) <= t0) first++;
        for (int64_t i = first; i < num_q; i++) {
            /* The sums in scores_hd64_reduce's order (pairs l and l + 16, then its lane tree), so both
             * strategies give the same bits: one ulp moved here and there swings greedy near-ties. */
            const uint32_t *q = (const uint32_t *)qs[i];
            __m512 acc[16];
            for (int l = 0; l < 16; l++) {
                acc[l] = _mm512_dpbf16_ps(_mm512_setzero_ps(), (__m512bh)kp[l], (__m512bh)_mm512_set1_epi32((int)q[l]));
                acc[l] = _mm512_dpbf16_ps(acc[l], (__m512bh)kp[l + 16], (__m512bh)_mm512_set1_epi32((int)q[l + 16]));
            }
            __m512 block[4];
            for (int c = 0; c < 4; c++)
                block[c] = _mm512_add_ps(_mm512_add_ps(acc[4 * c], acc[4 * c + 2]), _mm512_add_ps(acc[4 * c + 1], acc[4 * c + 3]));
            const __m512 sum = _mm512_add_ps(_mm512_add_ps(block[0], block[1]), _mm512_add_ps(block[2], block[3]));
            /* (sum * scale) * key scale, as the reduce path rounds it */
            _mm512_storeu_ps(scores + i * stride + t0, _mm512_mul_ps(_mm512_mul_ps(sum, scale_v), key_scales));
        }
    }
}

/* head_dim 64, block_size a multiple of 16: scores as above, softmax, then P.V with the
 * accumulators of 4 query vectors in registers.
 * scores: [rows rounded up to 4, stride] scratch, stride >= the item's visible keys rounded up to 16. */
static void attend_hd64(const Args *a, const Item *it, float *scores, int64_t stride) {
    enum { QT = 4 };
    const int64_t group = a->num_heads / a->num_kv_heads;
    const int64_t num_q = (it->row1 - it->row0) * group, num_q_padded = (num_q + QT - 1) / QT * QT;
    const uint16_t *qs[num_q];
    for (int64_t i = 0; i < num_q; i++) qs[i] = a->q + q_offset(a, it, i);
    if (num_q >= PACK_MIN_VECTORS)
        scores_hd64_packed(a, it, qs, num_q, scores, stride);
    else
        scores_hd64_reduce(a, it, qs, num_q, scores, stride);
    float sums[num_q];
    int64_t visible[num_q];
    for (int64_t i = 0; i < num_q; i++) {
        visible[i] = visible_keys(it, i, group);
        exp_row16(scores + i * stride, (visible[i] + 15) / 16 * 16, visible[i]);
    }
    row_sums(scores, stride, visible, num_q, sums);
    for (int64_t i0 = 0; i0 < num_q_padded; i0 += QT) {
        const int64_t last = i0 + QT - 1 < num_q ? i0 + QT - 1 : num_q - 1;
        const int64_t keys = visible_keys(it, last, group); /* the tile's widest row */
        for (int64_t i = i0; i < i0 + QT; i++) { /* zero what a row of the tile does not see */
            const int64_t from = i < num_q ? (visible_keys(it, i, group) + 15) / 16 * 16 : 0;
            if (from < keys) memset(scores + i * stride + from, 0, sizeof(float) * (size_t)(keys - from));
        }
        __m512 acc[QT][4];
        for (int i = 0; i < QT; i++)
            for (int c = 0; c < 4; c++) acc[i][c] = _mm512_setzero_ps();
        for (int64_t t = 0; t < keys; t++) {
            __m512 v[4];
            value_row(a, it->kv_head, t, v);
            for (int i = 0; i < QT; i++) {
                const __m512 p = _mm512_set1_ps(scores[(i0 + i) * stride + t]);
                acc[i][0] = _mm512_fmadd_ps(p, v[0], acc[i][0]);
                acc[i][1] = _mm512_fmadd_ps(p, v[1], acc[i][1]);
                acc[i][2] = _mm512_fmadd_ps(p, v[2], acc[i][2]);
                acc[i][3] = _mm512_fmadd_ps(p, v[3], acc[i][3]);
            }
        }
        for (int i = 0; i < QT && i0 + i < num_q; i++) {
            uint16_t *dst = a->out + (qs[i0 + i] - a->q);
            const __m512 inv = _mm512_set1_ps(1.0f / sums[i0 + i]);
            float tmp[HD64];
            for (int c = 0; c < 4; c++) _mm512_storeu_ps(tmp + 16 * c, _mm512_mul_ps(acc[i][c], inv));
            for (int d = 0; d < HD64; d++) dst[d] = f32_to_bf16(tmp[d]);
        }
    }
}
#endif

/* Portable C (any head_dim <= MAX_HEAD_DIM, any block size); the compiler vectorizes the inner loops.
 * buf: scores [num_q, stride] then qf and acc [num_q, head_dim] each. */
static void attend_portable(const Args *a, const Item *it, float *buf, int64_t stride) {
    const int64_t group = a->num_heads / a->num_kv_heads, hd = a->head_dim;
    const int64_t num_q = (it->row1 - it->row0) * group;
    float *scores = buf, *qf = buf + num_q * stride, *acc = qf + num_q * hd;
    const int64_t keys = visible_keys(it, num_q - 1, group), key0 = first_key(a, it, 0, group);
    float kf[MAX_HEAD_DIM];
    for (int64_t i = 0; i < num_q; i++) {
        if (a->f32) {
            const float *src = (const float *)(const void *)a->q + q_offset(a, it, i);
            for (int64_t d = 0; d < hd; d++) qf[i * hd + d] = src[d] * a->scale;
        } else {
            const uint16_t *src = a->q + q_offset(a, it, i);
            for (int64_t d = 0; d < hd; d++) qf[i * hd + d] = bf16_to_f32(src[d]) * a->scale;
        }
        memset(acc + i * hd, 0, sizeof(float) * (size_t)hd);
    }
    for (int64_t t = key0; t < keys; t++) { /* scores; K rows converted once for every query vector */
        const float *kr = load_row(a, a->k_cache, it->kv_head, t, kf);
        for (int64_t i = 0; i < num_q; i++) {
            const float *qi = qf + i * hd;
            float s = 0.0f;
#pragma omp simd reduction(+ : s)
            for (int64_t d = 0; d < hd; d++) s += qi[d] * kr[d];
            scores[i * stride + t - key0] = s;
        }
    }
    float sums[num_q];
    for (int64_t i = 0; i < num_q; i++) { /* row i sees keys first_key .. visible - 1: zero the rest */
        float *row = scores + i * stride;
        const int64_t skip = first_key(a, it, i, group) - key0;
        sums[i] = softmax_row(row + skip, keys - key0 - skip, visible_keys(it, i, group) - key0 - skip);
        memset(row, 0, sizeof(float) * (size_t)skip);
    }
    for (int64_t t = key0; t < keys; t++) {
        const float *vr = load_row(a, a->v_cache, it->kv_head, t, kf);
        for (int64_t i = 0; i < num_q; i++) {
            const float p = scores[i * stride + t - key0];
            float *o = acc + i * hd;
#pragma omp simd
            for (int64_t d = 0; d < hd; d++) o[d] += p * vr[d];
        }
    }
    for (int64_t i = 0; i < num_q; i++) {
        const float inv = 1.0f / sums[i];
        if (a->f32) {
            float *dst = (float *)(void *)a->out + q_offset(a, it, i);
            for (int64_t d = 0; d < hd; d++) dst[d] = acc[i * hd + d] * inv;
        } else {
            uint16_t *dst = a->out + q_offset(a, it, i);
            for (int64_t d = 0; d < hd; d++) dst[d] = f32_to_bf16(acc[i * hd + d] * inv);
        }
    }
}

/* Per-thread scratch, kept between calls (OpenMP threads persist): items need up to a few MB for long
 * contexts, and a malloc that size is a fresh mmap with its page faults every time. */
static _Thread_local float *scratch_buf;
static _Thread_local size_t scratch_cap;

static float *scratch(size_t floats) {
    if (floats > scratch_cap) {
        free(scratch_buf);
        scratch_buf = malloc(sizeof(float) * floats);
        scratch_cap = scratch_buf ? floats : 0;
    }
    return scratch_buf;
}

enum { PATH_PORTABLE, PATH_AVX512_REDUCE, PATH_AVX512_PACKED, NUM_PATHS };

/* Attends one item; returns the path that ran (PATH_*), or -1 when scratch memory ran out. */
static int attend_item(const Args *a, const Item *it) {
    const int64_t group = a->num_heads / a->num_kv_heads;
    const int64_t num_q = (it->row1 - it->row0) * group;
    const int64_t stride = (visible_keys(it, num_q - 1, group) - first_key(a, it, 0, group) + 15) / 16 * 16;
#ifdef HAVE_AVX512_BF16
    if (a->head_dim == 64 && a->block_size % 16 == 0 && a->window == 0 && !a->f32) {
        float *scores = scratch((size_t)((num_q + 3) / 4 * 4 * stride));
        if (!scores) return -1;
        attend_hd64(a, it, scores, stride);
        return num_q >= PACK_MIN_VECTORS ? PATH_AVX512_PACKED : PATH_AVX512_REDUCE;
    }
#endif
    float *buf = scratch((size_t)(num_q * (stride + 2 * a->head_dim)));
    if (!buf) return -1;
    attend_portable(a, it, buf, stride);
    return PATH_PORTABLE;
}

/* Which branches this build holds: 0 the portable C only, 1 the AVX-512 branch (this CPU's instructions), 2 the
 * AVX-512 branch emulated through SIMDe (tests). */
int tf_paged_attention_build(void) {
#ifdef HAVE_AVX512_BF16
    return HAVE_AVX512_BF16;
#else
    return 0;
#endif
}

/* Returns 0, or -1 when a shape is out of what this kernel handles (the caller falls back). kind: KIND_BF16 (q, out
 * and the caches bf16), KIND_F32 (all fp32: the pointers typed uint16_t point at floats) or KIND_FP8 (the caches
 * hold FP8 rows (uint8 [num_kv_heads, num_blocks, block_size, head_dim + FP8_ROW_PAD]; head_dim a multiple of 16).
 * paths: NULL, or NUM_PATHS counters to which the call adds how many work items each path ran (tests assert which
 * code computed what they compare). */
int tf_paged_attention(const uint16_t *q, const void *k_cache, const void *v_cache, const int64_t *block_table,
                       const int64_t *context_lens, const int64_t *query_start, uint16_t *out, int64_t num_requests,
                       int64_t num_heads, int64_t num_kv_heads, int64_t head_dim, int64_t block_size,
                       int64_t num_blocks, int64_t max_blocks, float scale, int64_t window, int num_threads, int kind,
                       int64_t *paths) {
    const int fp8 = kind == KIND_FP8, f32 = kind == KIND_F32;
    if (kind < KIND_BF16 || kind > KIND_F32) return -1;
    if (head_dim > MAX_HEAD_DIM || num_kv_heads <= 0 || num_heads % num_kv_heads || (fp8 && head_dim % FP8_ROW_PAD)) return -1;
    int64_t num_items = 0;
    for (int64_t r = 0; r < num_requests; r++) {
        const int64_t n = query_start[r + 1] - query_start[r];
        if (n <= 0 || context_lens[r] < n || context_lens[r] > max_blocks * block_size) return -1;
        num_items += (n + ROWS_PER_ITEM - 1) / ROWS_PER_ITEM * num_kv_heads;
    }
    Item *items = malloc(sizeof(Item) * (size_t)num_items);
    if (!items) return -1;
    int64_t next = 0;
    for (int64_t r = 0; r < num_requests; r++) { /* longest-running items first: later rows see more keys */
        const int64_t n = query_start[r + 1] - query_start[r];
        for (int64_t row1 = n; row1 > 0; row1 -= ROWS_PER_ITEM)
            for (int64_t h = 0; h < num_kv_heads; h++)
                items[next++] = (Item){r, h, query_start[r], n, context_lens[r],
                                       row1 > ROWS_PER_ITEM ? row1 - ROWS_PER_ITEM : 0, row1};
    }
    int failed = 0;
    int64_t portable = 0, reduce = 0, packed = 0;
#pragma omp parallel for schedule(dynamic, 1) num_threads(num_threads) reduction(| : failed) \
    reduction(+ : portable, reduce, packed)
    for (int64_t i = 0; i < num_items; i++) {
        const Args a = {q, (const uint16_t *)k_cache, (const uint16_t *)v_cache, block_table + items[i].request * max_blocks,
                        out, num_heads, num_kv_heads, head_dim, block_size, num_blocks, scale, window, fp8, f32};
        const int path = attend_item(&a, &items[i]);
        failed |= path < 0;
        portable += path == PATH_PORTABLE;
        reduce += path == PATH_AVX512_REDUCE;
        packed += path == PATH_AVX512_PACKED;
    }
    free(items);
    if (paths) {
        paths[PATH_PORTABLE] += portable;
        paths[PATH_AVX512_REDUCE] += reduce;
        paths[PATH_AVX512_PACKED] += packed;
    }
    return failed ? -1 : 0;
}
