/* specdec's int8 matmul for few tokens: y = (x_q · W_q) * weight_scale * token_scale (+ bias).

   W is int8, one scale per output row, packed in blocks of 32 rows: for every 4 input channels, the
   32 rows' 4 bytes lie side by side (128 bytes); 16 rows' worth is what one VNNI instruction
   (vpdpbusd) takes.
   x is quantised here, per token: symmetric int8 with one scale per row, stored offset by a zero point
   as uint8 (VNNI multiplies uint8 by int8); the offset is taken back out with the rows' weight sums.

   Every output element is computed by the same sequence of operations whatever the number of tokens
   in the call, and the integer part is exact, so a token's output never depends on its neighbours:
   a k-token verify gives each token what a one-token forward gives it, bit for bit.

   Few tokens (a decode step, a verify) read the weights once per block and use them for up to 8 tokens
   held in registers, so the cost is the weights' bytes, nearly flat in the token count.

   Also here: which instructions this CPU has (specdec_isa), and the int8 format's load-time quantisation and
   packing. Built with the other kernels into one library by binding.py with the system C compiler; no torch
   headers, called through ctypes. */

#include <immintrin.h>
#include <math.h>
#include <omp.h>
#include <stdlib.h>
#include <stdint.h>
#include <string.h>

#include "kernels.h"

#define BLOCK 32 /* output rows per block */
#define TILE 8   /* tokens held in registers at once */

/* Per-token symmetric quantisation of x (M, K) float32 into uint8 (M, K4*4, zero-padded past K),
   offset by zero_point = limit + 1. The same float operations as torch's
   scale = max(amax(|x|), 1e-12) / limit; q = clamp(round_half_even(x / scale), -limit, limit). */
static void specdec_quantize_rows(int threads, const float *x, int64_t M, int64_t K, int64_t K_padded, int limit,
                                  uint8_t *out, float *scales) {
#pragma omp parallel for num_threads(threads) schedule(static) if (M * K > 65536)
    for (int64_t m = 0; m < M; m++) {
        const float *row = x + m * K;
        float amax = 0.0f;
        for (int64_t k = 0; k < K; k++) {
            float a = fabsf(row[k]);
            amax = a > amax ? a : amax;
        }
        float scale = (amax > 1e-12f ? amax : 1e-12f) / (float)limit;
        scales[m] = scale;
        uint8_t *dst = out + m * K_padded;
        for (int64_t k = 0; k < K; k++) {
            float q = nearbyintf(row[k] / scale);
            q = q < -limit ? -limit : (q > limit ? limit : q);
            dst[k] = (uint8_t)((int)q + limit + 1);
        }
        memset(dst + K, limit + 1, (size_t)(K_padded - K)); /* padding: weights there are 0 */
    }
}

/* Scale back: (exact * weight scale) * token scale, rounded after each step as torch does it; with a
   bias, one fused multiply-add as torch's addcmul does it (bias + value * token scale, rounded once). */
__attribute__((target("fma")))
static void epilogue(const int32_t *acc, int64_t m_count, int64_t n0, int64_t N, const int32_t *row_sums,
                     int zero_point, const float *weight_scales, const float *token_scales, const float *bias,
                     float *y) {
    for (int64_t j = 0; j < m_count; j++) {
        for (int64_t lane = 0; lane < BLOCK && n0 + lane < N; lane++) {
            int64_t n = n0 + lane;
            int32_t exact = acc[j * BLOCK + lane] - zero_point * row_sums[n];
            float scaled = (float)exact * weight_scales[n];
            y[j * N + n] = bias ? fmaf(scaled, token_scales[j], bias[n]) : scaled * token_scales[j];
        }
    }
}

/* One block of 32 output rows, input groups [k_begin, k_end), up to TILE tokens; `acc` (TILE, 32) int32 is
   added to when `accumulate`, else overwritten. tokens: the first token's quantised activations as int32 (4
   uint8 each), K4 a token, read where the quantiser wrote them (a copy of a tile's tokens side by side, and the
   barrier after it, cost every call). Per 4 input channels: two 64-byte weight loads, one broadcast per token,
   two VNNI sums per token. */
