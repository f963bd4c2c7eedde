/* Attention for a batch of one, row by row, with the same float steps whatever the number of rows (specdec_attention:
   the rows of a verify or a tree get what a one-token forward gets, bit for bit); what lean_layers.py, attention.py
   and the decoder stack (layer_kernels.c) call. AVX2 code. */

#include <immintrin.h>
#include <math.h>
#include <omp.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "kernels.h"
#include "vector_math.h"

/* q·k for 8 keys at once: each key's 8 lanes summed over d in order, then the lanes by one fixed tree (the
   same for every slot), then the tail of d past a multiple of 8. So a key's score is the same whichever slot
   it takes and whatever keys share its block. */
__attribute__((target("avx2,fma")))
static void dot8_avx2(const float *query, const float *const keys[8], int64_t dim, float *scores) {
    __m256 acc[8];
    for (int i = 0; i < 8; i++) acc[i] = _mm256_setzero_ps();
    int64_t d = 0;
    for (; d + 8 <= dim; d += 8) {
        __m256 q = _mm256_loadu_ps(query + d);
        for (int i = 0; i < 8; i++) acc[i] = _mm256_fmadd_ps(_mm256_loadu_ps(keys[i] + d), q, acc[i]);
    }
    __m256 s01 = _mm256_hadd_ps(acc[0], acc[1]), s23 = _mm256_hadd_ps(acc[2], acc[3]);
    __m256 s45 = _mm256_hadd_ps(acc[4], acc[5]), s67 = _mm256_hadd_ps(acc[6], acc[7]);
    __m256 s0123 = _mm256_hadd_ps(s01, s23), s4567 = _mm256_hadd_ps(s45, s67);
    /* lanes: [k0 k1 k2 k3 | k0 k1 k2 k3] halves of keys 0-3, and the same for 4-7: add the halves */
    __m256 low = _mm256_permute2f128_ps(s0123, s4567, 0x20), high = _mm256_permute2f128_ps(s0123, s4567, 0x31);
    _mm256_storeu_ps(scores, _mm256_add_ps(low, high));
    for (; d < dim; d++)
        for (int i = 0; i < 8; i++) scores[i] += query[d] * keys[i][d];
}

/* The weighted values of `count` (1-4) heads that share a kv head, 16 dims from d0 (8 where only 8 are left): each
   head's sums go over its visible keys in key order, one fused multiply-add per key and lane, as for a head alone;
   a value row's lanes are read once for all of them. weights[i]: head i's softmax weights; out[i]: its row. */
#define SPECDEC_PV_CASE(C)                                                                                    \
    case C: {                                                                                                 \
        __m256 acc[C][2];                                                                                     \
        for (int i = 0; i < C; i++) acc[i][0] = acc[i][1] = _mm256_setzero_ps();                              \
        for (int64_t j = 0; j <= last; j++) {                                                                 \
            const float *value_row = value + (at ? at[j] : j) * dim + d0;                                     \
            __m256 v0 = _mm256_loadu_ps(value_row), v1 = wide ? _mm256_loadu_ps(value_row + 8) : v0;          \
            for (int i = 0; i < C; i++) {                                                                     \
                __m256 weight = _mm256_set1_ps(weights[i][j]);                                                \
                acc[i][0] = _mm256_fmadd_ps(weight, v0, acc[i][0]);                                           \
                if (wide) acc[i][1] = _mm256_fmadd_ps(weight, v1, acc[i][1]);                                 \
            }                                                                                                 \
        }                                                                                                     \
        for (int i = 0; i < C; i++) {                                                                         \
            _mm256_storeu_ps(out[i] + d0, acc[i][0]);                                                         \
            if (wide) _mm256_storeu_ps(out[i] + d0 + 8, acc[i][1]);                                           \
        }                                                                                                     \
        break;                                                                                                \
    }
__attribute__((target("avx2,fma")))
static void weighted_values(int count, const float *const weights[4], float *const out[4], const float *value,
                            const int64_t *at, int64_t last, int64_t dim) {
    for (int64_t d0 = 0; d0 < dim; d0 += 16) {
        int wide = dim - d0 >= 16;
        switch (count) { SPECDEC_PV_CASE(1) SPECDEC_PV_CASE(2) SPECDEC_PV_CASE(3) SPECDEC_PV_CASE(4) }
    }
}
#undef SPECDEC_PV_CASE

