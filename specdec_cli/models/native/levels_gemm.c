/* specdec's levels matmul: weights as small unsigned integer levels with a step (and minimum) per row and group of
   channels, × int8 activations quantised per token and group of 32 as q4's are (specdec_q8_groups). It holds a
   .gguf's Q8_0, Q6_K, Q5_0 and Q5_K tensors with the file's weights bit for bit and close to the file's bytes
   (formats/gguf_levels.py), and any mix of them with Q4_0, Q4_1 and Q4_K in one fused layer.

   W: per output row and input channel a level u in 0..255 (0..31 or 0..63 where packed); per row and group of 32
   channels, for each half of it (a form with two halves: 16 channels each; else the whole group) a step, and where
   the form has them a minimum; the form's offset o (0 or a power of two): w = step·(u − o) + minimum. Each weight is
   then the file's exactly: Q8_0 u = q + 128, o = 128, step d; Q5_0 o = 16, step d; Q6_K two halves, o = 32, step
   d·sc; Q5_K step d·sc and minimum −dmin·m per 32, o = 0.
   Packed in blocks of 16 rows; a block is units of 1 group, or of 8 (LV_FACTORS: a K block's 256 channels), a unit
   (levels_layout.h's LvForm.unit_bytes) each of its groups' levels, then its table:
   - a group's levels: 8 chunks of 16 rows × 4 channels, chunk c channels 4c..4c+3 (the layout vpdpbusd takes): 512
     bytes, a byte a level; or, for 5- and 6-bit levels, their low 4 bits as q4 packs them (4 × 64 bytes: the low
     nibbles chunk t, the high ones chunk t + 4) then their `high_bits` top bits in 64-byte planes, chunk c's at bit
     c·b of the plane (b = high_bits: plane c·b / 8, shifted by c·b mod 8);
   - the table, each entry 16 rows side by side: LV_FLOAT32 (a fused mix) and LV_FLOAT16 (Q8_0, Q5_0: the file's d)
     halves steps, then as many minimums; LV_FACTORS (Q6_K, Q5_K) an int8 sc per group and half (8 · halves), as
     many m where the form has minimums, the rows' float16 d, then their dmin: step d·sc and minimum −dmin·m, made
     here, each an exact float32 product (an 11-bit mantissa by an 8-bit integer), gguf's own.
   Bits a weight: Q6_K 6.5625 and Q5_0 5.5, Q8_0 8.5 (the file's), Q5_K 5.625 (sc and m a byte each), a fused mix 10
   or 12 (float32 steps and minimums per 16 channels; 6-bit levels packed).

   Per group, token and half h (channels H):  Σ_H w·x ≈ s·step·X_h + s·minimum·Σ_H a, where X_h = Σ_H (u − o)·a is
   exact (uint8 × int8 in int32, from −o·Σ_H a) and the float steps after it are the same for every token whatever
   the number of tokens in the call:
       sum = fma(float(X_h), step·s, sum);  sum = fma(minimum, s·Σa, sum)
   (the second where there are minimums; halves in order, groups in order; then + bias). So a token's output never
   depends on its neighbours, a k-token verify gives each token what a one-token forward gives it, and the VNNI and
   AVX2 code (levels_avx2.c), with the same integers and float steps, agree bit for bit (tested). AMX CPUs and a
   prompt read (isa 3, 4) run the VNNI code.

   Built with the other kernels into one library by binding.py; called through ctypes. */

#include <immintrin.h>
#include <omp.h>
#include <stdint.h>
#include <stdlib.h>

#include "kernels.h"
#include "levels_layout.h"

/* Half h of group g's 16 rows' step, and minimum where the form has minimums, from its unit's table (t; `slot`: g's
   place in its unit): as stored (float32, float16), or d·sc and −dmin·m (LV_FACTORS), each an exact float32 product. */
