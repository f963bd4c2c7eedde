/* The q4 weights' packed layout (the top of q4_gemm.c says it) and what reads it, shared by the q4 matmul's code
   paths (q4_gemm.c: VNNI and the loop over blocks; q4_avx2.c; q4_amx.c) and the load-time packing (q4_pack.c). */

#ifndef SPECDEC_Q4_LAYOUT_H
#define SPECDEC_Q4_LAYOUT_H

#include <immintrin.h>
#include <stdint.h>

#define Q4_ROWS 16      /* output rows per block */
#define Q4_GROUP 32     /* input channels per scale */
#define Q4_GROUP_BYTES 320
#define Q4K_SUPER_BYTES 2368 /* layout 1: 8 groups' values, sc and m, and their rows' d and dmin */
#define Q4K_SC 2048          /* layout 1: where a superblock's sc lie (16 bytes a group); its m 128 bytes on */
#define Q4K_D 2304           /* and its rows' d (float16); their dmin 32 bytes on */
#define Q4_CHUNK 32     /* groups per pass when there are more tokens than a tile: 10 KB of a block, in L1 */
#define Q4_AHEAD 16384  /* bytes to prefetch ahead, into L2 (_MM_HINT_T1): the unpacking is compute the hardware
                           prefetcher does not hide. Into L1 (T0) the lines ahead fill L1's few miss buffers and the
                           loads wait on memory; a few KB to a few tens of KB ahead into L2 keeps the weights
                           streaming at memory speed, VNNI and AVX2 code alike */
#define Q4_AVX2_TILE 4  /* tokens held in registers at once on AVX2 (16 registers; AVX512: q4_gemm.c's Q4_TILE) */


/* Where a block's last groups leave their sums: token j's `lanes` rows (the block's rows below N) at y + j·stride,
   each + bias[lane] where there is a bias. */
typedef struct {
    float *y;
    int64_t stride;
    const float *bias;
    int64_t lanes;
} Q4Out;

/* Where group g of a block (w) lies: its 256 bytes of values first. */
static inline const uint8_t *q4_group(const uint8_t *w, int layout, int64_t g) {
    return layout ? w + (g >> 3) * Q4K_SUPER_BYTES + (g & 7) * 256 : w + g * Q4_GROUP_BYTES;
}

/* The lines Q4_AHEAD bytes past group g of a block (w) into L2: the unpacking is compute the hardware prefetcher
   does not hide. A layout-1 group is 2368 / 8 bytes on average. */
static inline void q4_prefetch_ahead(const uint8_t *w, int layout, int64_t g) {
    const uint8_t *ahead = w + g * (layout ? Q4K_SUPER_BYTES / 8 : Q4_GROUP_BYTES) + Q4_AHEAD;
    for (int line = 0; line < Q4_GROUP_BYTES; line += 64) _mm_prefetch((const char *)(ahead + line), _MM_HINT_T1);
}

/* Group g's 16 rows' step and minimum: layout 0 the float16 ones after the values; layout 1 d·sc and −dmin·m,
   each one exact float32 product (so the order of the steps after it is layout 0's), with d and dmin (`super_d`,
   `super_dmin`) converted once per superblock (q4_super_vnni: at its first group, or the call's). */
__attribute__((target("avx512f,f16c")))
static inline void q4_super_vnni(const uint8_t *w, int64_t g, __m512 *super_d, __m512 *super_dmin) {
    const uint8_t *super = w + (g >> 3) * Q4K_SUPER_BYTES;
    *super_d = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(super + Q4K_D)));
    *super_dmin = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(super + Q4K_D + 32)));
}

__attribute__((target("avx512f,f16c")))
static inline void q4_steps_vnni(const uint8_t *w, int layout, int64_t g, const uint8_t *p, __m512 super_d,
                                 __m512 super_dmin, __m512 *d, __m512 *mins) {
    if (!layout) {
        *d = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(p + 256)));
        *mins = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(p + 288)));
        return;
    }
    const uint8_t *sub = w + (g >> 3) * Q4K_SUPER_BYTES + Q4K_SC + (g & 7) * 16;
    __m512 sc = _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)sub)));
    __m512 m = _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)(sub + 128))));
    *d = _mm512_mul_ps(super_d, sc);
    __m512 scaled = _mm512_mul_ps(super_dmin, m);
    *mins = _mm512_castsi512_ps(_mm512_xor_si512(_mm512_castps_si512(scaled), _mm512_set1_epi32((int)0x80000000u)));
}

/* One token's group into its 16 rows' total: the group's exact integer sums, then the float steps every q4 code path
   takes in this order (the AVX2 code the same on 8 rows), so a token's output is the same whatever else is in the
   call: sum = fma(float(Σ q·a), d·s, sum); sum = fma(m, s·Σa, sum). */
