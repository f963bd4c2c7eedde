/* specdec's q4 matmul: int4 weights × int8 activations, llama.cpp's Q4_1 × Q8_0 recipe, for few tokens.

   W: 4-bit values q in 0..15 with, per output row and group of 32 input channels, a scale d and a
   minimum m in float16 (w ≈ d·q + m). Packed in blocks of 16 rows; a block's group is 320 bytes:
   - 256 bytes of values: 4 chunks of 64, chunk t holding 16 rows × 4 channels (the layout one VNNI
     vpdpbusd takes), the low nibbles channels 4t..4t+3 of the group, the high ones 4(t+4)..4(t+4)+3;
   - 32 bytes of d (16 rows, float16), 32 bytes of m.
   x: quantised here per token and group of 32 channels: symmetric int8 a with a float scale s.

   Layout 1 (a .gguf's Q4_K blocks as they are, formats/gguf_q4.py): d·sc and −dmin·m instead of d and m, per
   superblock of 8 groups (256 channels) and block of 16 rows, 2368 bytes (37 cache lines):
   - 8 × 256 bytes: the groups' values as above (each 64-byte aligned: a load across two lines costs two);
   - 8 × 16 bytes: the groups' sc (0..63, one a row), then 8 × 16 bytes m;
   - 32 bytes: d of the 16 rows (float16), then 32 bytes dmin.
   The group's step d·sc and minimum −dmin·m are exact in float32 (11 and 6 significant bits), so the
   weights are the file's bit for bit, in 4.625 bits a weight against 5: fewer bytes to read.

   Per group:  Σ_k w·x ≈ d·s·Σ q·a + m·s·Σ a  — the integer sum Σ q·a is exact (uint8 × int8), and the
   float steps after it are the same for every token whatever the number of tokens in the call:
       sum = fma(float(Σ q·a), d·s, sum);  sum = fma(m, s·Σa, sum)     (groups in order; then + bias)
   so a token's output never depends on its neighbours, and a k-token verify gives each token what a
   one-token forward gives it, bit for bit. The VNNI and the AVX2 code do the same float steps, so they
   agree bit for bit too (tested).

   Here: the activations' quantisation (specdec_q8_groups), the VNNI code of one block and the loop over blocks and
   tokens. The AVX2 code of one block is q4_avx2.c, the AMX code q4_amx.c, the load-time packing q4_pack.c. Built
   with the other kernels into one library by binding.py; called through ctypes. */

#include <immintrin.h>
#include <math.h>
#include <omp.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "kernels.h"
#include "q4_layout.h"

#define Q4_TILE 8       /* tokens held in registers at once (AVX512) */
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
   channels are one broadcast either way, and copying them side by side first (and the barrier after it) would cost
   every call.
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
    switch (m_count) {
        Q4_GROUPS_CASE(Q4_VNNI_GROUP, 1) Q4_GROUPS_CASE(Q4_VNNI_GROUP, 2) Q4_GROUPS_CASE(Q4_VNNI_GROUP, 3)
        Q4_GROUPS_CASE(Q4_VNNI_GROUP, 4) Q4_GROUPS_CASE(Q4_VNNI_GROUP, 5) Q4_GROUPS_CASE(Q4_VNNI_GROUP, 6)
        Q4_GROUPS_CASE(Q4_VNNI_GROUP, 7) Q4_GROUPS_CASE(Q4_VNNI_GROUP, 8)
    }
#undef Q4_VNNI_GROUP
    q4_finish_vnni(total, m_count, sums, out);
    if (next) q4_finish_vnni(total_next, m_count, NULL, next_out);
}

/* y (M, N) float32 = x · Wᵀ (+ bias) with x given as specdec_q8_groups made it (values (M, groups*32),
   scales and scaled sums (M, groups)) and W packed (ceil(N/16) blocks of groups × 320 bytes; layout 1:
   groups / 8 × 2368). isa: 3 AMX from Q4_AMX_TOKENS tokens (q4_amx.c: tiles of Q4_AMX_TILE, the same bits) and
   VNNI below, 2 VNNI, 1 AVX2; threads: OpenMP threads over the blocks.

   Up to a tile of tokens (Q4_TILE; AVX2: Q4_AVX2_TILE): one pass over each block's weights, straight from memory,
   two blocks at a time, their groups alternating, so that two streams of weights are in flight where one was (each
   block's sums are taken as alone: the same bits). With one, a forward of a few tokens waited on memory and on its
   arithmetic in turn rather than at once. Whether pairs are faster depends on the CPU (on some they are slower, and
   more than two at a time gained nothing where measured), so they are a choice per machine: off until
   specdec_q4_pair_up_to says up to how many tokens to take them (`specdec calibrate` times both, stores it).

   More tokens: Q4_CHUNK groups at a time, so a block's chunk stays in L1 while every tile of tokens passes over it;
   each sum still takes its groups in order, so the result is the same. A block's last groups store their sums (+
   bias) straight into y from the registers, not through a buffer (a copy of 16 floats per token and block, which
   showed in every forward). Returns 0, or 1 when its buffers could not be allocated (y is then unwritten). */
static int64_t q4_paired_up_to = 0; /* forwards of up to this many tokens take blocks two at a time; 0: never */

/* Pairs for forwards of up to `tokens` tokens from now on (0: never; capped at a tile). The same bits either way. */
void specdec_q4_pair_up_to(int tokens) { q4_paired_up_to = tokens > 0 ? tokens : 0; }
int specdec_q4_pairs(void) { return (int)q4_paired_up_to; }

static int specdec_q4_gemm(int isa, int layout, int threads, const int8_t *values, const float *scales,
                           const float *scaled_sums, int64_t M, int64_t groups, const uint8_t *w_packed,
                           const float *bias, int64_t N, float *y) {
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
           slows one core the other takes more blocks instead of waiting at the end. */
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
                        specdec_q4_block_avx2(w, layout, tile_tokens, tile_scales, tile_sums, steps, groups, g0, g1,
                                              m_count, tile_out, g0 > 0, last, next, &next_out);
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
   gives what reading the whole prompt gives. The caller (loading/prefill.py) sends it only prompts of AMX_MIN_TOKENS
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
