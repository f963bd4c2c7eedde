/* The native runtime's public face: every function Python calls through ctypes, declared once, and the two
   structures Python mirrors (lean_layers.py's CLinear, decoder_stack.py's _Layer: the same fields in the same
   order). Every .c file includes this header, so the compiler checks each definition against its declaration, and
   binding.py reads the prototypes below to give ctypes the argument and return types: a prototype is one
   `return-type specdec_name(parameters);`, each parameter `type name` or `type *name` (int, int64_t, float,
   double, or any pointer), anything else binding.py refuses to read. */

#ifndef SPECDEC_KERNELS_H
#define SPECDEC_KERNELS_H

#include <stdint.h>

/* One projection of a layer: an int8 (int8_gemm.c), q4 (q4_gemm.c) or levels (levels_gemm.c) weight as the
   matmuls take it. */
typedef struct {
    int64_t kind;            /* 1: int8, 2: q4, 3: q4 in layout 1 (a .gguf's Q4_K blocks), 4: levels */
    int64_t in_features, out_features;
    int64_t width;           /* int8: input width in 4-byte steps (K4); q4 and levels: groups of 32 */
    int64_t limit;           /* int8: the activation limit (127 or 63); levels: its form (levels_layout.h) */
    const void *packed;
    const int32_t *row_sums; /* int8 only */
    const float *scales;     /* int8 only */
    const float *bias;       /* or NULL */
} specdec_linear;

/* One decoder layer as specdec_decoder_forward takes it. */
typedef struct {
    const float *input_norm, *post_norm; /* RMSNorm weights (H,) */
    float input_eps, post_eps;
    specdec_linear qkv, o, gate_up, down;
    const float *q_norm, *k_norm;        /* per-head RMSNorm weights (dim,) of q and k (Qwen3, Gemma 3), or NULL */
    float qk_eps;
    const float *attention_out_norm, *mlp_out_norm; /* Gemma's norms of o's and down's outputs, or NULL */
    float out_eps;
    int64_t activation;                  /* 0: SiLU, 1: GELU's tanh form (Gemma) */
    int64_t rotary_dim;                  /* the head's first dims the rotary embedding turns: dim but in Phi-4-mini */
} specdec_layer;

/* Which instructions run (int8_gemm.c, q4_amx.c). */
int specdec_isa(void);
int specdec_amx_ready(void);
int specdec_amx_bf16_ready(void);

/* The matmuls of a layer (int8_gemm.c, q4_gemm.c, levels_gemm.c). */
int specdec_int8_linear(int isa, int threads, const float *x, int64_t M, int64_t K, int64_t K4, int limit,
                        const int8_t *w_packed, const int32_t *row_sums, const float *weight_scales,
                        const float *bias, int64_t N, float *y);
void specdec_q8_groups(int threads, const float *x, int64_t M, int64_t K, int64_t groups, int8_t *values,
                       float *scales, float *scaled_sums);
void specdec_q4_pair_up_to(int tokens);
int specdec_q4_pairs(void);
int specdec_q4_linear(int isa, int layout, int threads, const float *x, int64_t M, int64_t K, int64_t groups,
                      const uint8_t *w_packed, const float *bias, int64_t N, float *y);
int specdec_levels_linear(int isa, int form, int threads, const float *x, int64_t M, int64_t K, int64_t groups,
                          const uint8_t *w_packed, const float *bias, int64_t N, float *y);

/* Load time: quantising and packing weights, picking a q4 layer's rows (int8_gemm.c, q4_pack.c). */
void specdec_int8_quantize(int threads, const void *weight, int dtype, int64_t N, int64_t K, int64_t stride,
                           int8_t *values, float *scales);
void specdec_int8_pack(int threads, const int8_t *values, int64_t N, int64_t K, int8_t *blocks, int32_t *row_sums);
void specdec_q4_quantize(int threads, const void *weight, int dtype, int64_t N, int64_t K, int64_t stride,
                         uint8_t *out);
void specdec_q4_select_rows(int threads, const uint8_t *packed, int64_t groups, const int64_t *rows, int64_t count,
                            uint8_t *out);

/* Attention (attention.c), the layer halves and the decoder stack (layer_kernels.c). */
int specdec_attention(int threads, const float *q, const float *k, const float *v, const uint8_t *visible,
                      int64_t rows, int64_t heads, int64_t kv_heads, int64_t keys, int64_t dim, int64_t head_stride,
                      float scale, float softcap, float *out);
void specdec_rms_norm(const float *x, const float *weight, float eps, int64_t M, int64_t K, float *y);
int specdec_lean_qkv(int isa, int threads, const float *x, int64_t T, int64_t H, const float *norm_weight,
                     float eps, const specdec_linear *qkv, const float *q_norm, const float *k_norm, float qk_eps,
                     const float *cos, const float *sin, int64_t heads, int64_t kv_heads, int64_t dim, int64_t rotary,
                     float *q, float *k, float *v);
int specdec_lean_mlp(int isa, int threads, const float *attention, const float *residual, int64_t T, int64_t H,
                     const specdec_linear *o, const float *attention_out_norm, const float *norm_weight, float eps,
                     const specdec_linear *gate_up, int64_t activation, const specdec_linear *down,
                     const float *mlp_out_norm, float out_eps, float *out);
int specdec_decoder_forward(int isa, int threads, const float *embed, int64_t rows, const int64_t *ids,
                            const specdec_layer *layers, int64_t count, float *const *keys, float *const *values,
                            const int64_t *capacity, int64_t cached, float *hidden, int64_t T, int64_t H,
                            const float *cos, const float *sin, const uint8_t *visible, int64_t heads,
                            int64_t kv_heads, int64_t dim, float scale, const float *final_norm, float final_eps,
                            float *normed);

/* The sampled step's passes over vocabulary-wide rows (sampling_kernels.c). */
int64_t specdec_top_k_rows(const float *scores, int64_t rows, int64_t width, int64_t k, float *values,
                           int64_t *ids);
int64_t specdec_support(const float *probs, int64_t width, int64_t *ids);

#endif
