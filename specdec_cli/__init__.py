"""specdec: lossless speculative decoding for local LLM chat and batch generation."""

__version__ = "0.1.0"
