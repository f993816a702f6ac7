/* Vectorized e^x for the CPU kernels (AVX2 + FMA). Included by decode_attention.c (and
 * through it by decode_step.c). */
#ifndef PDSERVE_VEC_EXP_H
#define PDSERVE_VEC_EXP_H

#include <immintrin.h>

/* e^x for 8 lanes (Cephes' expf: range reduction by ln 2 in two parts, degree-5 polynomial):
 * within 1.2e-7 relative of e^x on [-87, 88] (checked against libm's exp over a 0.0014 grid);
 * inputs are clamped to +-88.38, and below about -87.3 the result is 0 (silu(g) for g > 87 is
 * then exactly g, as it is in fp32 anyway). */
static inline __m256 exp8(__m256 x) {
    x = _mm256_min_ps(_mm256_max_ps(x, _mm256_set1_ps(-88.3762626647949f)),
                      _mm256_set1_ps(88.3762626647949f));
    __m256 fx = _mm256_fmadd_ps(x, _mm256_set1_ps(1.44269504088896341f), _mm256_set1_ps(0.5f));
    fx = _mm256_floor_ps(fx);
    x = _mm256_fnmadd_ps(fx, _mm256_set1_ps(0.693359375f), x);
    x = _mm256_fnmadd_ps(fx, _mm256_set1_ps(-2.12194440e-4f), x);
    __m256 y = _mm256_set1_ps(1.9875691500E-4f);
    y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(1.3981999507E-3f));
    y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(8.3334519073E-3f));
    y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(4.1665795894E-2f));
    y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(1.6666665459E-1f));
    y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(5.0000001201E-1f));
    y = _mm256_fmadd_ps(y, _mm256_mul_ps(x, x), _mm256_add_ps(x, _mm256_set1_ps(1.0f)));
    __m256i e = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvttps_epi32(fx), _mm256_set1_epi32(127)), 23);
    return _mm256_mul_ps(y, _mm256_castsi256_ps(e));
}

#endif
