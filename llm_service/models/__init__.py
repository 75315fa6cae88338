"""Language models on the paged KV cache (own implementation, HF weight names)."""

from llm_service.models.families import (
    DECODER_FAMILIES,
    DecoderFamily,
    build_decoder,
    decoder_family,
    load_text_config,
)
from llm_service.models.qwen2 import Qwen2ForCausalLM, TextConfig

__all__ = [
    "DECODER_FAMILIES",
    "DecoderFamily",
    "Qwen2ForCausalLM",
    "TextConfig",
    "build_decoder",
    "decoder_family",
    "load_text_config",
]
