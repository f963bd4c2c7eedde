"""Which architectures an int8 or q4 model runs on the fast path (the lean layers, the layers in C and the decoder
stack), and in one line why a model does not.

The fast path computes a Llama-style layer: RMSNorm, q/k/v, the rotary embedding (over the whole head, or its first
dims: Phi-4-mini), attention, o, RMSNorm, a gated MLP. Qwen2 adds q/k/v biases, Qwen3 an RMSNorm over each head of q
and k, Mistral is Llama's layer (with a sliding window in some), Phi-3 keeps q/k/v and gate/up fused already. Gemma
2 and 3 add norms of the attention's and the MLP's outputs, RMSNorms that scale by 1 + weight, a GELU (tanh form),
Gemma 3 Qwen3's q/k norms too, Gemma 2 soft-capped attention scores; their embedding scaling, per-layer rotary
tables and soft-capped logits stay in transformers' decoder and head around the layers. A sliding window is in the
masks transformers' decoder forward makes for each layer, which the layers apply as they are: such a model runs its
layers lean, one by one, not the decoder stack (whose forward makes one mask for every layer; DECODER_CLASSES are
the decoders it runs).

A model of another architecture, or one with something the fast path does not compute (another activation, attention
that is not causal), keeps transformers' layers, which give the same logits slower; its load line says so
(`slow_path_reason`)."""

from __future__ import annotations

# model_type → the decoder layer class and the decoder class that get the fast path
FAST_ARCHITECTURES = {
    "llama": ("LlamaDecoderLayer", "LlamaModel"),
    "qwen2": ("Qwen2DecoderLayer", "Qwen2Model"),
    "qwen3": ("Qwen3DecoderLayer", "Qwen3Model"),
    "mistral": ("MistralDecoderLayer", "MistralModel"),
    "phi3": ("Phi3DecoderLayer", "Phi3Model"),
    "gemma2": ("Gemma2DecoderLayer", None),  # every released Gemma 2 and 3 has sliding-window layers: no stack
    "gemma3_text": ("Gemma3DecoderLayer", None),
    "gemma3": ("Gemma3DecoderLayer", None),  # Gemma 3 4B and up: the text layers beside a vision tower
}
LAYER_CLASSES = tuple(layer for layer, _ in FAST_ARCHITECTURES.values())
DECODER_CLASSES = tuple(decoder for _, decoder in FAST_ARCHITECTURES.values() if decoder is not None)
ACTIVATIONS = ("silu", "gelu_pytorch_tanh")  # the C layers' two (lean_layers.ACTIVATIONS)


def slow_path_reason(config) -> str | None:
    """Why a model with this config runs transformers' layers instead of the fast path, in a few words for its load
    line; None where the fast path runs it."""
    model_type = getattr(config, "model_type", None)
    if model_type not in FAST_ARCHITECTURES:
        return f"transformers' layers (no fast path for {model_type})"
    activation = getattr(config, "hidden_activation", None) or getattr(config, "hidden_act", "silu")  # Gemma's name
    if activation not in ACTIVATIONS:
        return f"transformers' layers (its {activation} MLP has no fast path)"
    if getattr(config, "use_bidirectional_attention", False):
        return "transformers' layers (its attention is not causal)"
    return None


def sliding_window(config) -> int | None:
    """The window of the model's sliding-window layers, None where every layer attends to the whole sequence: no
    window, one no layer uses (Qwen2/Qwen3 without use_sliding_window) or one as long as the context (Phi-3.5-mini's
    262144 tokens over 131072)."""
    window = getattr(config, "sliding_window", None)
    layer_types = getattr(config, "layer_types", None)
    if not window or (layer_types is not None and "sliding_attention" not in layer_types):
        return None
    context = getattr(config, "max_position_embeddings", None)
    return None if context is not None and window >= context else window