__attribute__((target("avx512f,f16c")))
static inline void lv_steps_vnni(const uint8_t *t, LvForm f, int64_t slot, int h, __m512 *step, __m512 *minimum) {
    if (f.steps == LV_FLOAT32) {
        *step = _mm512_loadu_ps((const float *)t + 16 * h);
        if (f.mins) *minimum = _mm512_loadu_ps((const float *)t + 16 * (f.halves + h));
        return;
    }
    if (f.steps == LV_FLOAT16) {
        *step = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(t + 32 * h)));
        if (f.mins) *minimum = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(t + 32 * (f.halves + h))));
        return;
    }
    int64_t entry = 16 * (slot * f.halves + h), factors = 16 * LV_SUPER * f.halves;
    const uint8_t *d = t + factors * (1 + f.mins);
    __m512 sc = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)(t + entry))));
    *step = _mm512_mul_ps(_mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)d)), sc);
    if (f.mins) {
        __m512 m = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)(t + factors + entry))));
        __m512 scaled = _mm512_mul_ps(_mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(d + 32))), m);
        *minimum = _mm512_castsi512_ps(_mm512_xor_si512(_mm512_castps_si512(scaled), _mm512_set1_epi32((int)0x80000000u)));
    }
}

/* One token's group into its 16 rows' total: `low` and `high` the exact sums over the group's first and last 16
   channels (the offset's −o·Σa in them), then the float steps at the top, halves in order. */
__attribute__((target("avx512f,fma")))
static inline __m512 lv_add_group_vnni(__m512 total, __m512i low, __m512i high, LvForm f, const __m512 *step,
                                       const __m512 *minimum, float scale, const float *half_sums) {
    __m512i exact[2] = {f.halves == 2 ? low : _mm512_add_epi32(low, high), high};
    for (int h = 0; h < f.halves; h++) {
        total = _mm512_fmadd_ps(_mm512_cvtepi32_ps(exact[h]), _mm512_mul_ps(step[h], _mm512_set1_ps(scale)), total);
        if (f.mins) total = _mm512_fmadd_ps(minimum[h], _mm512_set1_ps(half_sums[h]), total);
    }
    return total;
}

/* A group's 8 chunks of levels (p: the group) as bytes, as the top of the file lays them out: each plane of top bits
   loaded once, and each chunk's bits moved to bits 4.. of its bytes by one shift (within 16-bit lanes: what crosses
   into the next byte lands outside the mask) and joined by one ternary-logic op, v | (moved & mask). */
__attribute__((target("avx512f,avx512bw"), always_inline))
static inline void lv_values_vnni(const uint8_t *p, LvForm f, __m512i v[8]) {
    if (!f.high_bits) {
        for (int c = 0; c < 8; c++) v[c] = _mm512_loadu_si512((const void *)(p + 64 * c));
        return;
    }
    const __m512i low = _mm512_set1_epi8(0x0F), top = _mm512_set1_epi8((char)(((1 << f.high_bits) - 1) << 4));
    for (int t = 0; t < 4; t++) {
        __m512i chunk = _mm512_loadu_si512((const void *)(p + 64 * t));
        v[t] = _mm512_and_si512(chunk, low);
        v[t + 4] = _mm512_and_si512(_mm512_srli_epi16(chunk, 4), low);
    }
    __m512i planes[2] = {_mm512_loadu_si512((const void *)(p + 256)), _mm512_setzero_si512()};
    if (f.high_bits == 2) planes[1] = _mm512_loadu_si512((const void *)(p + 320));
    for (int c = 0; c < 8; c++) {
        int bit = (c * f.high_bits) & 7; /* chunk c's bits in its plane, to go to bit 4 */
        __m512i plane = planes[(c * f.high_bits) >> 3];
        __m512i moved = bit <= 4 ? _mm512_slli_epi16(plane, 4 - bit) : _mm512_srli_epi16(plane, bit - 4);
        v[c] = _mm512_ternarylogic_epi32(v[c], moved, top, 0xF8); /* v | (moved & top) */
    }
}

/* Group g of the block (w) for T tokens into TOTAL: the levels, the steps, the integer sums of each token (chunks
   0-3 into `low`, 4-7 into `high`: the group's two halves; the offset's −o·Σa where they start), the float steps.
   A macro: the totals stay in registers. */
