/* specdec's levels matmul of one block of 16 rows on a CPU with AVX2 but no AVX512-VNNI: the VNNI code's numbers bit
   for bit (the layout and the float steps: the top of levels_gemm.c), 8 rows and up to LV_AVX2_TILE tokens at a time.
   levels_gemm.c's loop over blocks and tokens calls specdec_levels_block_avx2 where isa is 1.

   The integer sums: vpmaddubsw multiplies uint8 levels by int8 activations in pairs summed in int16, which cannot
   saturate for levels up to 127 (2·127·127 < 32768), then vpmaddwd widens each pair of pairs to int32. A wide form's
   levels (Q8_0: up to 255) are taken as u − 128 (signed) with the sign trick llama.cpp uses, |u − 128| times a with
   the sign of u − 128 (pairs at most 2·128·127): Σ (u − 128)·a, to which (128 − o)·Σa is added for the same
   integer Σ (u − o)·a. */

#include <immintrin.h>
#include <stdint.h>

#include "kernels.h"
#include "levels_layout.h"

/* levels_gemm.c's lv_steps_vnni for this side's 8 rows (`side` 0 or 1): the same products. */
__attribute__((target("avx2,fma,f16c")))
static inline void lv_steps_avx2(const uint8_t *t, LvForm f, int64_t slot, int h, int side, __m256 *step,
                                 __m256 *minimum) {
    if (f.steps == LV_FLOAT32) {
        *step = _mm256_loadu_ps((const float *)t + 16 * h + 8 * side);
        if (f.mins) *minimum = _mm256_loadu_ps((const float *)t + 16 * (f.halves + h) + 8 * side);
        return;
    }
    if (f.steps == LV_FLOAT16) {
        *step = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(t + 32 * h + 16 * side)));
        if (f.mins) *minimum = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(t + 32 * (f.halves + h) + 16 * side)));
        return;
    }
    int64_t entry = 16 * (slot * f.halves + h) + 8 * side, factors = 16 * LV_SUPER * f.halves;
    const uint8_t *d = t + factors * (1 + f.mins) + 16 * side;
    __m256 sc = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)(t + entry))));
    *step = _mm256_mul_ps(_mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)d)), sc);
    if (f.mins) {
        __m256 m = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)(t + factors + entry))));
        __m256 scaled = _mm256_mul_ps(_mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(d + 32))), m);
        *minimum = _mm256_xor_ps(scaled, _mm256_set1_ps(-0.0f));
    }
}

/* The float steps of levels_gemm.c's lv_add_group_vnni for this side's 8 rows, in the same order; `offset` the
   integer to add per Σa of a half (−o, + 128 where the wide sign trick took 128·Σa out). */
__attribute__((target("avx2,fma")))
static inline __m256 lv_add_group_avx2(__m256 total, __m256i low, __m256i high, LvForm f, int offset,
                                       const __m256 *step, const __m256 *minimum, float scale,
                                       const float *half_sums, const int32_t *half_ints) {
    __m256i exact[2] = {f.halves == 2 ? low : _mm256_add_epi32(low, high), high};
    for (int h = 0; h < f.halves; h++) {
        exact[h] = _mm256_add_epi32(exact[h], _mm256_set1_epi32(offset * half_ints[h]));
        total = _mm256_fmadd_ps(_mm256_cvtepi32_ps(exact[h]), _mm256_mul_ps(step[h], _mm256_set1_ps(scale)), total);
        if (f.mins) total = _mm256_fmadd_ps(minimum[h], _mm256_set1_ps(half_sums[h]), total);
    }
    return total;
}

/* lv_values_vnni (levels_gemm.c) for this side's 8 rows: a group's 8 chunks of levels as bytes. */
__attribute__((target("avx2"), always_inline))
static inline void lv_values_avx2(const uint8_t *p, LvForm f, int side, __m256i v[8]) {
    if (!f.high_bits) {
        for (int c = 0; c < 8; c++) v[c] = _mm256_loadu_si256((const __m256i *)(p + 64 * c + 32 * side));
        return;
    }
    const __m256i low = _mm256_set1_epi8(0x0F), top = _mm256_set1_epi8((char)(((1 << f.high_bits) - 1) << 4));
    for (int t = 0; t < 4; t++) {
        __m256i chunk = _mm256_loadu_si256((const __m256i *)(p + 64 * t + 32 * side));
        v[t] = _mm256_and_si256(chunk, low);
        v[t + 4] = _mm256_and_si256(_mm256_srli_epi16(chunk, 4), low);
    }
    __m256i planes[2] = {_mm256_loadu_si256((const __m256i *)(p + 256 + 32 * side)), _mm256_setzero_si256()};
    if (f.high_bits == 2) planes[1] = _mm256_loadu_si256((const __m256i *)(p + 320 + 32 * side));
    for (int c = 0; c < 8; c++) {
        int bit = (c * f.high_bits) & 7;
        __m256i plane = planes[(c * f.high_bits) >> 3];
        __m256i moved = bit <= 4 ? _mm256_slli_epi16(plane, 4 - bit) : _mm256_srli_epi16(plane, bit - 4);
        v[c] = _mm256_or_si256(v[c], _mm256_and_si256(moved, top));
    }
}

/* Chunk c of one token (a4: its 8 broadcastable 4-channel steps of the group) against this side's 8 rows: 8 int32. */
#define LV_DOT(c)                                                                                             \
    (f.wide ? _mm256_madd_epi16(_mm256_maddubs_epi16(magnitude[c], _mm256_sign_epi8(_mm256_set1_epi32(a4[c]), v[c])), \
                                ones)                                                                         \
            : _mm256_madd_epi16(_mm256_maddubs_epi16(v[c], _mm256_set1_epi32(a4[c])), ones))

