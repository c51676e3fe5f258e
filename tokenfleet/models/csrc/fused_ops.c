/* The decoder layer's element-wise work, fused, for bf16 tensors on CPU (and, the *_f32 functions, fp32 ones).
 *
 * Each function does in one call what takes the torch path 3 to 10 small ops (each a dispatch,
 * an allocation and a pass over memory: ~5 us apiece, ~30 per layer, 1,000 per step). They
 * repeat the torch path's (and HF's) rounding steps exactly: every value the torch path stores
 * as bf16 is rounded to bf16 here at the same point, so results differ from it only by the
 * summation order of the RMS statistics.
 *
 * Rows are independent: loops over rows run on the caller's OpenMP runtime (torch's).
 */
#include <math.h>
#include <stdint.h>
#include <string.h>

#include "vec_math.h"

static inline float bf(uint16_t h) {
    uint32_t u = (uint32_t)h << 16;
    float f;
    memcpy(&f, &u, sizeof f);
    return f;
}

static inline uint16_t to_bf(float f) { /* round to nearest even, as torch does */
    uint32_t u;
    memcpy(&u, &f, sizeof u);
    if ((u & 0x7f800000u) == 0x7f800000u) return (uint16_t)((u >> 16) | ((u & 0xffffu) ? 0x40u : 0u));
    u += 0x7fffu + ((u >> 16) & 1u);
    return (uint16_t)(u >> 16);
}

static inline float round_bf(float f) { return bf(to_bf(f)); }

/* The sum of a contiguous fp32 row in the order torch's CPU sum kernel uses (cascade_sum ->
 * vectorized_inner_sum, built for AVX2 only in torch 2.13 wheels: 8-lane vectors, 4 interleaved
 * accumulators, cascade levels, then the
 * lanes one by one), so the RMS statistics round exactly as the torch path's (and HF's) do: a
 * different order moved a few normalized values by one bf16 step per layer, enough to change a
 * greedy continuation. Needs -ffp-contract=off (no fused multiply-adds). */
static int64_t ceil_log2(int64_t x) {
    if (x <= 2) return 1;
    int64_t bits = 0;
    for (uint64_t v = (uint64_t)(x - 1); v; v >>= 1) bits++;
    return bits;
}

static float torch_row_sum(const float *x, int64_t n) {
    enum { V = 8, ILP = 4, LEVELS = 4 };
    const int64_t num_vec = n / V, size = num_vec / ILP;
    const int64_t level_power = ceil_log2(size) / LEVELS > 4 ? ceil_log2(size) / LEVELS : 4;
    const int64_t level_step = (int64_t)1 << level_power, level_mask = level_step - 1;
    float acc[LEVELS][ILP][V];
    memset(acc, 0, sizeof acc);
    int64_t i = 0;
    while (i + level_step <= size) {
        for (int64_t j = 0; j < level_step; j++, i++)
            for (int k = 0; k < ILP; k++)
                for (int l = 0; l < V; l++) acc[0][k][l] += x[(i * ILP + k) * V + l];
        for (int j = 1; j < LEVELS; j++) {
            for (int k = 0; k < ILP; k++)
                for (int l = 0; l < V; l++) {
                    acc[j][k][l] += acc[j - 1][k][l];
                    acc[j - 1][k][l] = 0.0f;
                }
            if ((i & (level_mask << (j * level_power))) != 0) break;
        }
    }
    for (; i < size; i++)
        for (int k = 0; k < ILP; k++)
            for (int l = 0; l < V; l++) acc[0][k][l] += x[(i * ILP + k) * V + l];
    for (int j = 1; j < LEVELS; j++)
        for (int k = 0; k < ILP; k++)
            for (int l = 0; l < V; l++) acc[0][k][l] += acc[j][k][l];
    for (int64_t v = size * ILP; v < num_vec; v++)
        for (int l = 0; l < V; l++) acc[0][0][l] += x[v * V + l];
    for (int k = 1; k < ILP; k++)
        for (int l = 0; l < V; l++) acc[0][0][l] += acc[0][k][l];
    float total = 0.0f;
    for (int64_t t = num_vec * V; t < n; t++) total += x[t];
    for (int l = 0; l < V; l++) total += acc[0][0][l];
    return total;
}

/* residual += delta (when delta is not NULL); out = weight * bf16(residual * rsqrt(mean(residual^2) + eps)).
 * residual, delta, out: [rows, hidden]; weight: [hidden]. */
void tf_add_rms_norm(uint16_t *residual, const uint16_t *delta, const uint16_t *weight, uint16_t *out, int64_t rows,
                     int64_t hidden, float eps, int num_threads) {
#pragma omp parallel for num_threads(rows > 8 ? num_threads : 1) schedule(static)
    for (int64_t r = 0; r < rows; r++) {
        uint16_t *x = residual + r * hidden;
        if (delta) {
            const uint16_t *d = delta + r * hidden;
            for (int64_t i = 0; i < hidden; i++) x[i] = to_bf(bf(x[i]) + bf(d[i]));
        }
        float squares[hidden];
        for (int64_t i = 0; i < hidden; i++) squares[i] = bf(x[i]) * bf(x[i]);
        const float inv = 1.0f / sqrtf(torch_row_sum(squares, hidden) / (float)hidden + eps);
        uint16_t *o = out + r * hidden;
        for (int64_t i = 0; i < hidden; i++) o[i] = to_bf(bf(weight[i]) * round_bf(bf(x[i]) * inv));
    }
}

