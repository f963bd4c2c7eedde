/* specdec's q4 matmul: int4 weights × int8 activations, llama.cpp's Q4_1 × Q8_0 recipe, for few tokens.

   W: 4-bit values q in 0..15 with, per output row and group of 32 input channels, a scale d and a
   minimum m in float16 (w ≈ d·q + m). Packed in blocks of 16 rows; a block's group is 320 bytes:
   - 256 bytes of values: 4 chunks of 64, chunk t holding 16 rows × 4 channels (the layout one VNNI
     vpdpbusd takes), the low nibbles channels 4t..4t+3 of the group, the high ones 4(t+4)..4(t+4)+3;
   - 32 bytes of d (16 rows, float16), 32 bytes of m.
   x: quantised here per token and group of 32 channels: symmetric int8 a with a float scale s.

   Layout 1 (a .gguf's Q4_K blocks as they are, gguf_q4.py): d·sc and −dmin·m instead of d and m, per
   superblock of 8 groups (256 channels) and block of 16 rows, 2368 bytes (37 cache lines):
   - 8 × 256 bytes: the groups' values as above (each 64-byte aligned: a load across two lines costs two);
   - 8 × 16 bytes: the groups' sc (0..63, one a row), then 8 × 16 bytes m;
   - 32 bytes: d of the 16 rows (float16), then 32 bytes dmin.
   The group's step d·sc and minimum −dmin·m are exact in float32 (11 and 6 significant bits), so the
   weights are the file's bit for bit, in 4.625 bits a weight against 5: 7.5% fewer bytes to read.

   Per group:  Σ_k w·x ≈ d·s·Σ q·a + m·s·Σ a  — the integer sum Σ q·a is exact (uint8 × int8), and the
   float steps after it are the same for every token whatever the number of tokens in the call:
       sum = fma(float(Σ q·a), d·s, sum);  sum = fma(m, s·Σa, sum)     (groups in order; then + bias)
   so a token's output never depends on its neighbours, and a k-token verify gives each token what a
   one-token forward gives it, bit for bit. The VNNI and the AVX2 code do the same float steps, so they
   agree bit for bit too (tested).

   Built with int8_gemm.c into one library by int8_kernel.py; called through ctypes. */

#include <immintrin.h>
#include <math.h>
#include <omp.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "q4_layout.h"

#define Q4_TILE 8       /* tokens held in registers at once (AVX512) */
#define Q4_AVX2_TILE 4  /* and on AVX2 (16 registers) */
#define Q4_AMX_TOKENS 9 /* from this many tokens on, AMX where the CPU has it (isa 3; q4_amx.c); VNNI is faster below */

/* One whole group of 32 channels of a row, 8 at a time: the same steps as the scalar loop below (amax is exact,
   x / scale the same IEEE division, rounding to nearest even as nearbyintf does, the sum in integers), so the
   same bytes. Returns the sum of the quantised values. */
