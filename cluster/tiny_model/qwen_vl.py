"""What the tiny Qwen builders share: the special-token ids, the Qwen2-style text section, and the
top-level config around a family's text and vision sections."""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from transformers import PretrainedConfig, PreTrainedTokenizerFast

    from cluster.tiny_model.families import ModelSize


def qwen_token_ids(tok: PreTrainedTokenizerFast) -> dict[str, int]:
    return {t: int(tok.convert_tokens_to_ids(t)) for t in tok.all_special_tokens}


def qwen2_text_config(size: ModelSize, bos: int, eos: int, pad: int) -> dict[str, object]:
    """A Qwen2 decoder's text section (Qwen2-VL, Qwen2.5-VL, Qwen2-Audio), untied, without RoPE."""
    return {
        "vocab_size": size.vocab_size,
        "hidden_size": size.hidden_size,
        "intermediate_size": size.intermediate_size,
        "num_hidden_layers": size.num_layers,
        "num_attention_heads": size.num_heads,
        "num_key_value_heads": size.num_kv_heads,
        "max_position_embeddings": size.max_position_embeddings,
        "rms_norm_eps": 1e-6,
        "bos_token_id": bos,
        "eos_token_id": eos,
        "pad_token_id": pad,
        "tie_word_embeddings": False,
    }


def qwen_vl_config(
    config_cls: type[PretrainedConfig],
    arch: str,
    text: Mapping[str, object],
    vision: Mapping[str, object],
    tok: PreTrainedTokenizerFast,
) -> PretrainedConfig:
    """``config_cls(text_config=text, vision_config=vision)`` with the Qwen vision token ids, bos/eos/pad
    from ``text``, untied embeddings, and ``architectures = [arch]``."""
    ids = qwen_token_ids(tok)
    config = config_cls(
        text_config=text,
        vision_config=vision,
        image_token_id=ids["<|image_pad|>"],
        video_token_id=ids["<|video_pad|>"],
        vision_start_token_id=ids["<|vision_start|>"],
        vision_end_token_id=ids["<|vision_end|>"],
        tie_word_embeddings=False,
    )
    for key in ("bos_token_id", "eos_token_id", "pad_token_id"):
        setattr(config, key, text[key])
    config.architectures = [arch]
    return config