/* qkv: [tokens, (heads + 2 * kv_heads) * head_dim] (the fused projection's output).
 * Rotate-half RoPE (HF layout, bf16 steps: x*cos and rot*sin rounded, then their sum) of q and k at
 * each token's position; write q to q_out [tokens, heads, head_dim], k to k_out [tokens, kv_heads,
 * head_dim], and k and v into the caches [kv_heads, num_slots, head_dim] at slot_mapping[token].
 * cos, sin: [max_positions, head_dim] bf16. */
/* float -> e4m3 (float8_e4m3fn) code, rounding to nearest even as torch's cast does; |x| <= 448 (the caller
 * clamps). Subnormals (|x| < 2^-6) are multiples of 2^-9, their code the multiple (8 is the smallest normal). */
static inline uint8_t to_e4m3(float x) {
    uint32_t u;
    memcpy(&u, &x, sizeof u);
    const uint8_t sign = (uint8_t)((u >> 24) & 0x80u);
    u &= 0x7fffffffu;
    float a;
    memcpy(&a, &u, sizeof a);
    if (a < 0.015625f) return sign | (uint8_t)nearbyintf(a * 512.0f);
    u += 0x7ffffu + ((u >> 20) & 1u); /* round the mantissa to 3 bits, to nearest even */
    return sign | (uint8_t)(((((u >> 23) - 120u) & 0xfu) << 3) | ((u >> 20) & 7u));
}

#define FP8_ROW_PAD 16 /* kv_fp8.ROW_PAD: after a row's e4m3 values, its fp32 scale and zeros to 16 bytes */

/* One head row (fp32 values) as an FP8 row: e4m3 of x / (amax / 448), the fp32 scale, zero padding
 * (models/kv_fp8.py). */
static void store_fp8_row(const float *x, uint8_t *dst, int64_t head_dim) {
    float amax = 0.0f;
    for (int64_t i = 0; i < head_dim; i++) amax = fmaxf(amax, fabsf(x[i]));
    const float scale = fmaxf(amax, 1e-12f) / 448.0f;
    for (int64_t i = 0; i < head_dim; i++) dst[i] = to_e4m3(fminf(fmaxf(x[i] / scale, -448.0f), 448.0f));
    memcpy(dst + head_dim, &scale, sizeof scale);
    memset(dst + head_dim + sizeof scale, 0, FP8_ROW_PAD - sizeof scale);
}

/* A bf16 head row as an FP8 row (its values converted exactly to fp32 first). */
static void store_fp8_row_bf16(const uint16_t *x, uint8_t *dst, int64_t head_dim) {
    float row[head_dim];
    for (int64_t i = 0; i < head_dim; i++) row[i] = bf(x[i]);
    store_fp8_row(row, dst, head_dim);
}

/* fp8 = 0: K and V rows as bf16 into bf16 caches; fp8 = 1: as FP8 rows (k_cache, v_cache: uint8
 * [kv_heads, num_slots, head_dim + FP8_ROW_PAD]). */
void tf_rope_store_kv(const uint16_t *qkv, const int64_t *positions, const uint16_t *cos_table,
                      const uint16_t *sin_table, const int64_t *slot_mapping, uint16_t *q_out, uint16_t *k_out,
                      void *k_cache, void *v_cache, int64_t tokens, int64_t heads, int64_t kv_heads,
                      int64_t head_dim, int64_t num_slots, int num_threads, int fp8) {
    const int64_t half = head_dim / 2, width = (heads + 2 * kv_heads) * head_dim, row_bytes = head_dim + FP8_ROW_PAD;
#pragma omp parallel for num_threads(tokens > 8 ? num_threads : 1) schedule(static)
    for (int64_t t = 0; t < tokens; t++) {
        const uint16_t *row = qkv + t * width;
        const uint16_t *c = cos_table + positions[t] * head_dim, *s = sin_table + positions[t] * head_dim;
        const int64_t slot = slot_mapping[t];
        for (int64_t h = 0; h < heads + kv_heads; h++) {
            const uint16_t *x = row + h * head_dim;
            uint16_t *dst = h < heads ? q_out + (t * heads + h) * head_dim : k_out + (t * kv_heads + h - heads) * head_dim;
            for (int64_t i = 0; i < head_dim; i++) {
                const float rotated = i < half ? -bf(x[i + half]) : bf(x[i - half]);
                dst[i] = to_bf(round_bf(bf(x[i]) * bf(c[i])) + round_bf(rotated * bf(s[i])));
            }
            if (h < heads) continue;
            if (fp8)
                store_fp8_row_bf16(dst, (uint8_t *)k_cache + ((h - heads) * num_slots + slot) * row_bytes, head_dim);
            else
                memcpy((uint16_t *)k_cache + ((h - heads) * num_slots + slot) * head_dim, dst, 2 * (size_t)head_dim);
        }
        for (int64_t h = 0; h < kv_heads; h++) {
            const uint16_t *v = row + (heads + kv_heads + h) * head_dim;
            if (fp8)
                store_fp8_row_bf16(v, (uint8_t *)v_cache + (h * num_slots + slot) * row_bytes, head_dim);
            else
                memcpy((uint16_t *)v_cache + (h * num_slots + slot) * head_dim, v, 2 * (size_t)head_dim);
        }
    }
}