__attribute__((target("avx512f,avx512bw,avx512vnni")))
static void block_vnni(const int8_t *w, const int32_t *tokens, int64_t K4, int64_t k_begin, int64_t k_end,
                       int64_t m_count, int32_t *acc, int accumulate) {
    __m512i lo[TILE], hi[TILE];
    for (int j = 0; j < TILE; j++) {
        lo[j] = accumulate && j < m_count ? _mm512_loadu_si512((const void *)(acc + j * BLOCK)) : _mm512_setzero_si512();
        hi[j] = accumulate && j < m_count ? _mm512_loadu_si512((const void *)(acc + j * BLOCK + 16)) : _mm512_setzero_si512();
    }
#define VNNI_CASE(T)                                                                        \
    case T:                                                                                 \
        for (int64_t k = k_begin; k < k_end; k++) {                                         \
            __m512i w_lo = _mm512_loadu_si512((const void *)(w + k * 128));                 \
            __m512i w_hi = _mm512_loadu_si512((const void *)(w + k * 128 + 64));            \
            for (int j = 0; j < T; j++) {                                                   \
                __m512i xv = _mm512_set1_epi32(tokens[j * K4 + k]);                         \
                lo[j] = _mm512_dpbusd_epi32(lo[j], xv, w_lo);                               \
                hi[j] = _mm512_dpbusd_epi32(hi[j], xv, w_hi);                               \
            }                                                                               \
        }                                                                                   \
        break;
    switch (m_count) {
        VNNI_CASE(1) VNNI_CASE(2) VNNI_CASE(3) VNNI_CASE(4)
        VNNI_CASE(5) VNNI_CASE(6) VNNI_CASE(7) VNNI_CASE(8)
    }
#undef VNNI_CASE
    for (int j = 0; j < m_count; j++) {
        _mm512_storeu_si512((void *)(acc + j * BLOCK), lo[j]);
        _mm512_storeu_si512((void *)(acc + j * BLOCK + 16), hi[j]);
    }
}

/* The same on AVX2, 16 of the 32 rows at a time and up to 4 tokens (16 registers): uint8·int8 pairs
   summed in int16 (vpmaddubsw), then in int32 (vpmaddwd with ones). The int16 pair sum cannot saturate
   only with 7-bit activations (uint8 in 1..127): the caller's limit is 63 there. */
#define AVX2_TILE 4
#define AVX2_AHEAD 16384 /* bytes prefetched ahead into L2: AVX2's pair sums take more instructions a byte than VNNI,
                            and without the prefetch the loads wait on memory. The VNNI loop reads memory as fast
                            without one (and slower with it), so it has none */
__attribute__((target("avx2,fma")))
static void half_avx2(const int8_t *w, const int32_t *tokens, int64_t K4, int64_t k_begin, int64_t k_end,
                      int64_t m_count, int32_t *acc, int accumulate) {
    __m256i lo[AVX2_TILE], hi[AVX2_TILE];
    const __m256i ones = _mm256_set1_epi16(1);
    for (int j = 0; j < AVX2_TILE; j++) {
        lo[j] = accumulate && j < m_count ? _mm256_loadu_si256((const __m256i *)(acc + j * BLOCK)) : _mm256_setzero_si256();
        hi[j] = accumulate && j < m_count ? _mm256_loadu_si256((const __m256i *)(acc + j * BLOCK + 8)) : _mm256_setzero_si256();
    }
#define AVX2_CASE(T)                                                                        \
    case T:                                                                                 \
        for (int64_t k = k_begin; k < k_end; k++) {                                         \
            _mm_prefetch((const char *)(w + k * 128 + AVX2_AHEAD), _MM_HINT_T1);            \
            _mm_prefetch((const char *)(w + k * 128 + AVX2_AHEAD + 64), _MM_HINT_T1);       \
            __m256i w_lo = _mm256_loadu_si256((const __m256i *)(w + k * 128));              \
            __m256i w_hi = _mm256_loadu_si256((const __m256i *)(w + k * 128 + 32));         \
            for (int j = 0; j < T; j++) {                                                   \
                __m256i xv = _mm256_set1_epi32(tokens[j * K4 + k]);                         \
                lo[j] = _mm256_add_epi32(lo[j], _mm256_madd_epi16(_mm256_maddubs_epi16(xv, w_lo), ones)); \
                hi[j] = _mm256_add_epi32(hi[j], _mm256_madd_epi16(_mm256_maddubs_epi16(xv, w_hi), ones)); \
            }                                                                               \
        }                                                                                   \
        break;
    switch (m_count) {
        AVX2_CASE(1) AVX2_CASE(2) AVX2_CASE(3) AVX2_CASE(4)
    }
#undef AVX2_CASE
    for (int j = 0; j < m_count; j++) {
        _mm256_storeu_si256((__m256i *)(acc + j * BLOCK), lo[j]);
        _mm256_storeu_si256((__m256i *)(acc + j * BLOCK + 8), hi[j]);
    }
}

