/* The two halves of a Llama-style decoder layer (Llama, Qwen2, Qwen3, Mistral, Phi-3, Gemma) around its attention, each
   in one call, for int8 and q4 models (lean_layers.py), and the decoder stack that runs every layer in one call
   (decoder_stack.py). Outside its matmuls a layer is dozens of small torch operations, whose fixed costs add up at
   a few tokens; here a layer is three calls into C (these two and the attention, attention.c) and the cache update.

   Every step works on one row (token) at a time with the same float steps whatever the number of rows, so a
   k-token verify still gives each token its one-token forward's numbers bit for bit. The steps are
   transformers' own except two roundings: the RMSNorm sums its squares in double and SiLU's exp is exp_avx2
   (torch: its own vectorised exp); both within a few ulp.

   Also here: the RMSNorm that lean_layers.py calls on its own.

   Built with the other kernels into one library by binding.py; called through ctypes. */

#include <immintrin.h>
#include <math.h>
#include <omp.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "kernels.h"
#include "vector_math.h"

/* RMSNorm of x (M, K) float32 into y: y = x / sqrt(mean(x²) + eps) · weight, each row on its own, in one
   pass of float arithmetic whose order depends on K only (so a row's result never depends on the others).
   torch's CPU rms_norm is a chain of several operations; this is one. */
void specdec_rms_norm(const float *x, const float *weight, float eps, int64_t M, int64_t K, float *y) {
    for (int64_t m = 0; m < M; m++) {
        const float *row = x + m * K;
        double squares = 0.0;
        for (int64_t k = 0; k < K; k++) squares += (double)row[k] * (double)row[k];
        float inverse = (float)(1.0 / sqrt(squares / (double)K + (double)eps));
        for (int64_t k = 0; k < K; k++) y[m * K + k] = weight[k] * (row[k] * inverse);
    }
}

/* One projection (specdec_linear: kernels.h) of M rows. */
static int linear(int isa, int threads, const specdec_linear *l, const float *x, int64_t M, float *y) {
    if (l->kind == 2 || l->kind == 3)
        return specdec_q4_linear(isa, l->kind == 3, threads, x, M, l->in_features, l->width, l->packed, l->bias,
                                 l->out_features, y);
    if (l->kind == 4)
        return specdec_levels_linear(isa, (int)l->limit, threads, x, M, l->in_features, l->width, l->packed, l->bias,
                                     l->out_features, y);
    return specdec_int8_linear(isa, threads, x, M, l->in_features, l->width, (int)l->limit, l->packed, l->row_sums,
                               l->scales, l->bias, l->out_features, y);
}

/* transformers' apply_rotary_pos_emb for one head of one row: x·cos + rotate_half(x)·sin over its first `rotary`
   dims (all of them but in a partial rotary embedding: Phi-4-mini's), each product and the sum rounded on its own
   as torch's three operations round them; the dims past them as they are. */
static void rotate(const float *x, const float *cos, const float *sin, int64_t dim, int64_t rotary, float *out) {
    int64_t half = rotary / 2;
    for (int64_t d = 0; d < rotary; d++) {
        float rotated = d < half ? -x[d + half] : x[d - half];
        float a = x[d] * cos[d], b = rotated * sin[d];
        out[d] = a + b;
    }
    for (int64_t d = rotary; d < dim; d++) out[d] = x[d];
}

/* One head of one row, RMSNorm'd over the head (q_norm / k_norm: Qwen3's; NULL: none) into `scratch`, then
   rotated into `out`. */
static void norm_and_rotate(const float *x, const float *norm, float eps, const float *cos, const float *sin,
                            int64_t dim, int64_t rotary, float *scratch, float *out) {
    if (norm) {
        specdec_rms_norm(x, norm, eps, 1, dim, scratch);
        x = scratch;
    }
    rotate(x, cos, sin, dim, rotary, out);
}

/* x (T, H) → RMSNorm → q/k/v projection (one fused layer) → per-head RMSNorm of q and k where q_norm and k_norm
   are given (dim,) (else NULL) → rotary on the first `rotary` dims of q and k: q (T, heads, dim), k and v (kv_heads,
   T, dim) (the cache's layout). cos, sin (T, rotary). Returns 0, or 1 when a buffer could not be allocated. */
