/* specdec's q4 matmul on AMX (Intel's tile instructions, Sapphire Rapids on): the VNNI code's numbers, bit for bit,
   for forwards of 9 tokens or more (q4_gemm.c's Q4_AMX_TOKENS; a last tile of fewer than 9 stays on VNNI).

   The VNNI code takes a group of 32 channels a token at a time: 8 vpdpbusd a token, so 16 tokens cost 16 times
   one. One AMX tdpbsud takes a group for up to 16 tokens and the block's 16 rows at once: the activations as they
   lie (a token's 32 int8 values of the group, `groups`·32 bytes apart: tile A, up to 16 rows), the weights' 4-bit
   values unpacked to bytes in the layout vpdpbusd already takes (channels 4t..4t+3 of the 16 rows in 64 bytes: tile
   B, 8 rows). Its int32 sums are the VNNI code's integers (exact: Σ q·a over 32 channels), and the float steps
   after them are the VNNI code's, in its order:
       sum = fma(float(Σ q·a), d·s, sum);  sum = fma(m, s·Σa, sum)
   so a verify on AMX gives each token what a one-token forward (VNNI) gives it, bit for bit (tested).

   Why only from 9 tokens: every group has its own scales (the weights' d, the activations' s), so each group's
   sums leave the tiles (a tile store, even for 2 rows) and pass through the float steps above, per token. Those
   costs do not shrink with the tokens, so below 9 tokens the VNNI code is as fast or faster. Tiles that kept their
   sums across groups would need one scale for many groups: the int8 format's per-row scales, not q4's.

   AMX needs the kernel's leave (arch_prctl, once a process: specdec_amx_ready) and a tile configuration in each
   thread that uses the tiles (loaded at each call, since torch's oneDNN loads its own; released at its end).

   A compiler or assembler without AMX (gcc before 11, binutils before 2.36) fails on this file; binding.py then
   builds the library again with SPECDEC_NO_AMX, where this file only says that AMX is not there. */

#ifndef SPECDEC_NO_AMX

#include <cpuid.h>
#include <immintrin.h>
#include <omp.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <sys/syscall.h>
#include <unistd.h>

#include "kernels.h"
#include "q4_layout.h"

/* gcc's _tile_loadconfig tells the compiler it reads 8 bytes of the configuration, and _tile_loadd that it reads
   no memory at all: without this, stores they depend on may be dropped or moved past them (the configuration's
   were dropped, and ldtilecfg faulted). A compiler barrier, no instruction. */
#define SPECDEC_MEMORY_BARRIER() __asm__ __volatile__("" ::: "memory")
#define ARCH_REQ_XCOMP_PERM 0x1023
#define XFEATURE_XTILEDATA 18

typedef struct {
    uint8_t palette, start_row, reserved[14];
    uint16_t bytes_per_row[16];
    uint8_t rows[16];
} TileConfig;

/* 1 where this CPU has AMX-INT8 and the kernel lets this process use the tiles, else 0. */
int specdec_amx_ready(void) {
    unsigned eax, ebx, ecx, edx;
    if (!__get_cpuid_count(7, 0, &eax, &ebx, &ecx, &edx)) return 0;
    if (!(edx & (1u << 24)) || !(edx & (1u << 25))) return 0; /* AMX-TILE, AMX-INT8 */
    return syscall(SYS_arch_prctl, ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA) == 0;
}

/* This thread's tiles for `tokens` tokens (1..Q4_AMX_TILE): 0 and 3 (sums: tokens × 16 int32), 1 and 4
   (activations: tokens × 32 bytes), 2 and 5 (weights: 8 × 64 bytes). */
__attribute__((target("amx-tile")))
void specdec_amx_configure(int64_t tokens) {
    TileConfig config;
    memset(&config, 0, sizeof config);
    config.palette = 1;
    for (int set = 0; set < 6; set += 3) {
        config.rows[set] = (uint8_t)tokens, config.bytes_per_row[set] = 64;
        config.rows[set + 1] = (uint8_t)tokens, config.bytes_per_row[set + 1] = Q4_GROUP;
        config.rows[set + 2] = 8, config.bytes_per_row[set + 2] = 64;
    }
    SPECDEC_MEMORY_BARRIER();
    _tile_loadconfig(&config);
}