static void block_avx2(const int8_t *w, const int32_t *tokens, int64_t K4, int64_t k_begin, int64_t k_end,
                       int64_t m_count, int32_t *acc, int accumulate) {
    for (int64_t m0 = 0; m0 < m_count; m0 += AVX2_TILE) {
        int64_t count = m_count - m0 < AVX2_TILE ? m_count - m0 : AVX2_TILE;
        half_avx2(w, tokens + m0 * K4, K4, k_begin, k_end, count, acc + m0 * BLOCK, accumulate);
        half_avx2(w + 64, tokens + m0 * K4, K4, k_begin, k_end, count, acc + m0 * BLOCK + 16, accumulate);
    }
}

/* Which instructions this CPU has: 3 = AVX512-VNNI and AMX-INT8 (the q4 matmul of several tokens takes AMX: q4_amx.c;
   everything else runs as on 2), 2 = AVX512-VNNI, 1 = AVX2, 0 = neither (the caller uses oneDNN). */
int specdec_isa(void) {
    __builtin_cpu_init();
    if (__builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
        __builtin_cpu_supports("avx512vnni"))
        return specdec_amx_ready() ? 3 : 2;
    if (__builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma")) return 1;
    return 0;
}

/* y (M, N) float32 = dequantised (x_q (M, K4*4) uint8) · (W packed (N/32 blocks)) (+ bias).
   isa: 2 or 3 VNNI, 1 AVX2; threads: OpenMP threads over the blocks of output rows.
   Up to TILE tokens: one pass over each block's weights, straight from memory (the cost is the bytes).
   More (a prefill, a batch): the input is cut into K_CHUNK groups, so a block's chunk of weights stays
   in L1 while every tile of tokens passes over it; integer sums, so the order changes nothing.
   Returns 0, or 1 when its buffers could not be allocated (y is then unwritten). */
#define K_CHUNK 128
static int specdec_int8_gemm(int isa, int threads, const uint8_t *x_q, const float *token_scales, int64_t M,
                             int64_t K4, const int8_t *w_packed, const int32_t *row_sums, const float *weight_scales,
                             const float *bias, int64_t N, int zero_point, float *y) {
    int64_t blocks = (N + BLOCK - 1) / BLOCK;
    int64_t tiles = (M + TILE - 1) / TILE;
    int64_t chunk = M <= TILE ? K4 : K_CHUNK;
    const int32_t *tokens = (const int32_t *)x_q;
    int32_t *acc_all = malloc((size_t)threads * (size_t)(tiles * TILE * BLOCK) * sizeof(int32_t));
    if (!acc_all) return 1;
#pragma omp parallel num_threads(threads)
    {
        int32_t *acc = acc_all + (size_t)omp_get_thread_num() * (size_t)(tiles * TILE * BLOCK);
        /* guided, as the q4 matmul: a block is one thread's whole work either way (the same bits); a core the VM
           slows hands blocks to the other */
#pragma omp for schedule(guided)
        for (int64_t b = 0; b < blocks; b++) {
            const int8_t *w = w_packed + b * K4 * 4 * BLOCK;
            for (int64_t k0 = 0; k0 < K4; k0 += chunk) {
                int64_t k1 = k0 + chunk < K4 ? k0 + chunk : K4;
                for (int64_t t = 0; t < tiles; t++) {
                    int64_t m_count = M - t * TILE < TILE ? M - t * TILE : TILE;
                    const int32_t *tile_tokens = tokens + t * TILE * K4;
                    if (isa >= 2)
                        block_vnni(w, tile_tokens, K4, k0, k1, m_count, acc + t * TILE * BLOCK, k0 > 0);
                    else
                        block_avx2(w, tile_tokens, K4, k0, k1, m_count, acc + t * TILE * BLOCK, k0 > 0);
                }
            }
            for (int64_t t = 0; t < tiles; t++) {
                int64_t m_count = M - t * TILE < TILE ? M - t * TILE : TILE;
                epilogue(acc + t * TILE * BLOCK, m_count, b * BLOCK, N, row_sums, zero_point, weight_scales,
                         token_scales + t * TILE, bias, y + t * TILE * N);
            }
        }
    }
    free(acc_all);
    return 0;
}

/* The whole layer in one call (one crossing from Python instead of two): x (M, K) float32 quantised per
   token to `limit` (127 or 63), then the matmul. Returns 0, or 1 when a buffer could not be allocated. */
int specdec_int8_linear(int isa, int threads, const float *x, int64_t M, int64_t K, int64_t K4, int limit,
                        const int8_t *w_packed, const int32_t *row_sums, const float *weight_scales,
                        const float *bias, int64_t N, float *y) {
    uint8_t *values = malloc((size_t)(M * K4 * 4));
    float *scales = malloc((size_t)M * sizeof(float));
    int failed = 1;
    if (values && scales) {
        specdec_quantize_rows(threads, x, M, K, K4 * 4, limit, values, scales);
        failed = specdec_int8_gemm(isa, threads, values, scales, M, K4, w_packed, row_sums, weight_scales, bias, N,
                                   limit + 1, y);
    }
    free(values);
    free(scales);
    return failed;
}

/* 8 weights of a float32 (dtype 0) or bfloat16 (dtype 1, the top half of a float32) row, as float32. */
__attribute__((target("avx2")))
static inline __m256 weights8(const void *row, int dtype, int64_t k) {
    if (dtype == 1) {
        __m256i wide = _mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i *)((const uint16_t *)row + k)));
        return _mm256_castsi256_ps(_mm256_slli_epi32(wide, 16));
    }
    return _mm256_loadu_ps((const float *)row + k);
}