int specdec_lean_qkv(int isa, int threads, const float *x, int64_t T, int64_t H, const float *norm_weight,
                     float eps, const specdec_linear *qkv, const float *q_norm, const float *k_norm, float qk_eps,
                     const float *cos, const float *sin, int64_t heads, int64_t kv_heads, int64_t dim, int64_t rotary,
                     float *q, float *k, float *v) {
    int64_t width = qkv->out_features;
    float *normed = malloc((size_t)(T * H) * sizeof(float)), *states = malloc((size_t)(T * width) * sizeof(float));
    float *scratch = malloc((size_t)dim * sizeof(float));
    int failed = !normed || !states || !scratch;
    if (!failed) {
        specdec_rms_norm(x, norm_weight, eps, T, H, normed);
        failed = linear(isa, threads, qkv, normed, T, states);
    }
    for (int64_t t = 0; !failed && t < T; t++) {
        const float *row = states + t * width, *c = cos + t * rotary, *s = sin + t * rotary;
        for (int64_t h = 0; h < heads; h++)
            norm_and_rotate(row + h * dim, q_norm, qk_eps, c, s, dim, rotary, scratch, q + (t * heads + h) * dim);
        for (int64_t h = 0; h < kv_heads; h++) {
            norm_and_rotate(row + (heads + h) * dim, k_norm, qk_eps, c, s, dim, rotary, scratch,
                            k + (h * T + t) * dim);
            const float *value = row + (heads + kv_heads + h) * dim;
            for (int64_t d = 0; d < dim; d++) v[(h * T + t) * dim + d] = value[d];
        }
    }
    free(normed);
    free(states);
    free(scratch);
    return failed;
}

/* GELU's tanh form, as transformers' gelu_pytorch_tanh (Gemma): 0.5·x·(1 + tanh(√(2/π)·(x + 0.044715·x³))), the
   tanh as vector_math.h's tanh_avx2. */
__attribute__((target("avx2,fma")))
static inline __m256 gelu_tanh_avx2(__m256 x) {
    const __m256 one = _mm256_set1_ps(1.0f), half = _mm256_set1_ps(0.5f);
    __m256 cube = _mm256_mul_ps(_mm256_mul_ps(x, x), x);
    __m256 u = _mm256_mul_ps(_mm256_set1_ps(0.7978845608028654f),
                             _mm256_add_ps(x, _mm256_mul_ps(_mm256_set1_ps(0.044715f), cube)));
    return _mm256_mul_ps(_mm256_mul_ps(half, x), _mm256_add_ps(one, tanh_avx2(u)));
}

/* acted (T, inner) = act(gate) · up for gates (T, 2·inner) = [gate | up] per row, act SiLU (activation 0:
   x / (1 + exp(-x))) or GELU's tanh form (1), 8 channels at a time (exp_avx2) and the row's tail past a multiple of
   8 with the same vector steps on a padded copy, so every element takes the same steps wherever it sits. */
__attribute__((target("avx2,fma")))
static void act_times(int threads, int64_t activation, const float *gates, int64_t T, int64_t inner, float *acted) {
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
            __m256 acted_gate = activation
                                    ? gelu_tanh_avx2(gate)
                                    : _mm256_div_ps(gate, _mm256_add_ps(one, exp_avx2(_mm256_xor_ps(gate, sign))));
            _mm256_storeu_ps(to, _mm256_mul_ps(acted_gate, up));
            for (int64_t j = 0; count < 8 && j < count; j++) acted[t * inner + i + j] = result[j];
        }
    }
}

/* The rest of the layer: h = residual + o(attention); out = h + down(act(gate) · up), gate and up from one
   fused projection of RMSNorm(h), act as act_times takes `activation`. Gemma's norms of o's output
   (attention_out_norm) and of down's (mlp_out_norm, both with out_eps) where given, else NULL.
   attention (T, heads·dim), residual and out (T, H). Returns 0, or 1 when a buffer could not be allocated. */
