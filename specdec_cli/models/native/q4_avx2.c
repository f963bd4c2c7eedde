/* specdec's q4 matmul of one block of 16 rows on a CPU with AVX2 but no AVX512-VNNI: the VNNI code's numbers bit for
   bit (the layout and the float steps: the top of q4_gemm.c), 8 rows and up to Q4_AVX2_TILE tokens at a time (16
   registers). q4_gemm.c's loop over blocks and tokens calls specdec_q4_block_avx2 where isa is 1. */

#include <immintrin.h>
#include <stdint.h>

#include "q4_layout.h"

/* q4_super_vnni and q4_steps_vnni (q4_layout.h) for 8 of the 16 rows (`half`), as the AVX2 code takes them. */
__attribute__((target("avx2,f16c")))
static inline void q4_super_avx2(const uint8_t *w, int64_t g, int half, __m256 *super_d, __m256 *super_dmin) {
    const uint8_t *super = w + (g >> 3) * Q4K_SUPER_BYTES;
    *super_d = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(super + Q4K_D + half * 16)));
    *super_dmin = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(super + Q4K_D + 32 + half * 16)));
}

__attribute__((target("avx2,f16c")))
static inline void q4_steps_avx2(const uint8_t *w, int layout, int64_t g, const uint8_t *p, int half, __m256 super_d,
                                 __m256 super_dmin, __m256 *d, __m256 *mins) {
    if (!layout) {
        *d = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(p + 256 + half * 16)));
        *mins = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(p + 288 + half * 16)));
        return;
    }
    const uint8_t *sub = w + (g >> 3) * Q4K_SUPER_BYTES + Q4K_SC + (g & 7) * 16 + half * 8;
    __m256 sc = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)sub)));
    __m256 m = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)(sub + 128))));
    *d = _mm256_mul_ps(super_d, sc);
    *mins = _mm256_xor_ps(_mm256_mul_ps(super_dmin, m), _mm256_set1_ps(-0.0f));
}

/* Group g of one block (W), this half's 8 rows, for T tokens into their totals (TOTAL, the caller's array): the
   unpacking, the group's steps (SUPER_D, SUPER_DMIN: the superblock's, layout 1), the integer sums and the float
   steps. A macro: the totals stay in registers. */
#define Q4_AVX2_GROUP(W, TOTAL, SUPER_D, SUPER_DMIN, T)                                                       \
    do {                                                                                                      \
        const uint8_t *p = q4_group(W, layout, g);                                                            \
        q4_prefetch_ahead(W, layout, g);                                                                      \
        __m256i c0 = _mm256_loadu_si256((const __m256i *)(p + half * 32));                                    \
        __m256i c1 = _mm256_loadu_si256((const __m256i *)(p + 64 + half * 32));                               \
        __m256i c2 = _mm256_loadu_si256((const __m256i *)(p + 128 + half * 32));                              \
        __m256i c3 = _mm256_loadu_si256((const __m256i *)(p + 192 + half * 32));                              \
        __m256i w0 = _mm256_and_si256(c0, low), w4 = _mm256_and_si256(_mm256_srli_epi16(c0, 4), low);        \
        __m256i w1 = _mm256_and_si256(c1, low), w5 = _mm256_and_si256(_mm256_srli_epi16(c1, 4), low);        \
        __m256i w2 = _mm256_and_si256(c2, low), w6 = _mm256_and_si256(_mm256_srli_epi16(c2, 4), low);        \
        __m256i w3 = _mm256_and_si256(c3, low), w7 = _mm256_and_si256(_mm256_srli_epi16(c3, 4), low);        \
        __m256 d, mins;                                                                                       \
        if (layout && (g == g_begin || (g & 7) == 0)) q4_super_avx2(W, g, half, &SUPER_D, &SUPER_DMIN);       \
        q4_steps_avx2(W, layout, g, p, half, SUPER_D, SUPER_DMIN, &d, &mins);                                 \
        for (int j = 0; j < T; j++) {                                                                         \
            const int32_t *x = tokens + j * steps + g * 8;                                                    \
            __m256i a = _mm256_add_epi16(Q4_PAIRS(w0, 0), Q4_PAIRS(w1, 1));                                  \
            __m256i b = _mm256_add_epi16(Q4_PAIRS(w4, 4), Q4_PAIRS(w5, 5));                                  \
            a = _mm256_add_epi16(a, _mm256_add_epi16(Q4_PAIRS(w2, 2), Q4_PAIRS(w3, 3)));                     \
            b = _mm256_add_epi16(b, _mm256_add_epi16(Q4_PAIRS(w6, 6), Q4_PAIRS(w7, 7)));                     \
            __m256 exact = _mm256_cvtepi32_ps(_mm256_madd_epi16(_mm256_add_epi16(a, b), ones));               \
            __m256 step = _mm256_mul_ps(d, _mm256_set1_ps(scales[j * groups + g]));                           \
            TOTAL[j] = _mm256_fmadd_ps(exact, step, TOTAL[j]);                                                \
            TOTAL[j] = _mm256_fmadd_ps(mins, _mm256_set1_ps(scaled_sums[j * groups + g]), TOTAL[j]);          \
        }                                                                                                     \
    } while (0)

