"""The tiny Qwen2-VL and Qwen2.5-VL: a Qwen2 decoder with M-RoPE behind the family's vision tower
(Qwen2.5-VL: windowed attention in every other block, a SwiGLU MLP), the Qwen2-style tokenizer and
chat template, and the released processor classes with fewer pixels allowed."""

from __future__ import annotations

from typing import TYPE_CHECKING

from cluster.tiny_model.qwen_vl import qwen2_text_config, qwen_token_ids, qwen_vl_config

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerFast, ProcessorMixin

    from cluster.tiny_model.families import BuiltModel, ModelSize

# Fewer pixels than a real checkpoint allows, so one image costs at most 1024 embeddings.
TINY_PIXELS = {"min_pixels": 56 * 56, "max_pixels": 28 * 28 * 1024}


def mrope_section(head_dim: int) -> list[int]:
    """Split head_dim/2 rotary frequencies over (t, h, w) in Qwen2-VL's 2:3:3 proportion."""
    half = head_dim // 2
    t = max(1, round(half * 2 / 8))
    h = (half - t) // 2
    return [t, h, half - t - h]


def _mrope_text_config(size: ModelSize, tok: PreTrainedTokenizerFast) -> dict[str, object]:
    ids = qwen_token_ids(tok)
    text = qwen2_text_config(size, ids["<|endoftext|>"], ids["<|im_end|>"], ids["<|endoftext|>"])
    head_dim = size.hidden_size // size.num_heads
    text["rope_parameters"] = {
        "rope_type": "default",
        "rope_theta": 1000000.0,
        "mrope_section": mrope_section(head_dim),
    }
    return text


def build_qwen2_vl(size: ModelSize, tok: PreTrainedTokenizerFast) -> BuiltModel:
    from transformers import Qwen2VLConfig, Qwen2VLForConditionalGeneration

    vision = {
        "depth": size.vision_depth,
        "embed_dim": size.vision_hidden_size,
        "hidden_size": size.hidden_size,
        "num_heads": size.vision_num_heads,
        "mlp_ratio": size.vision_intermediate_size // size.vision_hidden_size,
        "in_channels": 3,
        "patch_size": 14,
        "spatial_merge_size": 2,
        "temporal_patch_size": 2,
    }
    text = _mrope_text_config(size, tok)
    config = qwen_vl_config(Qwen2VLConfig, "Qwen2VLForConditionalGeneration", text, vision, tok)
    return config, Qwen2VLForConditionalGeneration


def fullatt_block_indexes(depth: int) -> list[int]:
    """Every second block attends over whole frames, the others in windows (a real 32-block tower: 7, 15, 23, 31)."""
    return list(range(1, depth, 2)) or [0]


def build_qwen2_5_vl(size: ModelSize, tok: PreTrainedTokenizerFast) -> BuiltModel:
    from transformers import Qwen2_5_VLConfig, Qwen2_5_VLForConditionalGeneration

    vision = {
        "depth": size.vision_depth,
        "hidden_size": size.vision_hidden_size,
        "intermediate_size": size.vision_intermediate_size,
        "num_heads": size.vision_num_heads,
        "out_hidden_size": size.hidden_size,
        "hidden_act": "silu",
        "in_channels": 3,
        "patch_size": 14,
        "spatial_merge_size": 2,
        "temporal_patch_size": 2,
        "window_size": 112,  # 4x4 merged tokens per window, as in the released checkpoints
        "fullatt_block_indexes": fullatt_block_indexes(size.vision_depth),
        "tokens_per_second": 2,  # the released checkpoints' value (transformers' default is 4)
    }
    text = _mrope_text_config(size, tok)
    config = qwen_vl_config(Qwen2_5_VLConfig, "Qwen2_5_VLForConditionalGeneration", text, vision, tok)
    return config, Qwen2_5_VLForConditionalGeneration


def _save_processor(
    proc_cls: type[ProcessorMixin], out: str, tok: PreTrainedTokenizerFast, chat_template: str
) -> None:
    # Qwen2.5-VL's released checkpoints use Qwen2-VL's image and video processor classes too.
    from transformers import Qwen2VLImageProcessor, Qwen2VLVideoProcessor

    proc = proc_cls(
        image_processor=Qwen2VLImageProcessor(**TINY_PIXELS),
        video_processor=Qwen2VLVideoProcessor(**TINY_PIXELS),
        tokenizer=tok,
        chat_template=chat_template,
    )
    proc.save_pretrained(out)


def save_qwen2_vl_processor(out: str, tok: PreTrainedTokenizerFast, chat_template: str) -> None:
    from transformers import Qwen2VLProcessor

    _save_processor(Qwen2VLProcessor, out, tok, chat_template)


def save_qwen2_5_vl_processor(out: str, tok: PreTrainedTokenizerFast, chat_template: str) -> None:
    from transformers import Qwen2_5_VLProcessor

    _save_processor(Qwen2_5_VLProcessor, out, tok, chat_template)