/* This thread is done with the tiles. */
__attribute__((target("amx-tile")))
void specdec_amx_release(void) { _tile_release(); }

/* Group g's weights unpacked into `into` (512 bytes: tile B's rows), and the lines ahead prefetched. */
__attribute__((target("avx512f,avx512bw")))
static inline void amx_unpack(const uint8_t *w, int layout, int64_t g, uint8_t *into) {
    q4_prefetch_ahead(w, layout, g);
    __m512i v[8];
    q4_values_vnni(q4_group(w, layout, g), v);
    for (int t = 0; t < 8; t++) _mm512_store_si512((void *)(into + 64 * t), v[t]);
}

/* Group g's integer sums into `exact` (tokens × 16 int32) through tiles C (sums), A (activations), B (weights,
   from `unpacked`): tile numbers, so a macro. */
#define AMX_SUMS(C, A, B, g, unpacked, exact)                                                                 \
    do {                                                                                                      \
        SPECDEC_MEMORY_BARRIER();                                                                             \
        _tile_loadd(B, unpacked, 64);                                                                         \
        _tile_loadd(A, values + (g) * Q4_GROUP, groups * Q4_GROUP);                                           \
        _tile_zero(C);                                                                                        \
        _tile_dpbsud(C, A, B);                                                                                \
        _tile_stored(C, exact, 64);                                                                           \
    } while (0)

/* Group g's sums (`exact`) into the tokens' totals: the VNNI code's float steps (q4_add_group_vnni). */
__attribute__((target("avx512f,f16c,fma")))
static inline void amx_add(const uint8_t *w, int layout, int64_t g, int64_t g_begin, const int32_t *exact,
                           const float *scales, const float *scaled_sums, int64_t groups, int64_t m_count,
                           __m512 *super_d, __m512 *super_dmin, __m512 *total) {
    __m512 d, mins;
    if (layout && (g == g_begin || (g & 7) == 0)) q4_super_vnni(w, g, super_d, super_dmin);
    q4_steps_vnni(w, layout, g, q4_group(w, layout, g), *super_d, *super_dmin, &d, &mins);
    for (int j = 0; j < m_count; j++)
        total[j] = q4_add_group_vnni(total[j], _mm512_load_si512((const void *)(exact + j * 16)), d, mins,
                                     scales[j * groups + g], scaled_sums[j * groups + g]);
}

/* One block of 16 rows, groups [g_begin, g_end), up to Q4_AMX_TILE tokens (the configured tile rows): as
   q4_block_vnni, with `values` the tile's first token's int8 values (groups·32 a token). `unpacked`
   (Q4_AMX_BATCH × 512 bytes) and `exact` (Q4_AMX_BATCH × Q4_AMX_TILE × 16 int32) are the thread's, 64-byte
   aligned. Q4_AMX_BATCH groups at a time, each step over all of them before the next: unpack, tile sums, float
   steps. A buffer read back right after it was written waits for the store (a tile load of bytes just stored,
   vector loads of a tile just stored), which one group at a time would do at every group. Two tile sets alternate
   (C 0 and 3, A 1 and 4, B 2 and 5) so that one group's sums need not wait for
   the last group's store. */
