/* q4's load-time code: a float weight quantised and packed into the q4 layout (the top of q4_gemm.c), and a packed
   layer's output rows picked into a new one. Run once a model loads, never in a forward. */

#include <immintrin.h>
#include <stdint.h>
#include <string.h>

#include "kernels.h"
#include "q4_layout.h"

/* formats/q4.py's quantize_weight and pack in one pass, bit for bit (tested): W (N, K), float32 (dtype 0) or bfloat16
   (dtype 1), rows `stride` elements apart, into `out`: ceil(N/16) blocks × groups × 320 bytes (the layout at the
   top). Channels past K count as 0.0, as the zero padding of quantize_weight does; rows past N are zero bytes.
   Per row and group: scale = half((max - min) / 15), minimum = half(min) (a -0.0 taken as 0.0 first), and each
   level clamp(round-half-even((w - float(minimum)) / float(scale)), 0, 15), or 0 where float(scale) is not > 0:
   the same IEEE steps torch takes there, 8 channels at a time (min and max are exact in any order). Needs AVX2,
   as the q4 matmul does. */
__attribute__((target("avx2,f16c")))
void specdec_q4_quantize(int threads, const void *weight, int dtype, int64_t N, int64_t K, int64_t stride,
                         uint8_t *out) {
    int64_t blocks = (N + Q4_ROWS - 1) / Q4_ROWS, groups = (K + Q4_GROUP - 1) / Q4_GROUP;
#pragma omp parallel for num_threads(threads) schedule(static)
    for (int64_t b = 0; b < blocks; b++) {
        for (int64_t g = 0; g < groups; g++) {
            uint8_t *dst = out + (b * groups + g) * Q4_GROUP_BYTES;
            memset(dst, 0, Q4_GROUP_BYTES);
            for (int r = 0; r < Q4_ROWS && b * Q4_ROWS + r < N; r++) {
                int64_t n = b * Q4_ROWS + r;
                float v[Q4_GROUP] = {0.0f};
                int64_t k0 = g * Q4_GROUP, present = K - k0 < Q4_GROUP ? K - k0 : Q4_GROUP;
                if (dtype == 1) {
                    const uint16_t *row = (const uint16_t *)weight + n * stride + k0;
                    uint32_t bits[Q4_GROUP];
                    for (int c = 0; c < present; c++) bits[c] = (uint32_t)row[c] << 16; /* bfloat16: the top half */
                    memcpy(v, bits, (size_t)present * sizeof(float));
                } else {
                    memcpy(v, (const float *)weight + n * stride + k0, (size_t)present * sizeof(float));
                }
                __m256 low8 = _mm256_loadu_ps(v), high8 = low8;
                for (int c = 8; c < Q4_GROUP; c += 8) {
                    low8 = _mm256_min_ps(low8, _mm256_loadu_ps(v + c));
                    high8 = _mm256_max_ps(high8, _mm256_loadu_ps(v + c));
                }
                float lows[8], highs[8];
                _mm256_storeu_ps(lows, low8);
                _mm256_storeu_ps(highs, high8);
                float low = lows[0], high = highs[0];
                for (int c = 1; c < 8; c++) {
                    low = lows[c] < low ? lows[c] : low;
                    high = highs[c] > high ? highs[c] : high;
                }
                low += 0.0f, high += 0.0f; /* -0.0 as 0.0, as q4.py does (which zero a min takes is not defined) */
                uint16_t scale = _cvtss_sh((high - low) / 15.0f, _MM_FROUND_TO_NEAREST_INT);
                uint16_t minimum = _cvtss_sh(low, _MM_FROUND_TO_NEAREST_INT);
                float step = _cvtsh_ss(scale), base = _cvtsh_ss(minimum);
                int32_t q[Q4_GROUP] = {0};
                if (step > 0.0f) {
                    __m256 steps = _mm256_set1_ps(step), bases = _mm256_set1_ps(base);
                    __m256 zero = _mm256_setzero_ps(), top = _mm256_set1_ps(15.0f);
                    for (int c = 0; c < Q4_GROUP; c += 8) {
                        __m256 level = _mm256_round_ps(_mm256_div_ps(_mm256_sub_ps(_mm256_loadu_ps(v + c), bases), steps),
                                                       _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
                        level = _mm256_min_ps(_mm256_max_ps(level, zero), top);
                        _mm256_storeu_si256((__m256i *)(q + c), _mm256_cvtps_epi32(level));
                    }
                }
                for (int t = 0; t < 4; t++)
                    for (int c = 0; c < 4; c++)
                        dst[t * 64 + r * 4 + c] = (uint8_t)(q[4 * t + c] | (q[4 * (t + 4) + c] << 4));
                memcpy(dst + 256 + 2 * r, &scale, 2);
                memcpy(dst + 288 + 2 * r, &minimum, 2);
            }
        }
    }
}

/* Output rows `rows` (count of them, each < N) of a packed layer into a new packed layer (`out`: ceil(count/16)
   blocks × groups × 320 bytes, which the caller zeroed: padding rows stay 0): each row's bytes moved whole — its
   4 × 4 bytes of value pairs, its scale and its minimum per group — so the same 4-bit values and scales as
   q4.py's unpack, index and pack give, bit for bit (tested). */
void specdec_q4_select_rows(int threads, const uint8_t *packed, int64_t groups, const int64_t *rows, int64_t count,
                            uint8_t *out) {
#pragma omp parallel for num_threads(threads) schedule(static)
    for (int64_t i = 0; i < count; i++) {
        int64_t source = rows[i];
        const uint8_t *from = packed + (source / Q4_ROWS) * groups * Q4_GROUP_BYTES;
        uint8_t *to = out + (i / Q4_ROWS) * groups * Q4_GROUP_BYTES;
        int from_row = (int)(source % Q4_ROWS), to_row = (int)(i % Q4_ROWS);
        for (int64_t g = 0; g < groups; g++, from += Q4_GROUP_BYTES, to += Q4_GROUP_BYTES) {
            for (int t = 0; t < 4; t++) memcpy(to + t * 64 + to_row * 4, from + t * 64 + from_row * 4, 4);
            memcpy(to + 256 + 2 * to_row, from + 256 + 2 * from_row, 2);
            memcpy(to + 288 + 2 * to_row, from + 288 + 2 * from_row, 2);
        }
    }
}