/* out = bf16(silu(gate)) * up, rounded; gate_up: [rows, 2 * inter] (gate first), out: [rows, inter]. */
void tf_silu_mul(const uint16_t *gate_up, uint16_t *out, int64_t rows, int64_t inter, int num_threads) {
#pragma omp parallel for num_threads(rows > 4 ? num_threads : 1) schedule(static)
    for (int64_t r = 0; r < rows; r++) {
        const uint16_t *g = gate_up + r * 2 * inter, *u = g + inter;
        uint16_t *o = out + r * inter;
#pragma omp simd
        for (int64_t i = 0; i < inter; i++) {
            const float x = bf(g[i]);
            o[i] = to_bf(round_bf(x / (1.0f + exp_f32(-x))) * bf(u[i]));
        }
    }
}

/* fp32 versions of the three above: the same steps with no rounding between them (the torch path in fp32 has none
 * either); the RMS statistics summed in torch's order. */
void tf_add_rms_norm_f32(float *residual, const float *delta, const float *weight, float *out, int64_t rows,
                         int64_t hidden, float eps, int num_threads) {
#pragma omp parallel for num_threads(rows > 8 ? num_threads : 1) schedule(static)
    for (int64_t r = 0; r < rows; r++) {
        float *x = residual + r * hidden;
        if (delta) {
            const float *d = delta + r * hidden;
            for (int64_t i = 0; i < hidden; i++) x[i] += d[i];
        }
        float squares[hidden];
        for (int64_t i = 0; i < hidden; i++) squares[i] = x[i] * x[i];
        const float inv = 1.0f / sqrtf(torch_row_sum(squares, hidden) / (float)hidden + eps);
        float *o = out + r * hidden;
        for (int64_t i = 0; i < hidden; i++) o[i] = weight[i] * (x[i] * inv);
    }
}

void tf_rope_store_kv_f32(const float *qkv, const int64_t *positions, const float *cos_table, const float *sin_table,
                          const int64_t *slot_mapping, float *q_out, float *k_out, void *k_cache, void *v_cache,
                          int64_t tokens, int64_t heads, int64_t kv_heads, int64_t head_dim, int64_t num_slots,
                          int num_threads, int fp8) {
    const int64_t half = head_dim / 2, width = (heads + 2 * kv_heads) * head_dim, row_bytes = head_dim + FP8_ROW_PAD;
#pragma omp parallel for num_threads(tokens > 8 ? num_threads : 1) schedule(static)
    for (int64_t t = 0; t < tokens; t++) {
        const float *row = qkv + t * width;
        const float *c = cos_table + positions[t] * head_dim, *s = sin_table + positions[t] * head_dim;
        const int64_t slot = slot_mapping[t];
        for (int64_t h = 0; h < heads + kv_heads; h++) {
            const float *x = row + h * head_dim;
            float *dst = h < heads ? q_out + (t * heads + h) * head_dim : k_out + (t * kv_heads + h - heads) * head_dim;
            for (int64_t i = 0; i < head_dim; i++) {
                const float rotated = i < half ? -x[i + half] : x[i - half];
                dst[i] = x[i] * c[i] + rotated * s[i];
            }
            if (h < heads) continue;
            if (fp8)
                store_fp8_row(dst, (uint8_t *)k_cache + ((h - heads) * num_slots + slot) * row_bytes, head_dim);
            else
                memcpy((float *)k_cache + ((h - heads) * num_slots + slot) * head_dim, dst, 4 * (size_t)head_dim);
        }
        for (int64_t h = 0; h < kv_heads; h++) {
            const float *v = row + (heads + kv_heads + h) * head_dim;
            if (fp8)
                store_fp8_row(v, (uint8_t *)v_cache + (h * num_slots + slot) * row_bytes, head_dim);
            else
                memcpy((float *)v_cache + (h * num_slots + slot) * head_dim, v, 4 * (size_t)head_dim);
        }
    }
}

void tf_silu_mul_f32(const float *gate_up, float *out, int64_t rows, int64_t inter, int num_threads) {
#pragma omp parallel for num_threads(rows > 4 ? num_threads : 1) schedule(static)
    for (int64_t r = 0; r < rows; r++) {
        const float *g = gate_up + r * 2 * inter, *u = g + inter;
        float *o = out + r * inter;
#pragma omp simd
        for (int64_t i = 0; i < inter; i++) o[i] = g[i] / (1.0f + exp_f32(-g[i])) * u[i];
    }
}