__attribute__((target("avx2")))
static int q8_group_avx2(const float *x, float scale, int8_t *dst) {
    const __m256 top = _mm256_set1_ps(127.0f), bottom = _mm256_set1_ps(-127.0f), step = _mm256_set1_ps(scale);
    __m256i q[4];
    for (int i = 0; i < 4; i++) {
        __m256 v = _mm256_round_ps(_mm256_div_ps(_mm256_loadu_ps(x + 8 * i), step),
                                   _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
        q[i] = _mm256_cvtps_epi32(_mm256_min_ps(_mm256_max_ps(v, bottom), top));
    }
    __m256i sums = _mm256_add_epi32(_mm256_add_epi32(q[0], q[1]), _mm256_add_epi32(q[2], q[3]));
    __m256i words = _mm256_permute4x64_epi64(_mm256_packs_epi32(q[0], q[1]), 0xD8); /* channels 0-15 in order */
    __m256i words2 = _mm256_permute4x64_epi64(_mm256_packs_epi32(q[2], q[3]), 0xD8);
    __m256i bytes = _mm256_permute4x64_epi64(_mm256_packs_epi16(words, words2), 0xD8);
    _mm256_storeu_si256((__m256i *)dst, bytes);
    __m128i half = _mm_add_epi32(_mm256_castsi256_si128(sums), _mm256_extracti128_si256(sums, 1));
    half = _mm_add_epi32(half, _mm_shuffle_epi32(half, 0x4E));
    half = _mm_add_epi32(half, _mm_shuffle_epi32(half, 0xB1));
    return _mm_cvtsi128_si32(half);
}

__attribute__((target("avx2")))
static float amax_avx2(const float *x) {
    const __m256 sign = _mm256_set1_ps(-0.0f);
    __m256 m = _mm256_setzero_ps(); /* max(a, m) keeps m unless a > m: the scalar loop's rule, NaN skipped too */
    for (int i = 0; i < 4; i++) m = _mm256_max_ps(_mm256_andnot_ps(sign, _mm256_loadu_ps(x + 8 * i)), m);
    __m128 h = _mm_max_ps(_mm256_castps256_ps128(m), _mm256_extractf128_ps(m, 1));
    h = _mm_max_ps(h, _mm_movehl_ps(h, h));
    h = _mm_max_ss(h, _mm_shuffle_ps(h, h, 0x55));
    return _mm_cvtss_f32(h);
}

/* x (M, K) float32 → a (M, groups*32) int8 (zero past K), s (M, groups) and s·Σa (M, groups) float32:
   per group scale = amax/127, a = clamp(round_half_even(x / scale), -127, 127); an all-zero group gets
   scale 0 and a = 0. Whole groups go 8 channels at a time where the CPU has AVX2 (the same bytes). */
void specdec_q8_groups(int threads, const float *x, int64_t M, int64_t K, int64_t groups, int8_t *values,
                       float *scales, float *scaled_sums) {
    int vector = __builtin_cpu_supports("avx2");
#pragma omp parallel for num_threads(threads) schedule(static) if (M * K > 65536)
    for (int64_t m = 0; m < M; m++) {
        for (int64_t g = 0; g < groups; g++) {
            int64_t k0 = g * Q4_GROUP, k1 = k0 + Q4_GROUP < K ? k0 + Q4_GROUP : K;
            const float *row = x + m * K;
            int8_t *dst = values + m * groups * Q4_GROUP + k0;
            int whole = vector && k1 - k0 == Q4_GROUP;
            float amax = 0.0f;
            if (whole)
                amax = amax_avx2(row + k0);
            else
                for (int64_t k = k0; k < k1; k++) {
                    float a = fabsf(row[k]);
                    amax = a > amax ? a : amax;
                }
            float scale = amax / 127.0f;
            int sum = 0;
            if (whole && scale > 0.0f)
                sum = q8_group_avx2(row + k0, scale, dst);
            else
                for (int64_t k = k0; k < k1; k++) {
                    float q = scale > 0.0f ? nearbyintf(row[k] / scale) : 0.0f;
                    q = q < -127.0f ? -127.0f : (q > 127.0f ? 127.0f : q);
                    dst[k - k0] = (int8_t)q;
                    sum += (int)q;
                }
            if (k1 - k0 < Q4_GROUP) memset(dst + (k1 - k0), 0, (size_t)(Q4_GROUP - (k1 - k0)));
            scales[m * groups + g] = scale;
            scaled_sums[m * groups + g] = (float)sum * scale;
        }
    }
}

/* The same for 8 of the 16 rows (`half`), as the AVX2 code takes them. */
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

/* Group g of one block (W) for T tokens into their totals (TOTAL, an array of the caller's): the unpacking, the
   group's steps (SUPER_D, SUPER_DMIN: the superblock's, layout 1), and per token 8 vpdpbusd and the float steps
   (q4_add_group_vnni). A macro: the totals stay in registers. */
#define Q4_VNNI_GROUP(W, TOTAL, SUPER_D, SUPER_DMIN, T)                                                       \
    do {                                                                                                      \
        const uint8_t *p = q4_group(W, layout, g);                                                            \
        q4_prefetch_ahead(W, layout, g);                                                                      \
        __m512i v[8];                                                                                         \
        q4_values_vnni(p, v);                                                                                 \
        __m512 d, mins;                                                                                       \
        if (layout && (g == g_begin || (g & 7) == 0)) q4_super_vnni(W, g, &SUPER_D, &SUPER_DMIN);             \
        q4_steps_vnni(W, layout, g, p, SUPER_D, SUPER_DMIN, &d, &mins);                                       \
        for (int j = 0; j < T; j++) {                                                                         \
            const int32_t *x = tokens + j * steps + g * 8;                                                    \
            __m512i a = _mm512_dpbusd_epi32(_mm512_setzero_si512(), v[0], _mm512_set1_epi32(x[0]));           \
            __m512i b = _mm512_dpbusd_epi32(_mm512_setzero_si512(), v[4], _mm512_set1_epi32(x[4]));           \
            a = _mm512_dpbusd_epi32(a, v[1], _mm512_set1_epi32(x[1]));                                        \
            b = _mm512_dpbusd_epi32(b, v[5], _mm512_set1_epi32(x[5]));                                        \
            a = _mm512_dpbusd_epi32(a, v[2], _mm512_set1_epi32(x[2]));                                        \
            b = _mm512_dpbusd_epi32(b, v[6], _mm512_set1_epi32(x[6]));                                        \
            a = _mm512_dpbusd_epi32(a, v[3], _mm512_set1_epi32(x[3]));                                        \
            b = _mm512_dpbusd_epi32(b, v[7], _mm512_set1_epi32(x[7]));                                        \
            TOTAL[j] = q4_add_group_vnni(TOTAL[j], _mm512_add_epi32(a, b), d, mins, scales[j * groups + g],   \
                                         scaled_sums[j * groups + g]);                                        \
        }                                                                                                     \
    } while (0)

/* One block of 16 rows (w), groups [g_begin, g_end), up to Q4_TILE tokens; `sums` (Q4_TILE, 16) float is
   added to when `accumulate`, else started from 0; with `out` (the block's last groups) the sums go to y instead.
   tokens: the tile's first token's values as int32 (4 int8 each), `steps` of them a token (8 a group); scales,
   scaled_sums: the tile's first token's, `groups` a token. Read where specdec_q8_groups wrote them: a token's 4
   channels are one broadcast either way. Copying them into a panel of the tile's tokens side by side first, and the
   barrier after it, cost every call: against it, the demo target's layer shapes (synthetic weights, interleaved)
   take 8 tokens 68.7 → 56.5 ms, 4 tokens 35.6 → 31.0 ms, 200 tokens the same within 3%.
   With `next` (and `next_out`), a second block's groups alternate with w's, each into totals of its own, so each
   block's sums are what they are alone: two weight streams in flight instead of one (see specdec_q4_gemm). */
__attribute__((target("avx512f,avx512bw,avx512vnni,f16c,fma")))
static void q4_block_vnni(const uint8_t *w, int layout, const int32_t *tokens, const float *scales,
                          const float *scaled_sums, int64_t steps, int64_t groups, int64_t g_begin, int64_t g_end,
                          int64_t m_count, float *sums, int accumulate, const Q4Out *out, const uint8_t *next,
                          const Q4Out *next_out) {
    __m512 total[Q4_TILE], total_next[Q4_TILE];
    for (int j = 0; j < Q4_TILE; j++) {
        total[j] = accumulate && j < m_count ? _mm512_loadu_ps(sums + j * Q4_ROWS) : _mm512_setzero_ps();
        total_next[j] = _mm512_setzero_ps();
    }
    __m512 super_d = _mm512_setzero_ps(), super_dmin = _mm512_setzero_ps();
    __m512 next_d = _mm512_setzero_ps(), next_dmin = _mm512_setzero_ps();
#define Q4_VNNI_CASE(T)                                                                                       \
    case T:                                                                                                   \
        if (next)                                                                                             \
            for (int64_t g = g_begin; g < g_end; g++) {                                                       \
                Q4_VNNI_GROUP(w, total, super_d, super_dmin, T);                                              \
                Q4_VNNI_GROUP(next, total_next, next_d, next_dmin, T);                                        \
            }                                                                                                 \
        else                                                                                                  \
            for (int64_t g = g_begin; g < g_end; g++) Q4_VNNI_GROUP(w, total, super_d, super_dmin, T);        \
        break;
    switch (m_count) {
        Q4_VNNI_CASE(1) Q4_VNNI_CASE(2) Q4_VNNI_CASE(3) Q4_VNNI_CASE(4)
        Q4_VNNI_CASE(5) Q4_VNNI_CASE(6) Q4_VNNI_CASE(7) Q4_VNNI_CASE(8)
    }
#undef Q4_VNNI_CASE
#undef Q4_VNNI_GROUP
    q4_finish_vnni(total, m_count, sums, out);
    if (next) q4_finish_vnni(total_next, m_count, NULL, next_out);
}

/* The same on AVX2 for 8 of the 16 rows (`half` 0 or 1) and up to 4 tokens: uint8 × int8 pairs summed in
   int16 (vpmaddubsw: 2·15·127 cannot saturate, so activations keep 8 bits), the group's 8 chunks too, then in
   int32 (one vpmaddwd a group and token where each chunk took one: 16 integer ops against 23). */
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

/* The same on AVX2 for 8 of the 16 rows (`half` 0 or 1) and up to 4 tokens: uint8 × int8 pairs summed in
   int16 (vpmaddubsw: 2·15·127 cannot saturate, so activations keep 8 bits), the group's 8 chunks too, then in
   int32 (one vpmaddwd a group and token where each chunk took one: 16 integer ops against 23). With `next` (and
   `next_out`), a second block's half alternates with w's, as in q4_block_vnni. */
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
#define Q4_AVX2_CASE(T)                                                                                       \
    case T:                                                                                                   \
        if (next)                                                                                             \
            for (int64_t g = g_begin; g < g_end; g++) {                                                       \
                Q4_AVX2_GROUP(w, total, super_d, super_dmin, T);                                              \
                Q4_AVX2_GROUP(next, total_next, next_d, next_dmin, T);                                        \
            }                                                                                                 \
        else                                                                                                  \
            for (int64_t g = g_begin; g < g_end; g++) Q4_AVX2_GROUP(w, total, super_d, super_dmin, T);        \
        break;
    switch (m_count) {
        Q4_AVX2_CASE(1) Q4_AVX2_CASE(2) Q4_AVX2_CASE(3) Q4_AVX2_CASE(4)
    }
#undef Q4_AVX2_CASE
#undef Q4_PAIRS
#undef Q4_AVX2_GROUP
    q4_finish_avx2(total, half, m_count, sums, out);
    if (next) q4_finish_avx2(total_next, half, m_count, NULL, next_out);
}