#define LV_VNNI_GROUP(T)                                                                                      \
    do {                                                                                                      \
        const uint8_t *p = lv_group(w, f, g);                                                                 \
        lv_prefetch_ahead(w, f, g);                                                                           \
        __m512i v[8];                                                                                         \
        __m512 step[2], minimum[2];                                                                           \
        lv_values_vnni(p, f, v);                                                                              \
        for (int h = 0; h < f.halves; h++)                                                                    \
            lv_steps_vnni(lv_table(w, f, g), f, g & (f.unit_groups - 1), h, step + h, minimum + h);                 \
        for (int j = 0; j < T; j++) {                                                                         \
            const int32_t *a4 = x.values + (j * x.groups + g) * 8, *ints = x.half_ints + (j * x.groups + g) * f.halves; \
            __m512i low = _mm512_set1_epi32(-f.offset * ints[0]);                                             \
            __m512i high = f.halves == 2 ? _mm512_set1_epi32(-f.offset * ints[1]) : _mm512_setzero_si512();    \
            low = _mm512_dpbusd_epi32(low, v[0], _mm512_set1_epi32(a4[0]));                                   \
            high = _mm512_dpbusd_epi32(high, v[4], _mm512_set1_epi32(a4[4]));                                 \
            low = _mm512_dpbusd_epi32(low, v[1], _mm512_set1_epi32(a4[1]));                                   \
            high = _mm512_dpbusd_epi32(high, v[5], _mm512_set1_epi32(a4[5]));                                 \
            low = _mm512_dpbusd_epi32(low, v[2], _mm512_set1_epi32(a4[2]));                                   \
            high = _mm512_dpbusd_epi32(high, v[6], _mm512_set1_epi32(a4[6]));                                 \
            low = _mm512_dpbusd_epi32(low, v[3], _mm512_set1_epi32(a4[3]));                                   \
            high = _mm512_dpbusd_epi32(high, v[7], _mm512_set1_epi32(a4[7]));                                 \
            total[j] = lv_add_group_vnni(total[j], low, high, f, step, minimum, x.scales[j * x.groups + g],   \
                                         x.half_sums + (j * x.groups + g) * f.halves);                        \
        }                                                                                                     \
    } while (0)

#define LV_CASE(T)                                                                                            \
    case T:                                                                                                   \
        for (int64_t g = g_begin; g < g_end; g++) LV_VNNI_GROUP(T);                                           \
        break;

/* One block of 16 rows (w), groups [g_begin, g_end), up to LV_TILE tokens (x: the tile's first token's); `sums`
   (LV_TILE, 16) added to when `accumulate`, else started from 0; with `out` (the block's last groups) the sums go
   to y (+ bias) instead, masked past the last row. */
__attribute__((target("avx512f,avx512bw,avx512vnni,fma,f16c"), always_inline))
static inline void lv_block_of_form(const uint8_t *w, LvForm f, LvTokens x, int64_t g_begin, int64_t g_end,
                                    int64_t m_count, float *sums, int accumulate, const LvOut *out) {
    __m512 total[LV_TILE];
    for (int j = 0; j < LV_TILE; j++)
        total[j] = accumulate && j < m_count ? _mm512_loadu_ps(sums + j * LV_ROWS) : _mm512_setzero_ps();
    switch (m_count) {
        LV_CASE(1) LV_CASE(2) LV_CASE(3) LV_CASE(4) LV_CASE(5) LV_CASE(6) LV_CASE(7) LV_CASE(8)
    }
    q4_finish_vnni(total, m_count, sums, out);  /* LV_ROWS == Q4_ROWS: the same 16 rows a block */
}
#undef LV_CASE
#undef LV_VNNI_GROUP

/* lv_block_of_form compiled for each .gguf type's form (LV_BY_FORM), and for any other. */
__attribute__((target("avx512f,avx512bw,avx512vnni,fma,f16c")))
static void lv_block_vnni(const uint8_t *w, LvForm f, LvTokens x, int64_t g_begin, int64_t g_end, int64_t m_count,
                          float *sums, int accumulate, const LvOut *out) {
#define LV_BLOCK(form) lv_block_of_form(w, form, x, g_begin, g_end, m_count, sums, accumulate, out)
    LV_BY_FORM(f, LV_BLOCK)
#undef LV_BLOCK
}

/* y (M, N) = x · Wᵀ (+ bias), x as `tokens` holds it, W packed (ceil(N/16) blocks × units × unit_bytes). Up to a
   tile of tokens: one pass over each block's weights. More: LV_CHUNK groups at a time, so a block's chunk stays in L1
   while every tile of tokens passes over it (each sum still takes its groups in order: the same result). Blocks are
   dealt to the threads guided, as q4's; a block is one thread's whole work. Returns 0, or 1 when a buffer could not
   be allocated. */