#define LV_AVX2_GROUP(T)                                                                                      \
    do {                                                                                                      \
        const uint8_t *p = lv_group(w, f, g);                                                                 \
        lv_prefetch_ahead(w, f, g);                                                                           \
        __m256i v[8], magnitude[8];                                                                           \
        __m256 step[2], minimum[2];                                                                           \
        lv_values_avx2(p, f, side, v);                                                                        \
        for (int h = 0; h < f.halves; h++)                                                                    \
            lv_steps_avx2(lv_table(w, f, g), f, g & (f.unit_groups - 1), h, side, step + h, minimum + h);          \
        for (int c = 0; f.wide && c < 8; c++) { /* u − 128 as a signed byte, and its size */                 \
            v[c] = _mm256_xor_si256(v[c], _mm256_set1_epi8((char)0x80));                                      \
            magnitude[c] = _mm256_abs_epi8(v[c]);                                                             \
        }                                                                                                     \
        for (int j = 0; j < T; j++) {                                                                         \
            const int32_t *a4 = x.values + (j * x.groups + g) * 8;                                            \
            __m256i low = _mm256_add_epi32(_mm256_add_epi32(LV_DOT(0), LV_DOT(1)),                            \
                                           _mm256_add_epi32(LV_DOT(2), LV_DOT(3)));                           \
            __m256i high = _mm256_add_epi32(_mm256_add_epi32(LV_DOT(4), LV_DOT(5)),                           \
                                            _mm256_add_epi32(LV_DOT(6), LV_DOT(7)));                          \
            int64_t at = (j * x.groups + g) * f.halves;                                                       \
            total[j] = lv_add_group_avx2(total[j], low, high, f, offset, step, minimum,                      \
                                         x.scales[j * x.groups + g], x.half_sums + at, x.half_ints + at);     \
        }                                                                                                     \
    } while (0)

#define LV_CASE(T)                                                                                            \
    case T:                                                                                                   \
        for (int64_t g = g_begin; g < g_end; g++) LV_AVX2_GROUP(T);                                           \
        break;

/* This side's 8 rows of one block for up to LV_AVX2_TILE tokens (as levels_gemm.c's lv_block_vnni takes a block). */
__attribute__((target("avx2,fma,f16c"), always_inline))
static inline void lv_side_avx2(const uint8_t *w, LvForm f, int side, LvTokens x, int64_t g_begin, int64_t g_end,
                                int64_t m_count, float *sums, int accumulate, const LvOut *out) {
    const __m256i ones = _mm256_set1_epi16(1);
    const int offset = (f.wide ? 128 : 0) - f.offset; /* the wide sign trick's sums are Σ (u − 128)·a */
    __m256 total[LV_AVX2_TILE];
    for (int j = 0; j < LV_AVX2_TILE; j++)
        total[j] = accumulate && j < m_count ? _mm256_loadu_ps(sums + j * LV_ROWS + side * 8) : _mm256_setzero_ps();
    switch (m_count) {
        LV_CASE(1) LV_CASE(2) LV_CASE(3) LV_CASE(4)
    }
    if (!out) {
        for (int j = 0; j < m_count; j++) _mm256_storeu_ps(sums + j * LV_ROWS + side * 8, total[j]);
        return;
    }
    int64_t lanes = out->lanes - side * 8;
    if (lanes <= 0) return;
    __m256i mask = _mm256_cmpgt_epi32(_mm256_set1_epi32((int)(lanes < 8 ? lanes : 8)),
                                      _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7));
    __m256 bias = out->bias ? _mm256_maskload_ps(out->bias + side * 8, mask) : _mm256_setzero_ps();
    for (int j = 0; j < m_count; j++)
        _mm256_maskstore_ps(out->y + j * out->stride + side * 8, mask,
                            out->bias ? _mm256_add_ps(total[j], bias) : total[j]);
}
#undef LV_CASE
#undef LV_AVX2_GROUP
#undef LV_DOT

/* lv_side_avx2 compiled for each .gguf type's form (LV_BY_FORM), and for any other. */
__attribute__((target("avx2,fma,f16c")))
static void lv_side_by_form(const uint8_t *w, LvForm f, int side, LvTokens x, int64_t g_begin, int64_t g_end,
                            int64_t m_count, float *sums, int accumulate, const LvOut *out) {
#define LV_SIDE(form) lv_side_avx2(w, form, side, x, g_begin, g_end, m_count, sums, accumulate, out)
    LV_BY_FORM(f, LV_SIDE)
#undef LV_SIDE
}

/* A block on AVX2: each tile of LV_AVX2_TILE tokens, each side of 8 rows. */
void specdec_levels_block_avx2(const uint8_t *w, LvForm f, LvTokens x, int64_t g_begin, int64_t g_end,
                               int64_t m_count, float *sums, int accumulate, const LvOut *out) {
    for (int64_t m0 = 0; m0 < m_count; m0 += LV_AVX2_TILE) {
        int64_t count = m_count - m0 < LV_AVX2_TILE ? m_count - m0 : LV_AVX2_TILE, at = m0 * x.groups;
        LvTokens part = {x.values + at * 8, x.scales + at, x.half_sums + at * f.halves, x.half_ints + at * f.halves,
                         x.groups};
        LvOut piece;
        if (out) piece = (LvOut){out->y + m0 * out->stride, out->stride, out->bias, out->lanes};
        for (int side = 0; side < 2; side++)
            lv_side_by_form(w, f, side, part, g_begin, g_end, count, sums ? sums + m0 * LV_ROWS : NULL, accumulate,
                            out ? &piece : NULL);
    }
}