__attribute__((target("amx-tile,amx-int8,avx512f,avx512bw,f16c,fma")))
void specdec_q4_block_amx(const uint8_t *w, int layout, const int8_t *values, const float *scales,
                          const float *scaled_sums, int64_t groups, int64_t g_begin, int64_t g_end, int64_t m_count,
                          float *sums, int accumulate, const Q4Out *out, uint8_t *unpacked, int32_t *exact) {
    __m512 total[Q4_AMX_TILE];
    for (int j = 0; j < m_count; j++)
        total[j] = accumulate ? _mm512_loadu_ps(sums + j * Q4_ROWS) : _mm512_setzero_ps();
    __m512 super_d = _mm512_setzero_ps(), super_dmin = _mm512_setzero_ps();
    for (int64_t g0 = g_begin; g0 < g_end; g0 += Q4_AMX_BATCH) {
        int64_t count = g_end - g0 < Q4_AMX_BATCH ? g_end - g0 : Q4_AMX_BATCH;
        for (int64_t i = 0; i < count; i++) amx_unpack(w, layout, g0 + i, unpacked + 512 * i);
        for (int64_t i = 0; i < count; i++) {
            if (i & 1)
                AMX_SUMS(3, 4, 5, g0 + i, unpacked + 512 * i, exact + Q4_AMX_TILE * 16 * i);
            else
                AMX_SUMS(0, 1, 2, g0 + i, unpacked + 512 * i, exact + Q4_AMX_TILE * 16 * i);
        }
        for (int64_t i = 0; i < count; i++)
            amx_add(w, layout, g0 + i, g_begin, exact + Q4_AMX_TILE * 16 * i, scales, scaled_sums, groups, m_count,
                    &super_d, &super_dmin, total);
    }
    q4_finish_vnni(total, m_count, sums, out);
}

/* The prompt's matmul in bfloat16 (isa 4: asked for by a prompt read, never by a verify; q4_gemm.c's
   specdec_q4_linear). Not the VNNI code's numbers: each weight is its exact
   value (the step and minimum of q4_steps_vnni, w = fma(q, d, min) in float32) rounded to bfloat16, each activation
   rounded to bfloat16, and AMX's tdpbf16ps sums their products in float32 over all the groups of a row. That is what
   makes it fast: no scale belongs to a group any more, so the sums stay in the tiles from the first group to the
   last (the int8 code above stores them and takes float steps per group and token), and the weights are unpacked
   once per block for every token of the call. A row's result depends on nothing but its own activations (the same
   groups, in the same order, whatever else the call holds, down to one row: tested), unlike the bfloat16 copy's
   oneDNN matmul (loading/prefill.py: `row_exact`).

   Per thread, two blocks at a time: their 16 rows each unpacked into bfloat16 (2 × `groups` KB in tile B's layout:
   channel pairs 2p, 2p+1 of the 16 rows in row p), then for every 32 tokens four tiles of sums over all groups, 0
   and 1 the two blocks' for the first 16 tokens, 2 and 3 for the next 16 (activations: tiles 4 and 5, 16 tokens ×
   32 channels each; weights: tiles 6 and 7), so that each tile load serves two products; then stored and moved
   into y (+ bias). One block at a time with four tiles of tokens was slower, and so was unpacking the next pair
   between this pair's products. */

/* 1 where the CPU has AMX-BF16 too and the tiles may be used (specdec_amx_ready), else 0. */
int specdec_amx_bf16_ready(void) {
    unsigned eax, ebx, ecx, edx;
    if (!__get_cpuid_count(7, 0, &eax, &ebx, &ecx, &edx) || !(edx & (1u << 22))) return 0; /* AMX-BF16 */
    return specdec_amx_ready();
}

