/* Vector arithmetic the attention (attention.c) and the layer halves (layer_kernels.c) share. */

#ifndef SPECDEC_VECTOR_MATH_H
#define SPECDEC_VECTOR_MATH_H

#include <immintrin.h>

/* exp(x) for 8 floats, the same steps for every lane (so a score's weight never depends on its neighbours):
   x = n·ln2 + r with |r| <= ln2/2, exp(r) by a degree-6 polynomial (Cephes' expf coefficients, ~1 ulp), times
   2^n built in the exponent bits. Below -87.3 it gives 0; above 88.4, exp(88.4). */
__attribute__((target("avx2,fma")))
static inline __m256 exp_avx2(__m256 x) {
    const __m256 low = _mm256_set1_ps(-87.33654f);
    __m256 zero = _mm256_cmp_ps(x, low, _CMP_LT_OQ);
    x = _mm256_min_ps(_mm256_max_ps(x, low), _mm256_set1_ps(88.37626f)); /* above: FLT_MAX-ish, not garbage */
    __m256 n = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(1.44269504088896341f)),
                               _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    __m256 r = _mm256_fnmadd_ps(n, _mm256_set1_ps(0.693359375f), x);
    r = _mm256_fnmadd_ps(n, _mm256_set1_ps(-2.12194440e-4f), r);
    __m256 p = _mm256_set1_ps(1.9875691500e-4f);
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.3981999507e-3f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(8.3334519073e-3f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(4.1665795894e-2f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.6666665459e-1f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(5.0000001201e-1f));
    p = _mm256_fmadd_ps(p, _mm256_mul_ps(r, r), _mm256_add_ps(r, _mm256_set1_ps(1.0f)));
    __m256i bits = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
    return _mm256_andnot_ps(zero, _mm256_mul_ps(p, _mm256_castsi256_ps(bits)));
}

/* tanh(x) for 8 floats as 1 - 2 / (exp(2x) + 1) (exp_avx2; ±1 where it saturates), the same steps for every lane:
   GELU's tanh form (layer_kernels.c) and Gemma 2's soft-capped scores (attention.c). */
__attribute__((target("avx2,fma")))
static inline __m256 tanh_avx2(__m256 x) {
    const __m256 one = _mm256_set1_ps(1.0f), two = _mm256_set1_ps(2.0f);
    return _mm256_sub_ps(one, _mm256_div_ps(two, _mm256_add_ps(exp_avx2(_mm256_mul_ps(two, x)), one)));
}

#endif
