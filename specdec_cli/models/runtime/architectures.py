"""Which architectures an int8 or q4 model runs on the fast path (the lean layers, the layers in C and the decoder
stack), and in one line why a model does not.

The fast path computes a Llama-style layer: RMSNorm, q/k/v, the rotary embedding over the whole head, attention over
every earlier key, o, RMSNorm, SiLU-gated MLP. Qwen2 adds q/k/v biases, Qwen3 an RMSNorm over each head of q and k,
Mistral is Llama's layer with a sliding window, Phi-3 keeps q/k/v and gate/up fused already. A model of another
architecture, or one with something the fast path does not compute (a sliding window that can cut the context, a
rotary embedding over part of a head), keeps transformers' layers, which give the same logits slower; its load
line says so (`slow_path_reason`)."""

from __future__ import annotations

# model_type → the decoder layer class and the decoder class that get the fast path
FAST_ARCHITECTURES = {
    "llama": ("LlamaDecoderLayer", "LlamaModel"),
    "qwen2": ("Qwen2DecoderLayer", "Qwen2Model"),
    "qwen3": ("Qwen3DecoderLayer", "Qwen3Model"),
    "mistral": ("MistralDecoderLayer", "MistralModel"),
    "phi3": ("Phi3DecoderLayer", "Phi3Model"),
}
LAYER_CLASSES = tuple(layer for layer, _ in FAST_ARCHITECTURES.values())
DECODER_CLASSES = tuple(decoder for _, decoder in FAST_ARCHITECTURES.values())


def slow_path_reason(config) -> str | None:
    """Why a model with this config runs transformers' layers instead of the fast path, in a few words for its load
    line; None where the fast path runs it."""
    model_type = getattr(config, "model_type", None)
    if model_type not in FAST_ARCHITECTURES:
        return f"transformers' layers (no fast path for {model_type})"
    window = sliding_window(config)
    context = getattr(config, "max_position_embeddings", None)
    if window is not None and (context is None or window < context):
        return f"transformers' layers (its sliding window of {window} tokens is shorter than its context of {context})"
    if float(getattr(config, "partial_rotary_factor", None) or 1.0) != 1.0:
        return "transformers' layers (its rotary embedding covers part of each head)"
    if getattr(config, "hidden_act", "silu") != "silu":
        return f"transformers' layers (its {config.hidden_act} MLP has no fast path)"
    return None


def sliding_window(config) -> int | None:
    """The window of the model's sliding-window layers, None where every layer attends to the whole sequence."""
    window = getattr(config, "sliding_window", None)
    layer_types = getattr(config, "layer_types", None)
    if not window or (layer_types is not None and "sliding_attention" not in layer_types):
        return None  # no window, or one no layer uses (Qwen2/Qwen3 without use_sliding_window)
    return window