static int lv_gemm(int isa, LvForm f, int threads, LvTokens tokens, int64_t M, const uint8_t *w_packed,
                   const float *bias, int64_t N, float *y) {
    int64_t tile = isa >= 2 ? LV_TILE : LV_AVX2_TILE, groups = tokens.groups;
    int64_t blocks = (N + LV_ROWS - 1) / LV_ROWS, tiles = (M + tile - 1) / tile;
    int64_t chunk = M <= tile ? groups : LV_CHUNK, block_bytes = groups / f.unit_groups * f.unit_bytes;
    size_t per_thread = M <= tile ? 0 : (size_t)(tiles * tile * LV_ROWS);
    float *sums_all = per_thread ? malloc((size_t)threads * per_thread * sizeof(float)) : NULL;
    if (per_thread && !sums_all) return 1;
#pragma omp parallel num_threads(threads)
    {
        float *sums = per_thread ? sums_all + (size_t)omp_get_thread_num() * per_thread : NULL;
#pragma omp for schedule(guided)
        for (int64_t b = 0; b < blocks; b++) {
            const uint8_t *w = w_packed + b * block_bytes;
            int64_t first = b * LV_ROWS, lanes = N - first < LV_ROWS ? N - first : LV_ROWS;
            for (int64_t g0 = 0; g0 < groups; g0 += chunk) {
                int64_t g1 = g0 + chunk < groups ? g0 + chunk : groups;
                for (int64_t t = 0; t < tiles; t++) {
                    int64_t m_count = M - t * tile < tile ? M - t * tile : tile, at = t * tile * groups;
                    LvTokens part = {tokens.values + at * 8, tokens.scales + at, tokens.half_sums + at * f.halves,
                                     tokens.half_ints + at * f.halves, groups};
                    float *tile_sums = sums ? sums + t * tile * LV_ROWS : NULL;
                    LvOut out = {y + t * tile * N + first, N, bias ? bias + first : NULL, lanes};
                    const LvOut *last = g1 == groups ? &out : NULL; /* the sums' last groups: straight into y */
                    if (isa >= 2)
                        lv_block_vnni(w, f, part, g0, g1, m_count, tile_sums, g0 > 0, last);
                    else
                        specdec_levels_block_avx2(w, f, part, g0, g1, m_count, tile_sums, g0 > 0, last);
                }
            }
        }
    }
    free(sums_all);
    return 0;
}

/* Each token's and group's s·Σa per half (`half_sums`, (M, groups, halves)) and Σa per half as integers
   (`half_ints`), from the quantised values. */
static void lv_half_sums(const int8_t *values, const float *scales, int64_t M, int64_t groups, LvForm f,
                         float *half_sums, int32_t *half_ints) {
    for (int64_t i = 0; i < M * groups; i++) {
        int32_t sum[2] = {0, 0};
        for (int c = 0; c < LV_GROUP; c++) sum[c >= 16] += values[i * LV_GROUP + c];
        if (f.halves == 1) sum[0] += sum[1];
        for (int h = 0; h < f.halves; h++) {
            half_sums[i * f.halves + h] = scales[i] * (float)sum[h];
            half_ints[i * f.halves + h] = sum[h];
        }
    }
}

/* The whole layer in one call: x (M, K) float32 quantised per token and group of 32 (specdec_q8_groups, q4's), then
   the matmul of `form` (levels_layout.h's lv_form; the top of this file). isa: 2 and up VNNI, 1 AVX2. Returns 0, or
   1 when a buffer could not be allocated. */
int specdec_levels_linear(int isa, int form, int threads, const float *x, int64_t M, int64_t K, int64_t groups,
                          const uint8_t *w_packed, const float *bias, int64_t N, float *y) {
    LvForm f = lv_form(form);
    int8_t *values = malloc((size_t)(M * groups * LV_GROUP));
    float *scales = malloc((size_t)(M * groups) * 4 * sizeof(float)); /* scales, q4's scaled sums, half sums */
    int32_t *half_ints = malloc((size_t)(M * groups) * 2 * sizeof(int32_t));
    int failed = !values || !scales || !half_ints;
    if (!failed) {
        specdec_q8_groups(threads, x, M, K, groups, values, scales, scales + M * groups);
        float *half_sums = scales + 2 * M * groups;
        lv_half_sums(values, scales, M, groups, f, half_sums, half_ints);
        LvTokens tokens = {(const int32_t *)values, scales, half_sums, half_ints, groups};
        failed = lv_gemm(isa, f, threads, tokens, M, w_packed, bias, N, y);
    }
    free(values);
    free(scales);
    free(half_ints);
    return failed;
}
