"""The tiny Qwen3-VL: a vision tower with learned position embeddings (a small table, so every image
interpolates it), DeepStack mergers on intermediate blocks, and a Qwen3 decoder (QK-norm, no qkv bias,
explicit head_dim) with interleaved M-RoPE. The Qwen2-style tokenizer, Qwen3-VL's released chat template
(tools included: qwen3_vl_template.py); the released processor classes (Qwen2-VL's image processor at patch 16, Qwen3-VL's video processor).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from cluster.tiny_model.qwen_vl import qwen_token_ids, qwen_vl_config

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerFast

    from cluster.tiny_model.families import BuiltModel, ModelSize

POSITION_TABLE_SIDE = 6  # 36 learned positions: images of 4..32 patches a side interpolate them
TINY_PIXELS = {"min_pixels": 64 * 64, "max_pixels": 32 * 32 * 1024}  # <= 1024 embeddings an image


def deepstack_indexes(depth: int) -> list[int]:
    """Which vision blocks feed DeepStack: the first two (a real 27-block tower: 8, 16, 24)."""
    return list(range(min(2, depth)))


def interleaved_mrope_section(head_dim: int) -> list[int]:
    """Qwen3-VL's 24:20:20 split of head_dim/2 frequencies (interleaved t, h, w), scaled down."""
    half = head_dim // 2
    hw = max(1, round(half * 20 / 64))
    return [half - 2 * hw, hw, hw]


def build_qwen3_vl(size: ModelSize, tok: PreTrainedTokenizerFast) -> BuiltModel:
    from transformers import Qwen3VLConfig, Qwen3VLForConditionalGeneration

    ids = qwen_token_ids(tok)
    head_dim = size.hidden_size // size.num_heads
    text = {
        "vocab_size": size.vocab_size,
        "hidden_size": size.hidden_size,
        "intermediate_size": size.intermediate_size,
        "num_hidden_layers": size.num_layers,
        "num_attention_heads": size.num_heads,
        "num_key_value_heads": size.num_kv_heads,
        "head_dim": head_dim,
        "max_position_embeddings": size.max_position_embeddings,
        "rms_norm_eps": 1e-6,
        "attention_bias": False,
        "rope_parameters": {
            "rope_type": "default",
            "rope_theta": 5000000.0,
            "mrope_section": interleaved_mrope_section(head_dim),
            "mrope_interleaved": True,
        },
        "bos_token_id": ids["<|endoftext|>"],
        "eos_token_id": ids["<|im_end|>"],
        "pad_token_id": ids["<|endoftext|>"],
    }
    vision = {
        "depth": size.vision_depth,
        "hidden_size": size.vision_hidden_size,
        "intermediate_size": size.vision_intermediate_size,
        "num_heads": size.vision_num_heads,
        "out_hidden_size": size.hidden_size,
        "hidden_act": "gelu_pytorch_tanh",
        "in_channels": 3,
        "patch_size": 16,
        "spatial_merge_size": 2,
        "temporal_patch_size": 2,
        "num_position_embeddings": POSITION_TABLE_SIDE**2,
        "deepstack_visual_indexes": deepstack_indexes(size.vision_depth),
    }
    config = qwen_vl_config(Qwen3VLConfig, "Qwen3VLForConditionalGeneration", text, vision, tok)
    return config, Qwen3VLForConditionalGeneration


def save_qwen3_vl_processor(out: str, tok: PreTrainedTokenizerFast, chat_template: str) -> None:
    from transformers import Qwen2VLImageProcessor, Qwen3VLProcessor, Qwen3VLVideoProcessor

    common = {"patch_size": 16, "merge_size": 2, "temporal_patch_size": 2, "image_mean": [0.5] * 3}
    common["image_std"] = [0.5] * 3
    size = {"shortest_edge": TINY_PIXELS["min_pixels"], "longest_edge": TINY_PIXELS["max_pixels"]}
    proc = Qwen3VLProcessor(
        image_processor=Qwen2VLImageProcessor(size=size, **common),
        video_processor=Qwen3VLVideoProcessor(size=size, **common),
        tokenizer=tok,
        chat_template=chat_template,
    )
    proc.save_pretrained(out)