/* Group g of a block (w) as tile B: 16 rows (channel pairs) × 16 lanes (the block's rows) × 2 bfloat16. */
__attribute__((target("avx512f,avx512bw,avx512bf16,f16c,fma")))
static inline void bf16_unpack(const uint8_t *w, int layout, int64_t g, __m512 *super_d, __m512 *super_dmin,
                               uint16_t *B) {
    const __m512i byte = _mm512_set1_epi32(0xFF);
    /* lane r of a pair's 32 words: row r's channel 2p (low word), then its channel 2p + 1 */
    const __m512i pairs = _mm512_set_epi16(31, 15, 30, 14, 29, 13, 28, 12, 27, 11, 26, 10, 25, 9, 24, 8, 23, 7, 22, 6,
                                           21, 5, 20, 4, 19, 3, 18, 2, 17, 1, 16, 0);
    const uint8_t *p = q4_group(w, layout, g);
    __m512 d, mins;
    if (layout && (g & 7) == 0) q4_super_vnni(w, g, super_d, super_dmin);
    q4_steps_vnni(w, layout, g, p, *super_d, *super_dmin, &d, &mins);
    q4_prefetch_ahead(w, layout, g);
    __m512i values[8];
    q4_values_vnni(p, values); /* values[i]: channels 4i..4i+3 of the 16 rows, a byte each */
    for (int i = 0; i < 8; i++) {
        __m512 c0 = _mm512_cvtepi32_ps(_mm512_and_si512(values[i], byte));
        __m512 c1 = _mm512_cvtepi32_ps(_mm512_and_si512(_mm512_srli_epi32(values[i], 8), byte));
        __m512 c2 = _mm512_cvtepi32_ps(_mm512_and_si512(_mm512_srli_epi32(values[i], 16), byte));
        __m512 c3 = _mm512_cvtepi32_ps(_mm512_srli_epi32(values[i], 24));
        __m512i low = (__m512i)_mm512_cvtne2ps_pbh(_mm512_fmadd_ps(c1, d, mins), _mm512_fmadd_ps(c0, d, mins));
        __m512i high = (__m512i)_mm512_cvtne2ps_pbh(_mm512_fmadd_ps(c3, d, mins), _mm512_fmadd_ps(c2, d, mins));
        _mm512_store_si512((void *)(B + 64 * i), _mm512_permutexvar_epi16(pairs, low));
        _mm512_store_si512((void *)(B + 64 * i + 32), _mm512_permutexvar_epi16(pairs, high));
    }
}

/* y (M, N) float32 = x (M, K) · Wᵀ (+ bias) as the top of this part says; W packed as for specdec_q4_gemm (layout
   0 or 1), `groups` groups of 32 channels a row. Returns 0, or 1 when its buffers could not be allocated. */
