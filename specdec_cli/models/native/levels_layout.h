/* The levels matmul's packed layout and its form (the top of levels_gemm.c says both), shared by its VNNI code and
   loop (levels_gemm.c) and its AVX2 code (levels_avx2.c). */

#ifndef SPECDEC_LEVELS_LAYOUT_H
#define SPECDEC_LEVELS_LAYOUT_H

#include <immintrin.h>
#include <stdint.h>

#include "q4_layout.h"

#define LV_ROWS Q4_ROWS   /* output rows per block: q4's, whose finish (q4_finish_vnni) stores them */
#define LV_GROUP 32       /* input channels per activation scale (specdec_q8_groups) */
#define LV_VALUE_BYTES 512 /* a group's levels: 8 chunks of 64 bytes, 16 rows × 4 channels each */
#define LV_TILE 8         /* tokens held in registers at once (AVX512) */
#define LV_AVX2_TILE 4    /* tokens held in registers at once on AVX2 */
#define LV_CHUNK 16       /* groups per pass when there are more tokens than a tile: 8-12 KB of a block, in L1 */
#define LV_AHEAD 16384    /* bytes to prefetch ahead, into L2, as q4 does (q4_layout.h's Q4_AHEAD) */

/* A layer's form, one int: bit 0 two halves (a step, and a minimum where there are minimums, per 16 channels; else
   per 32), bit 1 minimums stored, bit 2 levels above 127 (the AVX2 code then multiplies another way), bits 3-4 the
   levels' bits above 4 where they are packed (1: 5-bit levels, 2: 6-bit; 0: a byte each), bits 5-6 how the steps
   are stored (LV_FLOAT32, LV_FLOAT16, LV_FACTORS), bits 8 on the offset o (0, or a power of two up to 128):
   w = step·(level − o) + minimum. */
enum { LV_FLOAT32 = 0, LV_FLOAT16 = 1, LV_FACTORS = 2 };
#define LV_SUPER 8 /* groups of a LV_FACTORS unit: a .gguf's K block of 256 channels */

typedef struct {
    int code, halves, mins, wide, high_bits, steps, offset;
    int64_t value_bytes; /* a block's group's levels: 512 bytes, or packed 256 + 64 · high_bits */
    int64_t unit_groups; /* groups of a unit: their levels, then the unit's table of steps (1, or LV_SUPER) */
    int unit_shift;      /* log2 of unit_groups: a group's unit and place in it without a division */
    int64_t unit_bytes;  /* a block's unit: levels, then the table (the top of levels_gemm.c) */
} LvForm;

static inline LvForm lv_form(int form) {
    LvForm f = {form, (form & 1) ? 2 : 1, (form >> 1) & 1, (form >> 2) & 1, (form >> 3) & 3, (form >> 5) & 3, form >> 8,
                0, 1, 0, 0};
    f.value_bytes = f.high_bits ? 256 + 64 * f.high_bits : LV_VALUE_BYTES;
    int64_t entries = f.halves * (1 + f.mins); /* steps and minimums per group, 16 rows each */
    if (f.steps == LV_FACTORS) {
        f.unit_groups = LV_SUPER;
        f.unit_shift = 3;
        f.unit_bytes = LV_SUPER * (f.value_bytes + 16 * entries) + 32 * (1 + f.mins);
    } else
        f.unit_bytes = f.value_bytes + 16 * entries * (f.steps == LV_FLOAT32 ? 4 : 2);
    return f;
}

/* The .gguf types' forms (formats/gguf_levels.py) and their usual fused mix, for which LV_BY_FORM compiles the code
   with every field of the form a constant: their branches and shift counts folded away. Any other form runs the same
   code, reading f. */
#define LV_Q8_0_FORM (4 | LV_FLOAT16 << 5 | 128 << 8)
#define LV_Q5_0_FORM (1 << 3 | LV_FLOAT16 << 5 | 16 << 8)
#define LV_Q6_K_FORM (1 | 2 << 3 | LV_FACTORS << 5 | 32 << 8)
#define LV_Q5_K_FORM (2 | 1 << 3 | LV_FACTORS << 5)
#define LV_K_MIX_FORM (1 | 2 | 2 << 3 | LV_FACTORS << 5) /* a fused Q4_K q and k beside a Q6_K v (levels.fused) */
#define LV_FORM_CASE(CODE, CALL) \
    case CODE:                   \
        CALL(lv_form(CODE));     \
        break;
#define LV_BY_FORM(f, CALL)                                                                   \
    switch ((f).code) {                                                                       \
        LV_FORM_CASE(LV_Q8_0_FORM, CALL) LV_FORM_CASE(LV_Q5_0_FORM, CALL)                     \
        LV_FORM_CASE(LV_Q6_K_FORM, CALL) LV_FORM_CASE(LV_Q5_K_FORM, CALL)                     \
        LV_FORM_CASE(LV_K_MIX_FORM, CALL) default: CALL(f);                                   \
    }

/* Where group g of a block (w) lies: its levels, and its unit's table. */
static inline const uint8_t *lv_group(const uint8_t *w, LvForm f, int64_t g) {
    return w + (g >> f.unit_shift) * f.unit_bytes + (g & (f.unit_groups - 1)) * f.value_bytes;
}

static inline const uint8_t *lv_table(const uint8_t *w, LvForm f, int64_t g) {
    return w + (g >> f.unit_shift) * f.unit_bytes + f.unit_groups * f.value_bytes;
}

/* The activations as a layer call quantised them (specdec_q8_groups), read per token j and group g: `values` as
   int32 (4 channels each, 8 a group), `scales` s, and for half h of the group (halves: 16 channels each; one: all
   32) `half_sums` s·Σa over it and `half_ints` Σa as an integer (the offset's −o·Σa joins the exact sum). */
typedef struct {
    const int32_t *values;
    const float *scales, *half_sums;
    const int32_t *half_ints;
    int64_t groups;
} LvTokens;

/* Where a block's last groups leave their sums: q4's (token j's `lanes` rows at y + j·stride, + bias[lane]), so the
   VNNI block hands its sums to q4's own finish (q4_finish_vnni). */
typedef Q4Out LvOut;

/* The lines LV_AHEAD bytes past group g of a block (w) into L2 (prefetcht1), a group's share of its unit. The
   builtin: GCC 12 drops _mm_prefetch's where the form is a constant (LV_BY_FORM). */
static inline void lv_prefetch_ahead(const uint8_t *w, LvForm f, int64_t g) {
    int64_t share = f.unit_bytes >> f.unit_shift;
    for (int64_t line = 0; line < share; line += 64) __builtin_prefetch(w + g * share + LV_AHEAD + line, 0, 2);
}

/* The AVX2 code of one block (levels_avx2.c), which levels_gemm.c's loop calls where isa is 1. */
void specdec_levels_block_avx2(const uint8_t *w, LvForm form, LvTokens x, int64_t g_begin, int64_t g_end,
                               int64_t m_count, float *sums, int accumulate, const LvOut *out);

#endif
