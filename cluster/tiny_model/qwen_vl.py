"""What the tiny Qwen-VL builders share: the special-token ids and the top-level config around a
family's text and vision sections."""

from __future__ import annotations

from typing import Any


def qwen_token_ids(tok: Any) -> dict[str, int]:
    return {t: int(tok.convert_tokens_to_ids(t)) for t in tok.all_special_tokens}


def qwen_vl_config(config_cls: Any, arch: str, text: dict[str, Any], vision: dict[str, Any], tok: Any) -> Any:
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
