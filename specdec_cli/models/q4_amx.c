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
   sums leave the tiles (a tile store, ~5 ns even for 2 rows) and pass through the float steps above, per token.
   Those costs do not shrink with the tokens, and below 9 tokens the VNNI code is as fast or faster (demo target's
   decoder, Intel Xeon AMX, AMX at every token count: 2 tokens 51.7 ms against VNNI's 41.3, 8 tokens 67.5 against
   61.7, 16 tokens 88.9 against 101.9; benchmarks/2026-12-05-kernel-ab-amx-int8-q4-not-kept-intel.json). Tiles
   that kept their sums across groups would need one scale for many groups: the int8 format's per-row scales, not
   q4's.

   AMX needs the kernel's leave (arch_prctl, once a process: specdec_amx_ready) and a tile configuration in each
   thread that uses the tiles (loaded at each call, since torch's oneDNN loads its own; released at its end).

   A compiler or assembler without AMX (gcc before 11, binutils before 2.36) fails on this file; int8_kernel.py then
   builds the library again with SPECDEC_NO_AMX, where this file only says that AMX is not there. */

#ifndef SPECDEC_NO_AMX

#include <cpuid.h>
#include <immintrin.h>
#include <stdint.h>
#include <string.h>
#include <sys/syscall.h>
#include <unistd.h>

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
   vector loads of a tile just stored): one group at a time took twice as long (2 tokens, the demo target's layer
   shapes). Two tile sets alternate (C 0 and 3, A 1 and 4, B 2 and 5) so that one group's sums need not wait for
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

#else /* SPECDEC_NO_AMX: never called, since isa 3 needs specdec_amx_ready */

#include "q4_layout.h"

int specdec_amx_ready(void) { return 0; }
void specdec_amx_configure(int64_t tokens) { (void)tokens; }
void specdec_amx_release(void) {}
void specdec_q4_block_amx(const uint8_t *w, int layout, const int8_t *values, const float *scales,
                          const float *scaled_sums, int64_t groups, int64_t g_begin, int64_t g_end, int64_t m_count,
                          float *sums, int accumulate, const Q4Out *out, uint8_t *unpacked, int32_t *exact) {
    (void)w, (void)layout, (void)values, (void)scales, (void)scaled_sums, (void)groups, (void)g_begin, (void)g_end;
    (void)m_count, (void)sums, (void)accumulate, (void)out, (void)unpacked, (void)exact;
}

#endif