/* The same for one head, any dim: 8 registers of sums at a time, and the dims past a multiple of 8 one by one. */
__attribute__((target("avx2,fma")))
static void weighted_values_one(const float *weights, float *row_out, const float *value, const int64_t *at,
                                int64_t last, int64_t dim) {
    for (int64_t d = 0; d < dim; d++) row_out[d] = 0.0f;
    for (int64_t d0 = 0; d0 < dim; d0 += 64) {
        int64_t width = dim - d0 < 64 ? dim - d0 : 64;
        __m256 acc[8];
        for (int i = 0; i < 8; i++) acc[i] = _mm256_setzero_ps();
        for (int64_t j = 0; j <= last; j++) {
            __m256 weight = _mm256_set1_ps(weights[j]);
            const float *value_row = value + (at ? at[j] : j) * dim + d0;
            for (int i = 0; i < width / 8; i++)
                acc[i] = _mm256_fmadd_ps(weight, _mm256_loadu_ps(value_row + 8 * i), acc[i]);
            for (int64_t d = width / 8 * 8; d < width; d++) row_out[d0 + d] += weights[j] * value_row[d];
        }
        for (int i = 0; i < width / 8; i++) _mm256_storeu_ps(row_out + d0 + 8 * i, acc[i]);
    }
}

/* Attention for a batch of one, each (query row, head) on its own: softmax(q·kᵀ·scale) · v over the keys the
   row may see (softcap > 0: each score s·scale capped to softcap·tanh(s·scale / softcap) first, Gemma 2's; 0:
   none), in key order, with the same float steps whatever the number of rows. So row i of a k-token verify (or a
   tree node) is computed exactly as a one-token forward over the same keys computes it.
   q (rows, heads, dim); k, v: kv_heads runs of (keys, dim) rows, head_stride floats apart (a cache's view
   into a longer buffer reads in place); visible: NULL = causal (row r sees keys up to keys - rows + r), else
   (rows, keys) bytes, nonzero = visible; out (rows, heads, dim).
   Scores go 8 keys at a time (dot8_avx2), their exponentials 8 at a time (exp_avx2), the sum and the weighted
   values in key order. A row's query heads that share a kv head go together: each block of 8 keys is scored for
   all of them while it is in L1, and each value row is read once for up to 4 of them (weighted_values), where
   each head alone would read all its keys and values again (from L2 or memory); every head's arithmetic is the same
   either way. Returns 0, or 1 when the scratch could not be allocated. */