/* A block (and `next`, as q4_block_vnni takes it) on AVX2: each tile of Q4_AVX2_TILE tokens, each half of the rows. */
static void q4_block_avx2(const uint8_t *w, int layout, const int32_t *tokens, const float *scales,
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

/* y (M, N) float32 = x · Wᵀ (+ bias) with x given as specdec_q8_groups made it (values (M, groups*32),
   scales and scaled sums (M, groups)) and W packed (ceil(N/16) blocks of groups × 320 bytes; layout 1:
   groups / 8 × 2368). isa: 3 AMX from Q4_AMX_TOKENS tokens (q4_amx.c: tiles of Q4_AMX_TILE, the same bits) and
   VNNI below, 2 VNNI, 1 AVX2; threads: OpenMP threads over the blocks.

   Up to a tile of tokens (Q4_TILE; AVX2: Q4_AVX2_TILE): one pass over each block's weights, straight from memory,
   two blocks at a time, their groups alternating, so that two streams of weights are in flight where one was (each
   block's sums are taken as alone: the same bits). With one, a forward of a few tokens waited on memory and on its
   arithmetic in turn rather than at once. Pairs, interleaved against single blocks on the demo pair (Intel Xeon AMX,
   scripts/kernel_ab.py, the same logits; benchmarks/2026-12-06-kernel-ab-q4-paired-blocks-intel-amx.json): target
   decoder 1 / 2 / 4 / 8 tokens 35.3 / 38.2 / 45.0 / 57.6 -> 33.3 / 35.4 / 41.3 / 56.6 ms, draft decoder 11.8 -> 11.2
   ms a token; four blocks at a time was no better than two. The AVX2 code on the same CPU (--avx2,
   ...-paired-blocks-avx2-code-intel-amx.json): target decoder 1 / 2 / 4 tokens 40.0 / 48.3 / 64.6 -> 39.1 / 46.1 /
   59.0 ms, draft 11.6 -> 11.4 ms (not timed on an AVX2-only CPU). On the AMD EPYC AVX512 the same pairs are slower
   (kernel_ab.py --pairs, benchmarks/2026-12-06-kernel-ab-q4-pairs-amd-avx512.json): target decoder 1 / 2 / 4 / 8
   tokens 23.3 / 20.9 / 27.5 / 47.4 -> 23.9 / 26.5 / 36.1 / 63.5 ms; whole generations (...-pairs-generate-...)
   target alone 26.9 -> 25.6 tok/s, cascade 30.7 -> 28.2; the AVX2 code's 1 token 24.7 -> 32.6 ms (against the
   revision before pairs, ...-paired-blocks-avx2-code-amd-avx512.json). So pairs are a choice per machine: off
   until specdec_q4_pair_up_to says up to how many tokens to take them (`specdec calibrate` times both, stores it).

   More tokens: Q4_CHUNK groups at a time, so a block's chunk stays in L1 while every tile of tokens passes over it;
   each sum still takes its groups in order, so the result is the same. A block's last groups store their sums (+
   bias) straight into y from the registers: copying them there from a buffer, a memcpy of 16 floats per token and
   block, cost (demo pair, interleaved, AMD EPYC AVX512, scripts/kernel_ab.py) draft 10.9 / target 32.7 ms a token
   against 10.1 / 31.9, a 150-token forward of the target 1090 against 1046 ms. Returns 0, or 1 when its buffers
   could not be allocated (y is then unwritten). */
static int64_t q4_paired_up_to = 0; /* forwards of up to this many tokens take blocks two at a time; 0: never */

/* Pairs for forwards of up to `tokens` tokens from now on (0: never; capped at a tile). The same bits either way. */
void specdec_q4_pair_up_to(int tokens) { q4_paired_up_to = tokens > 0 ? tokens : 0; }
int specdec_q4_pairs(void) { return (int)q4_paired_up_to; }

int specdec_q4_gemm(int isa, int layout, int threads, const int8_t *values, const float *scales,
                    const float *scaled_sums, int64_t M, int64_t groups, const uint8_t *w_packed, const float *bias,
                    int64_t N, float *y) {
    int amx = isa == 3 && M >= Q4_AMX_TOKENS;
    int64_t tile = amx ? Q4_AMX_TILE : Q4_TILE; /* tokens a pass */
    int64_t blocks = (N + Q4_ROWS - 1) / Q4_ROWS;
    int64_t tiles = (M + tile - 1) / tile;
    int64_t chunk = M <= tile ? groups : Q4_CHUNK;
    int64_t steps = groups * 8; /* 4-channel steps per token */
    int64_t block_bytes = layout ? groups / 8 * Q4K_SUPER_BYTES : groups * Q4_GROUP_BYTES;
    const int32_t *tokens = (const int32_t *)values;
    /* Up to a tile of tokens (VNNI below AMX's, AVX2 a tile of its own) and q4_paired_up_to: blocks two at a time */
    int paired = M <= q4_paired_up_to && (isa >= 2 ? !amx && M <= Q4_TILE : M <= Q4_AVX2_TILE);
    int64_t units = paired ? (blocks + 1) / 2 : blocks;
    /* More tokens than a tile: each thread's sums of every tile over the groups so far (none needed else) */
    size_t per_thread = M <= tile ? 0 : (size_t)(tiles * tile * Q4_ROWS);
    float *sums_all = per_thread ? malloc((size_t)threads * per_thread * sizeof(float)) : NULL;
    if (per_thread && !sums_all) return 1;
#pragma omp parallel num_threads(threads)
    {
        float *sums = per_thread ? sums_all + (size_t)omp_get_thread_num() * per_thread : NULL;
        uint8_t unpacked[Q4_AMX_BATCH * 512] __attribute__((aligned(64))); /* AMX's scratch (12 KB, unread by VNNI) */
        int32_t exact[Q4_AMX_BATCH * Q4_AMX_TILE * 16] __attribute__((aligned(64)));
        int64_t configured = 0; /* the tile rows this thread's AMX tiles have: none yet */
        /* guided, not static halves: a block is one thread's whole work either way (the same bits), but when the VM
           slows one core the other takes more blocks instead of waiting at the end. Interleaved against static (demo
           pair, AMD EPYC AVX512, scripts/kernel_ab.py): a noisy moment, draft 12.0 -> 10.8 ms a token, target 33.4 ->
           31.1, 150 tokens 1105 -> 1069; a quiet one, draft the same, target 26.8 / 36.2 -> 26.1 / 34.2 (1 / 4) */
#pragma omp for schedule(guided)
        for (int64_t unit = 0; unit < units; unit++) {
            int64_t b = paired ? 2 * unit : unit;
            const uint8_t *w = w_packed + b * block_bytes;
            int64_t first = b * Q4_ROWS, lanes = N - first < Q4_ROWS ? N - first : Q4_ROWS;
            /* paired: one tile and one pass over all groups (below), this block and the next together */
            const uint8_t *next = paired && b + 1 < blocks ? w + block_bytes : NULL;
            int64_t next_lanes = N - first - Q4_ROWS < Q4_ROWS ? N - first - Q4_ROWS : Q4_ROWS;
            for (int64_t g0 = 0; g0 < groups; g0 += chunk) {
                int64_t g1 = g0 + chunk < groups ? g0 + chunk : groups;
                for (int64_t t = 0; t < tiles; t++) {
                    int64_t m_count = M - t * tile < tile ? M - t * tile : tile;
                    const int32_t *tile_tokens = tokens + t * tile * steps;
                    const float *tile_scales = scales + t * tile * groups;
                    const float *tile_sums = scaled_sums + t * tile * groups;
                    float *tile_out = sums ? sums + t * tile * Q4_ROWS : NULL;
                    Q4Out out = {y + t * tile * N + first, N, bias ? bias + first : NULL, lanes};
                    Q4Out next_out = {out.y + Q4_ROWS, N, bias ? bias + first + Q4_ROWS : NULL, next_lanes};
                    const Q4Out *last = g1 == groups ? &out : NULL; /* the sums' last groups: straight into y */
                    if (amx && m_count >= Q4_AMX_TOKENS) { /* a last tile of fewer (at most 8): VNNI's */
                        if (m_count != configured) specdec_amx_configure(configured = m_count);
                        specdec_q4_block_amx(w, layout, (const int8_t *)tile_tokens, tile_scales, tile_sums, groups,
                                             g0, g1, m_count, tile_out, g0 > 0, last, unpacked, exact);
                    } else if (isa >= 2)
                        q4_block_vnni(w, layout, tile_tokens, tile_scales, tile_sums, steps, groups, g0, g1, m_count,
                                      tile_out, g0 > 0, last, next, &next_out);
                    else
                        q4_block_avx2(w, layout, tile_tokens, tile_scales, tile_sums, steps, groups, g0, g1, m_count,
                                      tile_out, g0 > 0, last, next, &next_out);
                }
            }
        }
        if (configured) specdec_amx_release();
    }
    free(sums_all);
    return 0;
}

/* The whole layer in one call (one crossing from Python instead of two): x (M, K) float32 quantised per
   token and group, then the matmul (layout 0 or 1: see the top; layout 1 needs groups a multiple of 8). isa 4 (a
   prompt read, on a CPU with AMX-BF16) takes q4_amx.c's bfloat16 matmul instead, at any number of tokens: a row's
   result is then the same whatever the call holds, so a prompt's rest read after a kept prefix (even a few tokens)
   gives what reading the whole prompt gives. The caller (models/prefill.py) sends it only prompts of AMX_MIN_TOKENS
   tokens or more, and such rests. Returns 0, or 1 when a buffer could not be allocated. */
int specdec_q4_linear(int isa, int layout, int threads, const float *x, int64_t M, int64_t K, int64_t groups,
                      const uint8_t *w_packed, const float *bias, int64_t N, float *y) {
    if (isa == 4) /* a prompt read's (q4_amx.c) */
        return specdec_q4_linear_bf16(layout, threads, x, M, K, groups, w_packed, bias, N, y);
    int8_t *values = malloc((size_t)(M * groups * Q4_GROUP));
    float *scales = malloc((size_t)(M * groups) * 2 * sizeof(float));
    int failed = 1;
    if (values && scales) {
        specdec_q8_groups(threads, x, M, K, groups, values, scales, scales + M * groups);
        failed = specdec_q4_gemm(isa, layout, threads, values, scales, scales + M * groups, M, groups, w_packed, bias,
                                 N, y);
    }
    free(values);
    free(scales);
    return failed;
}

/* q4.py's quantize_weight and pack in one pass, bit for bit (tested): W (N, K), float32 (dtype 0) or bfloat16
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
