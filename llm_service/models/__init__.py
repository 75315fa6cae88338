"""Language models on the paged KV cache (own implementation, HF weight names)."""

from llm_service.models.qwen2 import Qwen2ForCausalLM, TextConfig

__all__ = ["Qwen2ForCausalLM", "TextConfig"]
