/* The two halves of a Llama/Qwen2 decoder layer around its attention, each in one call, for int8 and q4 models
   (lean_layers.py). A one-token forward of the 1.5B demo target spent ~11 of ~54 ms outside its matmuls, most
   of it in the ~45 torch operations per layer between them; here a layer is three calls into C (these two
   and the attention) and the cache update.

   Every step works on one row (token) at a time with the same float steps whatever the number of rows, so a
   k-token verify still gives each token its one-token forward's numbers bit for bit. The steps are
   transformers' own except two roundings: the RMSNorm sums its squares in double and SiLU's exp is exp_avx2
   (torch: its own vectorised exp); both within a few ulp.

   Also here: the RMSNorm and the attention of a batch of one that lean_layers.py and rowwise_attention.py
   call on their own.

   Built with int8_gemm.c and q4_gemm.c into one library by int8_kernel.py; called through ctypes. */

#include <immintrin.h>
#include <math.h>
#include <omp.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

int specdec_int8_linear(int isa, int threads, const float *x, int64_t M, int64_t K, int64_t K4, int limit,
                        const int8_t *w_packed, const int32_t *row_sums, const float *weight_scales,
                        const float *bias, int64_t N, float *y);
int specdec_q4_linear(int isa, int layout, int threads, const float *x, int64_t M, int64_t K, int64_t groups,
                      const uint8_t *w_packed, const float *bias, int64_t N, float *y);

/* RMSNorm of x (M, K) float32 into y: y = x / sqrt(mean(x²) + eps) · weight, each row on its own, in one
   pass of float arithmetic whose order depends on K only (so a row's result never depends on the others).
   torch's CPU rms_norm is a chain of ~6 operations (~35 µs a call for one token); this is one. */
void specdec_rms_norm(const float *x, const float *weight, float eps, int64_t M, int64_t K, float *y) {
    for (int64_t m = 0; m < M; m++) {
        const float *row = x + m * K;
        double squares = 0.0;
        for (int64_t k = 0; k < K; k++) squares += (double)row[k] * (double)row[k];
        float inverse = (float)(1.0 / sqrt(squares / (double)K + (double)eps));
        for (int64_t k = 0; k < K; k++) y[m * K + k] = weight[k] * (row[k] * inverse);
    }
}

/* exp(x) for 8 floats, the same steps for every lane (so a score's weight never depends on its neighbours):
   x = n·ln2 + r with |r| <= ln2/2, exp(r) by a degree-6 polynomial (Cephes' expf coefficients, ~1 ulp), times
   2^n built in the exponent bits. Below -87.3 it gives 0; above 88.4, exp(88.4). */
__attribute__((target("avx2,fma")))
static inline __m256 exp_avx2(__m256 x) {
    const __m256 low = _mm256_set1_ps(-87.33654f);
    __m256 zero = _mm256_cmp_ps(x, low, _CMP_LT_OQ);
    x = _mm256_min_ps(_mm256_max_ps(x, low), _mm256_set1_ps(88.37626f)); /* above: FLT_MAX-ish, not garbage */
    __m256 n = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(1.44269504088896341f)),
                               _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    __m256 r = _mm256_fnmadd_ps(n, _mm256_set1_ps(0.693359375f), x);
    r = _mm256_fnmadd_ps(n, _mm256_set1_ps(-2.12194440e-4f), r);
    __m256 p = _mm256_set1_ps(1.9875691500e-4f);
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.3981999507e-3f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(8.3334519073e-3f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(4.1665795894e-2f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.6666665459e-1f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(5.0000001201e-1f));
    p = _mm256_fmadd_ps(p, _mm256_mul_ps(r, r), _mm256_add_ps(r, _mm256_set1_ps(1.0f)));
    __m256i bits = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
    return _mm256_andnot_ps(zero, _mm256_mul_ps(p, _mm256_castsi256_ps(bits)));
}

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
   row may see, in key order, with the same float steps whatever the number of rows. So row i of a k-token
   verify (or a tree node) is computed exactly as a one-token forward over the same keys computes it.
   q (rows, heads, dim); k, v: kv_heads runs of (keys, dim) rows, head_stride floats apart (a cache's view
   into a longer buffer reads in place); visible: NULL = causal (row r sees keys up to keys - rows + r), else
   (rows, keys) bytes, nonzero = visible; out (rows, heads, dim).
   Scores go 8 keys at a time (dot8_avx2), their exponentials 8 at a time (exp_avx2), the sum and the weighted
   values in key order. A row's query heads that share a kv head go together: each block of 8 keys is scored for
   all of them while it is in L1, and each value row is read once for up to 4 of them (weighted_values), where
   each head alone read all its keys and values again (from L2 or memory: 325 KB each at 636 keys of the demo
   target); every head's arithmetic is the same either way. Returns 0, or 1 when the scratch could not be allocated. */
