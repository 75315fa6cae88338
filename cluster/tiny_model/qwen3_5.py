"""The tiny Qwen3.5: Qwen3-VL's vision tower without DeepStack (one merger), and a hybrid decoder:
three Gated DeltaNet (linear-attention) layers then one gated full-attention layer, as in the released
checkpoints' ``full_attention_interval=4``. Attention layers rotate a quarter of each head
(``partial_rotary_factor=0.25``) with interleaved M-RoPE; the linear layers keep a causal-conv state
and a recurrent state per sequence. Value heads outnumber key heads in the linear layers (grouped,
as in the released checkpoints). The processor is Qwen3-VL's (transformers maps ``qwen3_5`` to it).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from cluster.tiny_model.qwen3_vl import POSITION_TABLE_SIDE, interleaved_mrope_section
from cluster.tiny_model.qwen_vl import qwen_token_ids, qwen_vl_config

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerFast

    from cluster.tiny_model.families import BuiltModel, ModelSize

FULL_ATTENTION_INTERVAL = 4
MIN_LAYERS = 4  # at least one full-attention layer after three linear ones
HEAD_DIM = 32  # a quarter rotates: 8 dims, 4 frequencies over (t, h, w, t)
PARTIAL_ROTARY_FACTOR = 0.25


def layer_types(num_layers: int) -> list[str]:
    return [
        "full_attention" if (i + 1) % FULL_ATTENTION_INTERVAL == 0 else "linear_attention"
        for i in range(num_layers)
    ]


def build_qwen3_5(size: ModelSize, tok: PreTrainedTokenizerFast) -> BuiltModel:
    from transformers import Qwen3_5Config, Qwen3_5ForConditionalGeneration

    ids = qwen_token_ids(tok)
    num_layers = max(size.num_layers, MIN_LAYERS)
    rotary_dim = int(HEAD_DIM * PARTIAL_ROTARY_FACTOR)
    text = {
        "vocab_size": size.vocab_size,
        "hidden_size": size.hidden_size,
        "intermediate_size": size.intermediate_size,
        "num_hidden_layers": num_layers,
        "layer_types": layer_types(num_layers),
        "num_attention_heads": size.num_heads,
        "num_key_value_heads": size.num_kv_heads,
        "head_dim": HEAD_DIM,
        "linear_conv_kernel_dim": 4,
        "linear_key_head_dim": 16,
        "linear_value_head_dim": 16,
        "linear_num_key_heads": size.num_kv_heads,
        "linear_num_value_heads": size.num_heads,
        "max_position_embeddings": size.max_position_embeddings,
        "rms_norm_eps": 1e-6,
        "attention_bias": False,
        "rope_parameters": {
            "rope_type": "default",
            "rope_theta": 10000000.0,
            "partial_rotary_factor": PARTIAL_ROTARY_FACTOR,
            "mrope_section": interleaved_mrope_section(rotary_dim),
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
    }
    config = qwen_vl_config(Qwen3_5Config, "Qwen3_5ForConditionalGeneration", text, vision, tok)
    return config, Qwen3_5ForConditionalGeneration
