/* Float math shared by the kernels: plain C that the compiler vectorizes inside `omp simd` loops. */
#ifndef TF_VEC_MATH_H
#define TF_VEC_MATH_H

#include <math.h>
#include <stdint.h>
#include <string.h>

/* exp(x) with Cody-Waite range reduction and a degree-6 polynomial (Cephes' expf coefficients,
 * ~1 ulp, as torch's vectorized exp); plain float code so the compiler vectorizes it. Saturates to
 * inf above 88.72 like expf. */
static inline float exp_f32(float x) {
    const float big = x > 88.72f;
    x = x < -87.0f ? -87.0f : (x > 88.0f ? 88.0f : x);
    const float n = rintf(x * 1.44269504088896341f);
    float r = x - n * 0.693359375f;
    r = r + n * 2.12194440e-4f;
    float p = 1.9875691500e-4f;
    p = p * r + 1.3981999507e-3f;
    p = p * r + 8.3334519073e-3f;
    p = p * r + 4.1665795894e-2f;
    p = p * r + 1.6666665459e-1f;
    p = p * r + 5.0000001201e-1f;
    p = p * r * r + r + 1.0f;
    const uint32_t bits = (uint32_t)((int32_t)n + 127) << 23;
    float scale;
    memcpy(&scale, &bits, sizeof scale);
    return big != 0.0f ? INFINITY : p * scale;
}

#endif
