/* Two passes over a vocabulary-wide row that a sampled step makes several times (engine/sampling.py): the k best
   scores of each row, and the ids of a distribution's nonzero entries. In torch each is several passes over
   vocabulary-wide rows that a forward has just pushed out of the caches; here each is one read of the row: a
   comparison of 32 floats at a time against the k-th best so far (or zero), the rare hits handled one by one.

   Built with the matmul kernels into one library by binding.py; called through ctypes (rows.py).
   AVX2 code only: it runs on every CPU the library runs on, and a row is read at memory speed either way. */

#include <immintrin.h>
#include <math.h>
#include <stdint.h>

#include "kernels.h"

/* Put (value, id) into the k slots (best first), after every slot whose value is at least as large: among
   equal values the id seen first stays first. The caller checked value > values[k - 1]. */
static inline void insert_best(float *values, int64_t *ids, int64_t k, float value, int64_t id) {
    int64_t slot = k - 1;
    while (slot > 0 && values[slot - 1] < value) {
        values[slot] = values[slot - 1];
        ids[slot] = ids[slot - 1];
        slot--;
    }
    values[slot] = value;
    ids[slot] = id;
}

/* The k best of one row into values/ids (best first). Returns 1 when the row holds a NaN or fewer than k
   values above -inf (slots left with id -1): torch.topk then decides, as it orders those its own way. */
__attribute__((target("avx2")))
static int top_k_row(const float *row, int64_t width, int64_t k, float *values, int64_t *ids) {
    for (int64_t slot = 0; slot < k; slot++) {
        values[slot] = -INFINITY;
        ids[slot] = -1;
    }
    float threshold = -INFINITY;
    __m256 unordered = _mm256_setzero_ps();
    int64_t start = 0;
    for (; start + 32 <= width; start += 32) {
        __m256 bar = _mm256_set1_ps(threshold);
        __m256 a = _mm256_loadu_ps(row + start), b = _mm256_loadu_ps(row + start + 8);
        __m256 c = _mm256_loadu_ps(row + start + 16), d = _mm256_loadu_ps(row + start + 24);
        unordered = _mm256_or_ps(unordered, _mm256_or_ps(_mm256_cmp_ps(a, b, _CMP_UNORD_Q),
                                                         _mm256_cmp_ps(c, d, _CMP_UNORD_Q)));
        __m256 above = _mm256_or_ps(_mm256_or_ps(_mm256_cmp_ps(a, bar, _CMP_GT_OQ), _mm256_cmp_ps(b, bar, _CMP_GT_OQ)),
                                    _mm256_or_ps(_mm256_cmp_ps(c, bar, _CMP_GT_OQ), _mm256_cmp_ps(d, bar, _CMP_GT_OQ)));
        if (!_mm256_movemask_ps(above)) continue;
        for (int64_t id = start; id < start + 32; id++) {
            if (row[id] > threshold) {
                insert_best(values, ids, k, row[id], id);
                threshold = values[k - 1];
            }
        }
    }
    int nan_seen = _mm256_movemask_ps(unordered) != 0;
    for (int64_t id = start; id < width; id++) {
        nan_seen |= isnan(row[id]);
        if (row[id] > threshold) {
            insert_best(values, ids, k, row[id], id);
            threshold = values[k - 1];
        }
    }
    return nan_seen || ids[k - 1] < 0;
}

/* The k best scores of each of `rows` rows of `scores` (rows x width, contiguous) and their ids, best first.
   Returns how many rows torch.topk must decide instead (a NaN, or fewer than k values above -inf); 0 normally. */
int64_t specdec_top_k_rows(const float *scores, int64_t rows, int64_t width, int64_t k, float *values,
                           int64_t *ids) {
    int64_t declined = 0;
#pragma omp parallel for schedule(static) reduction(+ : declined) if (rows > 1)
    for (int64_t r = 0; r < rows; r++)
        declined += top_k_row(scores + r * width, width, k, values + r * k, ids + r * k);
    return declined;
}

/* The ids i where probs[i] != 0 (NaN included, as torch.nonzero counts it), in order, into ids (room for
   width); returns how many. */
__attribute__((target("avx2")))
int64_t specdec_support(const float *probs, int64_t width, int64_t *ids) {
    int64_t count = 0, start = 0;
    __m256 zero = _mm256_setzero_ps();
    for (; start + 32 <= width; start += 32) {
        __m256 a = _mm256_loadu_ps(probs + start), b = _mm256_loadu_ps(probs + start + 8);
        __m256 c = _mm256_loadu_ps(probs + start + 16), d = _mm256_loadu_ps(probs + start + 24);
        __m256 any = _mm256_or_ps(_mm256_or_ps(_mm256_cmp_ps(a, zero, _CMP_NEQ_UQ), _mm256_cmp_ps(b, zero, _CMP_NEQ_UQ)),
                                  _mm256_or_ps(_mm256_cmp_ps(c, zero, _CMP_NEQ_UQ), _mm256_cmp_ps(d, zero, _CMP_NEQ_UQ)));
        if (!_mm256_movemask_ps(any)) continue;
        for (int64_t id = start; id < start + 32; id++)
            if (probs[id] != 0.0f) ids[count++] = id;  /* NaN != 0 is true */
    }
    for (int64_t id = start; id < width; id++)
        if (probs[id] != 0.0f) ids[count++] = id;
    return count;
}