int specdec_lean_mlp(int isa, int threads, const float *attention, const float *residual, int64_t T, int64_t H,
                     const specdec_linear *o, const float *attention_out_norm, const float *norm_weight, float eps,
                     const specdec_linear *gate_up, int64_t activation, const specdec_linear *down,
                     const float *mlp_out_norm, float out_eps, float *out) {
    int64_t inner = gate_up->out_features / 2;
    float *hidden = malloc((size_t)(T * H) * sizeof(float)), *normed = malloc((size_t)(T * H) * sizeof(float));
    float *gates = malloc((size_t)(T * 2 * inner) * sizeof(float)), *acted = malloc((size_t)(T * inner) * sizeof(float));
    int failed = !hidden || !normed || !gates || !acted;
    if (!failed) failed = linear(isa, threads, o, attention, T, hidden);
    if (!failed) {
        if (attention_out_norm) specdec_rms_norm(hidden, attention_out_norm, out_eps, T, H, hidden); /* in place */
        for (int64_t i = 0; i < T * H; i++) hidden[i] = residual[i] + hidden[i];
        specdec_rms_norm(hidden, norm_weight, eps, T, H, normed);
        failed = linear(isa, threads, gate_up, normed, T, gates);
    }
    if (!failed) {
        act_times(threads, activation, gates, T, inner, acted);
        failed = linear(isa, threads, down, acted, T, out);
    }
    if (!failed && mlp_out_norm) specdec_rms_norm(out, mlp_out_norm, out_eps, T, H, out);
    if (!failed)
        for (int64_t i = 0; i < T * H; i++) out[i] = hidden[i] + out[i];
    free(hidden);
    free(normed);
    free(gates);
    free(acted);
    return failed;
}

/* Every decoder layer of a batch of one in a single call: per layer exactly the three calls lean_layers.py makes
   one by one (specdec_lean_qkv, specdec_attention, specdec_lean_mlp), in the same order on the same numbers, so
   the result is theirs bit for bit; what goes is the Python between them (module calls, tensor allocations, the
   cache update, argument conversion).
   hidden (T, H) float32, the input on entry and the last layer's output on return. Layer i's cache:
   keys[i], values[i] (kv_heads runs of `capacity[i]` rows of dim floats; `cached` of them held); the new
   entries are written at rows cached..cached+T-1 (the caller made room). visible: NULL = causal, else (T,
   cached+T) bytes, nonzero = visible. Returns 0, or 1 when a buffer could not be allocated. */
static int specdec_decoder_stack(int isa, int threads, const specdec_layer *layers, int64_t count,
                                 float *const *keys, float *const *values, const int64_t *capacity, int64_t cached,
                                 float *hidden, int64_t T, int64_t H, const float *cos, const float *sin,
                                 const uint8_t *visible, int64_t heads, int64_t kv_heads, int64_t dim, float scale) {
    float *q = malloc((size_t)(T * heads * dim) * sizeof(float)), *attended = malloc((size_t)(T * heads * dim) * sizeof(float));
    float *k = malloc((size_t)(T * kv_heads * dim) * sizeof(float)), *v = malloc((size_t)(T * kv_heads * dim) * sizeof(float));
    float *out = malloc((size_t)(T * H) * sizeof(float));
    int failed = !q || !attended || !k || !v || !out;
    for (int64_t i = 0; !failed && i < count; i++) {
        const specdec_layer *layer = layers + i;
        failed = specdec_lean_qkv(isa, threads, hidden, T, H, layer->input_norm, layer->input_eps, &layer->qkv,
                                  layer->q_norm, layer->k_norm, layer->qk_eps, cos, sin, heads, kv_heads, dim,
                                  layer->rotary_dim, q, k, v);
        if (failed) break;
        for (int64_t h = 0; h < kv_heads; h++) { /* (kv_heads, T, dim) → the cache's rows cached.. */
            memcpy(keys[i] + (h * capacity[i] + cached) * dim, k + h * T * dim, (size_t)(T * dim) * sizeof(float));
            memcpy(values[i] + (h * capacity[i] + cached) * dim, v + h * T * dim, (size_t)(T * dim) * sizeof(float));
        }
        failed = specdec_attention(threads, q, keys[i], values[i], visible, T, heads, kv_heads, cached + T, dim,
                                   capacity[i] * dim, scale, 0.0f, attended);
        if (!failed)
            failed = specdec_lean_mlp(isa, threads, attended, hidden, T, H, &layer->o, layer->attention_out_norm,
                                      layer->post_norm, layer->post_eps, &layer->gate_up, layer->activation,
                                      &layer->down, layer->mlp_out_norm, layer->out_eps, out);
        if (!failed) memcpy(hidden, out, (size_t)(T * H) * sizeof(float));
    }
    free(q);
    free(attended);
    free(k);
    free(v);
    free(out);
    return failed;
}

/* A Llama-style decoder's whole forward for a batch of one (decoder_stack.stack_forward): the embedding rows of
   `ids`, every layer (specdec_decoder_stack, the same arguments), the final RMSNorm (specdec_rms_norm, as the
   decoder's norm module calls it on the layered path: lean_layers.lean_norm), into `normed` (T, H). One call
   instead of three: the embedding's and the norm's torch calls would run with cold caches after the layers' weights
   streamed through them. embed (rows, H) float32. Returns 0; 1 when a buffer could
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