/* This half's rows of each token into y (+ bias) from `total`, or into `sums`. */
__attribute__((target("avx2")))
static void q4_finish_avx2(const __m256 *total, int half, int64_t m_count, float *sums, const Q4Out *out) {
    if (out) { /* as the VNNI code: this half's rows of each token into y, + bias */
        int64_t lanes = out->lanes - half * 8;
        if (lanes <= 0) return;
        lanes = lanes < 8 ? lanes : 8;
        __m256i mask = _mm256_cmpgt_epi32(_mm256_set1_epi32((int)lanes), _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7));
        __m256 bias = out->bias ? _mm256_maskload_ps(out->bias + half * 8, mask) : _mm256_setzero_ps();
        for (int j = 0; j < m_count; j++)
            _mm256_maskstore_ps(out->y + j * out->stride + half * 8, mask,
                                out->bias ? _mm256_add_ps(total[j], bias) : total[j]);
    } else
        for (int j = 0; j < m_count; j++) _mm256_storeu_ps(sums + j * Q4_ROWS + half * 8, total[j]);
}

/* One block on AVX2 for 8 of the 16 rows (`half` 0 or 1) and up to 4 tokens: uint8 × int8 pairs summed in
   int16 (vpmaddubsw: 2·15·127 cannot saturate, so activations keep 8 bits), the group's 8 chunks too, then in
   int32 (one vpmaddwd a group and token where each chunk took one: 16 integer ops against 23). With `next` (and
   `next_out`), a second block's half alternates with w's, as in q4_block_vnni (q4_gemm.c). */
__attribute__((target("avx2,f16c,fma")))
static void q4_half_avx2(const uint8_t *w, int layout, int half, const int32_t *tokens, const float *scales,
                         const float *scaled_sums, int64_t steps, int64_t groups, int64_t g_begin, int64_t g_end,
                         int64_t m_count, float *sums, int accumulate, const Q4Out *out, const uint8_t *next,
                         const Q4Out *next_out) {
    __m256 total[Q4_AVX2_TILE], total_next[Q4_AVX2_TILE];
    for (int j = 0; j < Q4_AVX2_TILE; j++) {
        total[j] = accumulate && j < m_count ? _mm256_loadu_ps(sums + j * Q4_ROWS + half * 8) : _mm256_setzero_ps();
        total_next[j] = _mm256_setzero_ps();
    }
    const __m256i low = _mm256_set1_epi8(0x0F), ones = _mm256_set1_epi16(1);
    __m256 super_d = _mm256_setzero_ps(), super_dmin = _mm256_setzero_ps();
    __m256 next_d = _mm256_setzero_ps(), next_dmin = _mm256_setzero_ps();
/* Pairs of uint8 × int8 summed in int16 (each ≤ 2·15·127 = 3810), and the 8 chunks' sums in int16 too: ≤ 30480,
   so they cannot wrap; one vpmaddwd then widens each lane's two to int32. The same integer as summing in int32. */
#define Q4_PAIRS(weights, t) _mm256_maddubs_epi16(weights, _mm256_set1_epi32(x[t]))
    switch (m_count) {
        Q4_GROUPS_CASE(Q4_AVX2_GROUP, 1) Q4_GROUPS_CASE(Q4_AVX2_GROUP, 2) Q4_GROUPS_CASE(Q4_AVX2_GROUP, 3)
        Q4_GROUPS_CASE(Q4_AVX2_GROUP, 4)
    }
#undef Q4_PAIRS
#undef Q4_AVX2_GROUP
    q4_finish_avx2(total, half, m_count, sums, out);
    if (next) q4_finish_avx2(total_next, half, m_count, NULL, next_out);
}

/* A block (and `next`, as q4_block_vnni takes it) on AVX2: each tile of Q4_AVX2_TILE tokens, each half of the rows. */
void specdec_q4_block_avx2(const uint8_t *w, int layout, const int32_t *tokens, const float *scales,
                           const float *scaled_sums, int64_t steps, int64_t groups, int64_t g_begin, int64_t g_end,
                           int64_t m_count, float *sums, int accumulate, const Q4Out *out, const uint8_t *next,
                           const Q4Out *next_out) {
    for (int64_t m0 = 0; m0 < m_count; m0 += Q4_AVX2_TILE) {
        int64_t count = m_count - m0 < Q4_AVX2_TILE ? m_count - m0 : Q4_AVX2_TILE;
        Q4Out part, next_part;
        if (out) part = (Q4Out){out->y + m0 * out->stride, out->stride, out->bias, out->lanes};
        if (next) next_part = (Q4Out){next_out->y + m0 * next_out->stride, next_out->stride, next_out->bias,
                                      next_out->lanes};
        for (int half = 0; half < 2; half++)
            q4_half_avx2(w, layout, half, tokens + m0 * steps, scales + m0 * groups, scaled_sums + m0 * groups, steps,
                         groups, g_begin, g_end, count, sums ? sums + m0 * Q4_ROWS : NULL, accumulate,
                         out ? &part : NULL, next, next ? &next_part : NULL);
    }
}