__attribute__((target("amx-tile,amx-bf16,avx512f,avx512bw,avx512bf16,f16c,fma")))
int specdec_q4_linear_bf16(int layout, int threads, const float *x, int64_t M, int64_t K, int64_t groups,
                           const uint8_t *w_packed, const float *bias, int64_t N, float *y) {
    int64_t width = groups * Q4_GROUP, padded = (M + 15) / 16 * 16;
    int64_t blocks = (N + Q4_ROWS - 1) / Q4_ROWS;
    int64_t block_bytes = layout ? groups / 8 * Q4K_SUPER_BYTES : groups * Q4_GROUP_BYTES;
    uint16_t *a = aligned_alloc(64, (size_t)(padded * width * 2 + 63) / 64 * 64); /* x in bfloat16, zero-padded */
    uint16_t *b = aligned_alloc(64, (size_t)threads * groups * 2048);         /* each thread's two unpacked blocks */
    if (!a || !b) {
        free(a);
        free(b);
        return 1;
    }
#pragma omp parallel for num_threads(threads) schedule(static)
    for (int64_t t = 0; t < padded; t++)
        for (int64_t k = 0; k < width; k += 16) { /* rows past M and channels past K: zeros */
            int64_t present = t < M ? (K - k < 16 ? (K - k > 0 ? K - k : 0) : 16) : 0;
            __m512 part = _mm512_maskz_loadu_ps((__mmask16)((1u << present) - 1u), x + t * K + k);
            _mm256_storeu_si256((__m256i *)(a + t * width + k), (__m256i)_mm512_cvtneps_pbh(part));
        }
#pragma omp parallel num_threads(threads)
    {
        uint16_t *unpacked = b + (size_t)omp_get_thread_num() * groups * 1024;
        float sums[4][16 * 16] __attribute__((aligned(64)));
        TileConfig config;
        memset(&config, 0, sizeof config);
        config.palette = 1;
        for (int tile = 0; tile < 8; tile++) config.rows[tile] = 16, config.bytes_per_row[tile] = 64;
        SPECDEC_MEMORY_BARRIER();
        _tile_loadconfig(&config);
#pragma omp for schedule(guided)
        for (int64_t unit = 0; unit < (blocks + 1) / 2; unit++) {
            int pair = 2 * unit + 1 < blocks; /* two blocks: their sums share each activation tile */
            for (int j = 0; j <= pair; j++) {
                const uint8_t *w = w_packed + (2 * unit + j) * block_bytes;
                __m512 super_d = _mm512_setzero_ps(), super_dmin = _mm512_setzero_ps();
                for (int64_t g = 0; g < groups; g++)
                    bf16_unpack(w, layout, g, &super_d, &super_dmin, unpacked + 512 * (j * groups + g));
            }
            for (int64_t t0 = 0; t0 < padded; t0 += 32) {
                int two = padded - t0 > 16; /* a second tile of tokens */
                const uint16_t *rows = a + t0 * width;
                _tile_zero(0);
                _tile_zero(1);
                _tile_zero(2);
                _tile_zero(3);
                SPECDEC_MEMORY_BARRIER();
                for (int64_t g = 0; g < groups; g++) {
                    _tile_loadd(4, rows + g * Q4_GROUP, width * 2);
                    _tile_loadd(6, unpacked + 512 * g, 64);
                    _tile_dpbf16ps(0, 4, 6);
                    if (pair) {
                        _tile_loadd(7, unpacked + 512 * (groups + g), 64);
                        _tile_dpbf16ps(1, 4, 7);
                    }
                    if (two) {
                        _tile_loadd(5, rows + 16 * width + g * Q4_GROUP, width * 2);
                        _tile_dpbf16ps(2, 5, 6);
                        if (pair) _tile_dpbf16ps(3, 5, 7);
                    }
                }
                _tile_stored(0, sums[0], 64);
                _tile_stored(1, sums[1], 64);
                _tile_stored(2, sums[2], 64);
                _tile_stored(3, sums[3], 64);
                SPECDEC_MEMORY_BARRIER();
                for (int j = 0; j <= pair; j++) {
                    int64_t first = (2 * unit + j) * Q4_ROWS, lanes = N - first < Q4_ROWS ? N - first : Q4_ROWS;
                    __mmask16 mask = (__mmask16)((1u << lanes) - 1u);
                    __m512 add = bias ? _mm512_maskz_loadu_ps(mask, bias + first) : _mm512_setzero_ps();
                    for (int64_t t = t0; t < t0 + 32 && t < M; t++)
                        _mm512_mask_storeu_ps(y + t * N + first, mask,
                                              _mm512_add_ps(_mm512_load_ps(sums[j + 2 * ((t - t0) / 16)] +
                                                                           16 * ((t - t0) % 16)), add));
                }
            }
        }
        _tile_release();
    }
    free(a);
    free(b);
    return 0;
}

#else /* SPECDEC_NO_AMX: never called, since isa 3 needs specdec_amx_ready */

#include "kernels.h"
#include "q4_layout.h"

int specdec_amx_ready(void) { return 0; }
void specdec_amx_configure(int64_t tokens) { (void)tokens; }
void specdec_amx_release(void) {}
int specdec_amx_bf16_ready(void) { return 0; }
int specdec_q4_linear_bf16(int layout, int threads, const float *x, int64_t M, int64_t K, int64_t groups,
                           const uint8_t *w_packed, const float *bias, int64_t N, float *y) {
    (void)layout, (void)threads, (void)x, (void)M, (void)K, (void)groups, (void)w_packed, (void)bias, (void)N, (void)y;
    return 1;
}
void specdec_q4_block_amx(const uint8_t *w, int layout, const int8_t *values, const float *scales,
                          const float *scaled_sums, int64_t groups, int64_t g_begin, int64_t g_end, int64_t m_count,
                          float *sums, int accumulate, const Q4Out *out, uint8_t *unpacked, int32_t *exact) {
    (void)w, (void)layout, (void)values, (void)scales, (void)scaled_sums, (void)groups, (void)g_begin, (void)g_end;
    (void)m_count, (void)sums, (void)accumulate, (void)out, (void)unpacked, (void)exact;
}

#endif