__attribute__((target("avx2,fma")))
int specdec_attention(int threads, const float *q, const float *k, const float *v, const uint8_t *visible,
                      int64_t rows, int64_t heads, int64_t kv_heads, int64_t keys, int64_t dim, int64_t head_stride,
                      float scale, float *out) {
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
       (two threads, two kv heads) or alternate rows. Threads from 64k multiply-adds on (the demo draft's one-token
       decode past 73 cached keys; at 1 << 18 it ran on one thread below 293): its one-token forward 14.22 → 13.80 ms
       over 200 keys, interleaved, median of 100. */
#pragma omp parallel for num_threads(threads) schedule(static, 1) if (rows * heads * keys * dim > (1 << 16))
    for (int64_t pair = 0; pair < rows * kv_heads; pair++) {
        int64_t r = pair / kv_heads, g = pair % kv_heads;
        float *scores = scratch + (size_t)omp_get_thread_num() * (size_t)(group * padded);
        const float *key = k + g * head_stride, *value = v + g * head_stride;
        /* Under a mask the row's visible keys, in order, are listed first (`at`) and only they are scored, weighed and
           summed: the same keys in the same order as skipping the others, so the same numbers. A packed batch's rows
           own every B-th slot, and scoring every slot cost each row B times the work: B = 8 rows over ~200-token
           caches spent ~20 ms of a ~79 ms forward of the demo target on keys it then ignored. */
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
            __m256 factor = _mm256_set1_ps(scale), top8 = _mm256_set1_ps(-INFINITY);
            for (; j + 8 <= last + 1; j += 8) {
                __m256 scaled = _mm256_mul_ps(_mm256_loadu_ps(head_scores + j), factor);
                _mm256_storeu_ps(head_scores + j, scaled);
                top8 = _mm256_max_ps(top8, scaled);
            }
            float lanes[8];
            _mm256_storeu_ps(lanes, top8);
            for (int i = 0; i < 8; i++) best = lanes[i] > best ? lanes[i] : best;
            for (; j <= last; j++) {
                head_scores[j] *= scale;
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

/* One projection as lean_layers.py describes it (ctypes Structure of the same fields). */
typedef struct {
    int64_t kind;         /* 1: int8 (int8_gemm.c), 2: q4 (q4_gemm.c) */
    int64_t in_features, out_features;
    int64_t width;        /* int8: input width in 4-byte steps (K4); q4: groups of 32 */
    int64_t limit;        /* int8: the activation limit (127 or 63) */
    const void *packed;
    const int32_t *row_sums; /* int8 only */
    const float *scales;     /* int8 only */
    const float *bias;       /* or NULL */
} specdec_linear;

static int linear(int isa, int threads, const specdec_linear *l, const float *x, int64_t M, float *y) {
    if (l->kind == 2 || l->kind == 3)
        return specdec_q4_linear(isa, l->kind == 3, threads, x, M, l->in_features, l->width, l->packed, l->bias,
                                 l->out_features, y);
    return specdec_int8_linear(isa, threads, x, M, l->in_features, l->width, (int)l->limit, l->packed, l->row_sums,
                               l->scales, l->bias, l->out_features, y);
}

/* transformers' apply_rotary_pos_emb for one head of one row: x·cos + rotate_half(x)·sin, each product and
   the sum rounded on its own as torch's three operations round them. */
static void rotate(const float *x, const float *cos, const float *sin, int64_t dim, float *out) {
    int64_t half = dim / 2;
    for (int64_t d = 0; d < dim; d++) {
        float rotated = d < half ? -x[d + half] : x[d - half];
        float a = x[d] * cos[d], b = rotated * sin[d];
        out[d] = a + b;
    }
}

/* x (T, H) → RMSNorm → q/k/v projection (one fused layer) → rotary on q and k:
   q (T, heads, dim), k and v (kv_heads, T, dim) (the cache's layout). cos, sin (T, dim).
   Returns 0, or 1 when a buffer could not be allocated. */
int specdec_lean_qkv(int isa, int threads, const float *x, int64_t T, int64_t H, const float *norm_weight,
                     float eps, const specdec_linear *qkv, const float *cos, const float *sin, int64_t heads,
                     int64_t kv_heads, int64_t dim, float *q, float *k, float *v) {
    int64_t width = qkv->out_features;
    float *normed = malloc((size_t)(T * H) * sizeof(float)), *states = malloc((size_t)(T * width) * sizeof(float));
    int failed = !normed || !states;
    if (!failed) {
        specdec_rms_norm(x, norm_weight, eps, T, H, normed);
        failed = linear(isa, threads, qkv, normed, T, states);
    }
    for (int64_t t = 0; !failed && t < T; t++) {
        const float *row = states + t * width, *c = cos + t * dim, *s = sin + t * dim;
        for (int64_t h = 0; h < heads; h++) rotate(row + h * dim, c, s, dim, q + (t * heads + h) * dim);
        for (int64_t h = 0; h < kv_heads; h++) {
            rotate(row + (heads + h) * dim, c, s, dim, k + (h * T + t) * dim);
            const float *value = row + (heads + kv_heads + h) * dim;
            for (int64_t d = 0; d < dim; d++) v[(h * T + t) * dim + d] = value[d];
        }
    }
    free(normed);
    free(states);
    return failed;
}

/* acted (T, inner) = silu(gate) · up for gates (T, 2·inner) = [gate | up] per row: silu(x) = x / (1 + exp(-x)),
   8 channels at a time (exp_avx2) and the row's tail past a multiple of 8 with the same vector steps on a
   padded copy, so every element takes the same steps wherever it sits. */
__attribute__((target("avx2,fma")))
static void silu_times(int threads, const float *gates, int64_t T, int64_t inner, float *acted) {
    int64_t steps = (inner + 7) / 8;
    const __m256 one = _mm256_set1_ps(1.0f), sign = _mm256_set1_ps(-0.0f);
#pragma omp parallel for num_threads(threads) schedule(static) collapse(2) if (T * inner > 32768)
    for (int64_t t = 0; t < T; t++) {
        for (int64_t step = 0; step < steps; step++) {
            const float *gate_row = gates + t * 2 * inner, *up_row = gate_row + inner;
            int64_t i = step * 8, count = inner - i < 8 ? inner - i : 8;
            float gate_part[8] = {0}, up_part[8] = {0}, result[8];
            const float *gate_from = gate_row + i, *up_from = up_row + i;
            float *to = acted + t * inner + i;
            if (count < 8) { /* the row's tail: the same vector steps on a padded copy */
                for (int64_t j = 0; j < count; j++) gate_part[j] = gate_from[j], up_part[j] = up_from[j];
                gate_from = gate_part, up_from = up_part, to = result;
            }
            __m256 gate = _mm256_loadu_ps(gate_from), up = _mm256_loadu_ps(up_from);
            __m256 silu = _mm256_div_ps(gate, _mm256_add_ps(one, exp_avx2(_mm256_xor_ps(gate, sign))));
            _mm256_storeu_ps(to, _mm256_mul_ps(silu, up));
            for (int64_t j = 0; count < 8 && j < count; j++) acted[t * inner + i + j] = result[j];
        }
    }
}

/* The rest of the layer: h = residual + o(attention); out = h + down(silu(gate) · up), gate and up from one
   fused projection of RMSNorm(h). attention (T, heads·dim), residual and out (T, H).
   Returns 0, or 1 when a buffer could not be allocated. */
int specdec_lean_mlp(int isa, int threads, const float *attention, const float *residual, int64_t T, int64_t H,
                     const specdec_linear *o, const float *norm_weight, float eps, const specdec_linear *gate_up,
                     const specdec_linear *down, float *out) {
    int64_t inner = gate_up->out_features / 2;
    float *hidden = malloc((size_t)(T * H) * sizeof(float)), *normed = malloc((size_t)(T * H) * sizeof(float));
    float *gates = malloc((size_t)(T * 2 * inner) * sizeof(float)), *acted = malloc((size_t)(T * inner) * sizeof(float));
    int failed = !hidden || !normed || !gates || !acted;
    if (!failed) failed = linear(isa, threads, o, attention, T, hidden);
    if (!failed) {
        for (int64_t i = 0; i < T * H; i++) hidden[i] = residual[i] + hidden[i];
        specdec_rms_norm(hidden, norm_weight, eps, T, H, normed);
        failed = linear(isa, threads, gate_up, normed, T, gates);
    }
    if (!failed) {
        silu_times(threads, gates, T, inner, acted);
        failed = linear(isa, threads, down, acted, T, out);
    }
    if (!failed)
        for (int64_t i = 0; i < T * H; i++) out[i] = hidden[i] + out[i];
    free(hidden);
    free(normed);
    free(gates);
    free(acted);
    return failed;
}

/* One decoder layer as specdec_decoder_stack takes it (decoder_stack.py's `_Layer`, the same fields). */
typedef struct {
    const float *input_norm, *post_norm; /* RMSNorm weights (H,) */
    float input_eps, post_eps;
    specdec_linear qkv, o, gate_up, down;
} specdec_layer;

/* Every decoder layer of a batch of one in a single call: per layer exactly the three calls lean_layers.py makes
   one by one (specdec_lean_qkv, specdec_attention, specdec_lean_mlp), in the same order on the same numbers, so
   the result is theirs bit for bit; what goes is the Python between them (~0.1-0.3 ms a layer: module calls,
   tensor allocations, the cache update, argument conversion; the 0.5B draft's one-token forward 21.9 → 18.6 ms).
   hidden (T, H) float32, the input on entry and the last layer's output on return. Layer i's cache:
   keys[i], values[i] (kv_heads runs of `capacity[i]` rows of dim floats; `cached` of them held); the new
   entries are written at rows cached..cached+T-1 (the caller made room). visible: NULL = causal, else (T,
   cached+T) bytes, nonzero = visible. Returns 0, or 1 when a buffer could not be allocated. */
int specdec_decoder_stack(int isa, int threads, const specdec_layer *layers, int64_t count, float *const *keys,
                          float *const *values, const int64_t *capacity, int64_t cached, float *hidden, int64_t T,
                          int64_t H, const float *cos, const float *sin, const uint8_t *visible, int64_t heads,
                          int64_t kv_heads, int64_t dim, float scale) {
    float *q = malloc((size_t)(T * heads * dim) * sizeof(float)), *attended = malloc((size_t)(T * heads * dim) * sizeof(float));
    float *k = malloc((size_t)(T * kv_heads * dim) * sizeof(float)), *v = malloc((size_t)(T * kv_heads * dim) * sizeof(float));
    float *out = malloc((size_t)(T * H) * sizeof(float));
    int failed = !q || !attended || !k || !v || !out;
    for (int64_t i = 0; !failed && i < count; i++) {
        const specdec_layer *layer = layers + i;
        failed = specdec_lean_qkv(isa, threads, hidden, T, H, layer->input_norm, layer->input_eps, &layer->qkv, cos,
                                  sin, heads, kv_heads, dim, q, k, v);
        if (failed) break;
        for (int64_t h = 0; h < kv_heads; h++) { /* (kv_heads, T, dim) → the cache's rows cached.. */
            memcpy(keys[i] + (h * capacity[i] + cached) * dim, k + h * T * dim, (size_t)(T * dim) * sizeof(float));
            memcpy(values[i] + (h * capacity[i] + cached) * dim, v + h * T * dim, (size_t)(T * dim) * sizeof(float));
        }
        failed = specdec_attention(threads, q, keys[i], values[i], visible, T, heads, kv_heads, cached + T, dim,
                                   capacity[i] * dim, scale, attended);
        if (!failed)
            failed = specdec_lean_mlp(isa, threads, attended, hidden, T, H, &layer->o, layer->post_norm,
                                      layer->post_eps, &layer->gate_up, &layer->down, out);
        if (!failed) memcpy(hidden, out, (size_t)(T * H) * sizeof(float));
    }
    free(q);
    free(attended);
    free(k);
    free(v);
    free(out);
    return failed;
}

/* A Llama/Qwen2 decoder's whole forward for a batch of one (decoder_stack.stack_forward): the embedding rows of
   `ids`, every layer (specdec_decoder_stack, the same arguments), the final RMSNorm (specdec_rms_norm, as the
   decoder's norm module calls it on the layered path: lean_layers.lean_norm), into `normed` (T, H). One call
   instead of three: the embedding's and the norm's torch calls ran with cold caches after the layers' weights
   streamed through them (~0.25 and ~0.35 ms a forward). embed (rows, H) float32. Returns 0; 1 when a buffer could
   not be allocated; 2 when an id is outside 0..rows-1 (nothing computed). `hidden` (T, H) is scratch. */
int specdec_decoder_forward(int isa, int threads, const float *embed, int64_t rows, const int64_t *ids,
                            const specdec_layer *layers, int64_t count, float *const *keys, float *const *values,
                            const int64_t *capacity, int64_t cached, float *hidden, int64_t T, int64_t H,
                            const float *cos, const float *sin, const uint8_t *visible, int64_t heads,
                            int64_t kv_heads, int64_t dim, float scale, const float *final_norm, float final_eps,
                            float *normed) {
    for (int64_t t = 0; t < T; t++)
        if (ids[t] < 0 || ids[t] >= rows) return 2;
    for (int64_t t = 0; t < T; t++) memcpy(hidden + t * H, embed + ids[t] * H, (size_t)H * sizeof(float));
    int failed = specdec_decoder_stack(isa, threads, layers, count, keys, values, capacity, cached, hidden, T, H, cos,
                                       sin, visible, heads, kv_heads, dim, scale);
    if (!failed) specdec_rms_norm(hidden, final_norm, final_eps, T, H, normed);
    return failed;
}