__attribute__((target("avx512f,fma")))
static inline __m512 q4_add_group_vnni(__m512 total, __m512i exact, __m512 d, __m512 mins, float scale,
                                       float scaled_sum) {
    __m512 step = _mm512_mul_ps(d, _mm512_set1_ps(scale));
    total = _mm512_fmadd_ps(_mm512_cvtepi32_ps(exact), step, total);
    return _mm512_fmadd_ps(mins, _mm512_set1_ps(scaled_sum), total);
}

/* A block's sums of `m_count` tokens (`total`, 16 rows each) where they go: with `out` (the block's last groups)
   each token's rows straight into y, + bias (one add per element), else into `sums` for the next groups. */
__attribute__((target("avx512f")))
static inline void q4_finish_vnni(const __m512 *total, int64_t m_count, float *sums, const Q4Out *out) {
    if (out) {
        __mmask16 lanes = (__mmask16)((1u << out->lanes) - 1u);
        __m512 bias = out->bias ? _mm512_maskz_loadu_ps(lanes, out->bias) : _mm512_setzero_ps();
        for (int j = 0; j < m_count; j++)
            _mm512_mask_storeu_ps(out->y + j * out->stride, lanes,
                                  out->bias ? _mm512_add_ps(total[j], bias) : total[j]);
    } else
        for (int j = 0; j < m_count; j++) _mm512_storeu_ps(sums + j * Q4_ROWS, total[j]);
}

/* The loop over a block's groups [g_begin, g_end) for T tokens, as `case T:` of a switch on the token count (so T is
   a constant and the totals stay in registers): GROUP is the code path's macro for one group of one block. With
   `next`, a second block's groups alternate with w's, each into totals of its own (total_next, next_d, next_dmin),
   so each block's sums are what they are alone. */
#define Q4_GROUPS_CASE(GROUP, T)                                                                              \
    case T:                                                                                                   \
        if (next)                                                                                             \
            for (int64_t g = g_begin; g < g_end; g++) {                                                       \
                GROUP(w, total, super_d, super_dmin, T);                                                      \
                GROUP(next, total_next, next_d, next_dmin, T);                                                \
            }                                                                                                 \
        else                                                                                                  \
            for (int64_t g = g_begin; g < g_end; g++) GROUP(w, total, super_d, super_dmin, T);                \
        break;

/* Group g's 32 channels of the block's 16 rows as 8 × 64 bytes, channels 4t..4t+3 of the 16 rows in values[t]
   (0..15 each): the low nibbles of the group's 4 chunks, then their high nibbles. */
__attribute__((target("avx512f,avx512bw")))
static inline void q4_values_vnni(const uint8_t *p, __m512i values[8]) {
    const __m512i low = _mm512_set1_epi8(0x0F);
    for (int t = 0; t < 4; t++) {
        __m512i chunk = _mm512_loadu_si512((const void *)(p + 64 * t));
        values[t] = _mm512_and_si512(chunk, low);
        values[t + 4] = _mm512_and_si512(_mm512_srli_epi16(chunk, 4), low);
    }
}

/* The AVX2 code of one block (q4_avx2.c), which q4_gemm.c's loop calls where isa is 1. */
void specdec_q4_block_avx2(const uint8_t *w, int layout, const int32_t *tokens, const float *scales,
                           const float *scaled_sums, int64_t steps, int64_t groups, int64_t g_begin, int64_t g_end,
                           int64_t m_count, float *sums, int accumulate, const Q4Out *out, const uint8_t *next,
                           const Q4Out *next_out);

/* The AMX code (q4_amx.c), which q4_gemm.c's loop calls for a tile of 9 tokens or more where the CPU has AMX
   (specdec_amx_ready: kernels.h). */
#define Q4_AMX_TILE 16  /* a tile's rows: tokens per pass */
#define Q4_AMX_BATCH 8  /* groups a step takes before the next step */
void specdec_amx_configure(int64_t tokens);
void specdec_amx_release(void);
/* The prompt's matmul in bfloat16 on AMX (q4_amx.c; isa 4) */
int specdec_q4_linear_bf16(int layout, int threads, const float *x, int64_t M, int64_t K, int64_t groups,
                           const uint8_t *w_packed, const float *bias, int64_t N, float *y);
void specdec_q4_block_amx(const uint8_t *w, int layout, const int8_t *values, const float *scales,
                          const float *scaled_sums, int64_t groups, int64_t g_begin, int64_t g_end, int64_t m_count,
                          float *sums, int accumulate, const Q4Out *out, uint8_t *unpacked, int32_t *exact);

#endif