static inline float weight1(const void *row, int dtype, int64_t k) {
    if (dtype == 1) {
        uint32_t bits = (uint32_t)((const uint16_t *)row)[k] << 16;
        float value;
        memcpy(&value, &bits, sizeof value);
        return value;
    }
    return ((const float *)row)[k];
}

/* formats/int8.py's quantize_weight in one pass, bit for bit (tested): W (N, K), float32 (dtype 0) or bfloat16 (dtype 1),
   rows `stride` elements apart, to values (N, K) int8 and scales (N,) float: per row
   scale = max(max |w|, 1e-12) / 127 and value = clamp(round-half-even(w / scale), -127, 127), the IEEE steps
   torch takes there, 8 channels at a time (the max is exact in any order). Needs AVX2, as the kernel does. */
__attribute__((target("avx2")))
void specdec_int8_quantize(int threads, const void *weight, int dtype, int64_t N, int64_t K, int64_t stride,
                           int8_t *values, float *scales) {
    size_t width = dtype == 1 ? 2 : 4;
#pragma omp parallel for num_threads(threads) schedule(static)
    for (int64_t n = 0; n < N; n++) {
        const void *row = (const char *)weight + (size_t)(n * stride) * width;
        const __m256 sign = _mm256_set1_ps(-0.0f);
        __m256 largest8 = _mm256_setzero_ps();
        int64_t k = 0;
        for (; k + 8 <= K; k += 8) largest8 = _mm256_max_ps(largest8, _mm256_andnot_ps(sign, weights8(row, dtype, k)));
        float lanes[8], largest = 0.0f;
        _mm256_storeu_ps(lanes, largest8);
        for (int j = 0; j < 8; j++) largest = lanes[j] > largest ? lanes[j] : largest;
        for (; k < K; k++) {
            float magnitude = fabsf(weight1(row, dtype, k));
            largest = magnitude > largest ? magnitude : largest;
        }
        float scale = (largest > 1e-12f ? largest : 1e-12f) / 127.0f;
        scales[n] = scale;
        int8_t *out = values + n * K;
        const __m256 scale8 = _mm256_set1_ps(scale), low = _mm256_set1_ps(-127.0f), high = _mm256_set1_ps(127.0f);
        for (k = 0; k + 8 <= K; k += 8) {
            __m256 level = _mm256_round_ps(_mm256_div_ps(weights8(row, dtype, k), scale8),
                                           _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
            __m256i whole = _mm256_cvtps_epi32(_mm256_min_ps(_mm256_max_ps(level, low), high));
            __m128i half = _mm_packs_epi32(_mm256_castsi256_si128(whole), _mm256_extracti128_si256(whole, 1));
            _mm_storel_epi64((__m128i *)(out + k), _mm_packs_epi16(half, half));
        }
        for (; k < K; k++) {
            float level = nearbyintf(weight1(row, dtype, k) / scale);
            out[k] = (int8_t)(level < -127.0f ? -127.0f : level > 127.0f ? 127.0f : level);
        }
    }
}

/* binding.py's pack_in_torch, bit for bit (tested): values (N, K) int8 into `blocks` (ceil(N/32), ceil(K/4), 32, 4),
   which the caller zeroed (the padding stays 0), and each row's sum into row_sums (N,) int32. */
void specdec_int8_pack(int threads, const int8_t *values, int64_t N, int64_t K, int8_t *blocks, int32_t *row_sums) {
    int64_t steps = (K + 3) / 4;
#pragma omp parallel for num_threads(threads) schedule(static)
    for (int64_t n = 0; n < N; n++) {
        const int8_t *row = values + n * K;
        int8_t *base = blocks + (n / BLOCK) * steps * BLOCK * 4 + (n % BLOCK) * 4;
        int32_t sum = 0;
        for (int64_t k = 0; k < K; k++) {
            base[(k / 4) * BLOCK * 4 + k % 4] = row[k];
            sum += row[k];
        }
        row_sums[n] = sum;
    }
}