__attribute__((target("avx2,fma")))
int specdec_attention(int threads, const float *q, const float *k, const float *v, const uint8_t *visible,
                      int64_t rows, int64_t heads, int64_t kv_heads, int64_t keys, int64_t dim, int64_t head_stride,
                      float scale, float softcap, float *out) {
    int64_t group = heads / kv_heads, padded = (keys + 7) / 8 * 8;
    float *scratch = malloc((size_t)threads * (size_t)(group * padded) * sizeof(float));
    int64_t *visible_at = visible ? malloc((size_t)threads * (size_t)keys * sizeof(int64_t)) : NULL;
    if (!scratch || (visible && !visible_at)) {
        free(scratch);
        free(visible_at);
        return 1;
    }
    /* (row, kv head) pairs dealt round-robin: under a causal mask later rows see more keys, so halves of the rows in
       order would leave one thread with ~3/4 of a prefill chunk's work, while round-robin gives each thread a kv head
       (two threads, two kv heads) or alternate rows. Threads from 64k multiply-adds on: below that, starting them
       costs more than the work. */
#pragma omp parallel for num_threads(threads) schedule(static, 1) if (rows * heads * keys * dim > (1 << 16))
    for (int64_t pair = 0; pair < rows * kv_heads; pair++) {
        int64_t r = pair / kv_heads, g = pair % kv_heads;
        float *scores = scratch + (size_t)omp_get_thread_num() * (size_t)(group * padded);
        const float *key = k + g * head_stride, *value = v + g * head_stride;
        /* Under a mask the row's visible keys, in order, are listed first (`at`) and only they are scored, weighed and
           summed: the same keys in the same order as skipping the others, so the same numbers. A packed batch's rows
           own every B-th slot, and scoring every slot would cost each row B times the work. */
        const int64_t *at = NULL;
        int64_t last = keys - rows + r;
        if (visible) {
            const uint8_t *seen = visible + r * keys;
            int64_t *listed = visible_at + (size_t)omp_get_thread_num() * (size_t)keys, n = 0;
            for (int64_t j = 0; j < keys; j++)
                if (seen[j]) listed[n++] = j;
            at = listed;
            last = n - 1;
        }
        if (last < 0) { /* no visible key: zeros, not NaN */
            memset(out + (r * heads + g * group) * dim, 0, (size_t)(group * dim) * sizeof(float));
            continue;
        }
        for (int64_t j0 = 0; j0 <= last; j0 += 8) {
            const float *block[8];
            for (int i = 0; i < 8; i++) {
                int64_t c = j0 + i <= last ? j0 + i : last;
                block[i] = key + (at ? at[c] : c) * dim;
            }
            for (int64_t i = 0; i < group; i++)
                dot8_avx2(q + (r * heads + g * group + i) * dim, block, dim, scores + i * padded + j0);
        }
        const float *weights[4];
        float *outs[4];
        int count = 0;
        for (int64_t i = 0; i < group; i++) {
            float *head_scores = scores + i * padded, *row_out = out + (r * heads + g * group + i) * dim;
            float best = -INFINITY;
            int64_t j = 0; /* 8 at a time: the same products, and the largest is the largest in any order */
            __m256 factor = _mm256_set1_ps(scale), top8 = _mm256_set1_ps(-INFINITY), cap = _mm256_set1_ps(softcap);
            for (; j + 8 <= last + 1; j += 8) {
                __m256 scaled = _mm256_mul_ps(_mm256_loadu_ps(head_scores + j), factor);
                if (softcap > 0.0f) scaled = _mm256_mul_ps(tanh_avx2(_mm256_div_ps(scaled, cap)), cap);
                _mm256_storeu_ps(head_scores + j, scaled);
                top8 = _mm256_max_ps(top8, scaled);
            }
            float lanes[8];
            _mm256_storeu_ps(lanes, top8);
            for (int i = 0; i < 8; i++) best = lanes[i] > best ? lanes[i] : best;
            if (softcap > 0.0f && j <= last) { /* the tail: the same vector steps on a padded copy */
                float part[8] = {0};
                for (int64_t i = 0; j + i <= last; i++) part[i] = head_scores[j + i] * scale;
                _mm256_storeu_ps(part, _mm256_mul_ps(tanh_avx2(_mm256_div_ps(_mm256_loadu_ps(part), cap)), cap));
                for (int64_t i = 0; j + i <= last; i++) head_scores[j + i] = part[i];
            }
            for (; j <= last; j++) {
                if (softcap <= 0.0f) head_scores[j] *= scale;
                best = head_scores[j] > best ? head_scores[j] : best;
            }
            if (best == -INFINITY) { /* every score -inf: zeros, not NaN */
                memset(row_out, 0, (size_t)dim * sizeof(float));
                continue;
            }
            __m256 top = _mm256_set1_ps(best);
            for (int64_t j0 = 0; j0 <= last; j0 += 8) /* past the last key: exp of garbage, never read below */
                _mm256_storeu_ps(head_scores + j0, exp_avx2(_mm256_sub_ps(_mm256_loadu_ps(head_scores + j0), top)));
            float total = 0.0f;
            for (j = 0; j <= last; j++) total += head_scores[j];
            __m256 divisor = _mm256_set1_ps(total); /* each weight divided once, 8 at a time: the same quotients */
            for (j = 0; j + 8 <= last + 1; j += 8)
                _mm256_storeu_ps(head_scores + j, _mm256_div_ps(_mm256_loadu_ps(head_scores + j), divisor));
            for (; j <= last; j++) head_scores[j] /= total;
            if (dim % 8) {
                weighted_values_one(head_scores, row_out, value, at, last, dim);
                continue;
            }
            weights[count] = head_scores;
            outs[count++] = row_out;
            if (count == 4) {
                weighted_values(count, weights, outs, value, at, last, dim);
                count = 0;
            }
        }
        if (count) weighted_values(count, weights, outs, value, at, last, dim);
    }
    free(scratch);
    free(visible_at);
    return 0;
}
