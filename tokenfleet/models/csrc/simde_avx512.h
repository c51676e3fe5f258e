/* The AVX-512 intrinsics paged_attention.c uses, on any x86-64 CPU: SIMDe's portable versions (the simde-py
 * package's headers, a test dependency), built only with -DTF_EMULATE_AVX512 (tests/unit/models/kernel_builds.py).
 * Production builds never include this file: they compile the real instructions or the portable C.
 *
 * Three intrinsics SIMDe 0.8.2 lacks are written out below, and one it gets wrong is wrapped; each is checked
 * lane by lane against the instruction's documented semantics by tests/unit/models/test_kernel_properties.py
 * (through the kernel's results against the torch reference). */
#ifndef TF_SIMDE_AVX512_H
#define TF_SIMDE_AVX512_H

#define SIMDE_ENABLE_NATIVE_ALIASES
#include <simde/x86/avx512.h>
#include <string.h>

/* vpmovzxbw: 32 bytes zero-extended to 32 16-bit lanes */
static inline simde__m512i tf_cvtepu8_epi16(simde__m256i a) {
    simde__m512i_private r;
    simde__m256i_private x = simde__m256i_to_private(a);
    for (int i = 0; i < 32; i++) r.u16[i] = x.u8[i];
    return simde__m512i_from_private(r);
}

/* vpcmpuw (less than): bit i set where unsigned lane a[i] < b[i] */
static inline simde__mmask32 tf_cmplt_epu16_mask(simde__m512i a, simde__m512i b) {
    simde__m512i_private x = simde__m512i_to_private(a), y = simde__m512i_to_private(b);
    simde__mmask32 m = 0;
    for (int i = 0; i < 32; i++) m |= (simde__mmask32)(x.u16[i] < y.u16[i]) << i;
    return m;
}

/* vpgatherdd: lane i = the 32 bits at base + index[i] * scale */
static inline simde__m512i tf_i32gather_epi32(simde__m512i index, const void *base, int scale) {
    simde__m512i_private r, x = simde__m512i_to_private(index);
    for (int i = 0; i < 16; i++) memcpy(&r.i32[i], (const char *)base + (int64_t)x.i32[i] * scale, 4);
    return simde__m512i_from_private(r);
}

/* SIMDe's 512-bit roundscale macro substitutes its imm8 unparenthesized ((a | b >> 4) & 15), so
 * _MM_FROUND_TO_NEG_INF | _MM_FROUND_NO_EXC rounded down to halves instead of integers: pass it through a call. */
static inline simde__m512 tf_roundscale_ps(simde__m512 a, const int imm8) { return simde_mm512_roundscale_ps(a, imm8); }

#undef _mm512_cvtepu8_epi16
#undef _mm512_cmplt_epu16_mask
#undef _mm512_i32gather_epi32
#undef _mm512_roundscale_ps
#define _mm512_cvtepu8_epi16 tf_cvtepu8_epi16
#define _mm512_cmplt_epu16_mask tf_cmplt_epu16_mask
#define _mm512_i32gather_epi32 tf_i32gather_epi32
#define _mm512_roundscale_ps(a, imm8) tf_roundscale_ps((a), (imm8))

#endif
