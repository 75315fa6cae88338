"""The tiny Gemma 4: a vision tower with its pooler, an audio conformer, and a decoder with sliding and
full layers, per-layer embeddings (PLE) and KV shared by its last layers, with Gemma 4's own special
tokens and its released chat template (``released_templates.py``; its tool markers stay plain text
here, the released tokenizer makes them special tokens).

Layers (5 by default): ``S F S S F`` (S: sliding window of 8 tokens, F: full attention with its own,
wider head dim and partial "proportional" RoPE). The last two layers (one of each kind) are KV-shared:
they read the KV of layer 2 (sliding) and layer 1 (full) and write none. The sliding window is shorter
than any test prompt.

Variants (``make_tiny_model(..., variant=)``): ``base``; ``k_eq_v`` (``attention_k_eq_v``: the full
layers' values are their keys, with one KV head); ``moe`` (the MoE block beside every MLP);
``unshared`` (no KV-shared layers: the base model's shapes otherwise, for memory comparisons);
``causal_vision`` (``use_bidirectional_attention: null``: image soft tokens attend causally, so a
prefill chunk may end inside an image).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from transformers import PreTrainedTokenizerFast

from cluster.tiny_model.tokenizer import train_bpe

if TYPE_CHECKING:
    from cluster.tiny_model.families import BuiltModel, ModelSize

BOI, EOI, IMAGE = "<|image>", "<image|>", "<|image|>"
BOA, EOA, AUDIO = "<|audio>", "<audio|>", "<|audio|>"
VIDEO = "<|video|>"
GEMMA4_SPECIAL_TOKENS = [
    "<pad>",
    "<eos>",
    "<bos>",
    "<unk>",
    "<|turn>",
    "<turn|>",
    BOI,
    EOI,
    IMAGE,
    BOA,
    EOA,
    AUDIO,
    VIDEO,
]

VARIANTS = ("base", "k_eq_v", "moe", "unshared", "causal_vision")
SLIDING_WINDOW = 8
NUM_KV_SHARED_LAYERS = 2
PATCH_SIZE, POOLING_KERNEL, MAX_SOFT_TOKENS = 4, 3, 70  # <= 70 soft tokens per image (630 patches)
PLE_DIM = 8  # hidden_size_per_layer_input


def gemma4_tokenizer(vocab_size: int, chat_template: str) -> PreTrainedTokenizerFast:
    tok = PreTrainedTokenizerFast(
        tokenizer_object=train_bpe(vocab_size, GEMMA4_SPECIAL_TOKENS),
        bos_token="<bos>",
        eos_token="<eos>",
        pad_token="<pad>",
        unk_token="<unk>",
        extra_special_tokens={
            "boi_token": BOI,
            "eoi_token": EOI,
            "image_token": IMAGE,
            "boa_token": BOA,
            "eoa_token": EOA,
            "audio_token": AUDIO,
        },
        clean_up_tokenization_spaces=False,
        model_max_length=32768,
    )
    tok.add_special_tokens({"additional_special_tokens": ["<|turn>", "<turn|>", VIDEO]})
    tok.chat_template = chat_template
    return tok


def layer_types(num_layers: int) -> list[str]:
    """Mostly sliding, every third layer full, the last one full (as HF requires): 5 -> S F S S F."""
    types = ["full_attention" if i % 3 == 1 else "sliding_attention" for i in range(num_layers)]
    types[-1] = "full_attention"
    return types


def build_gemma4(size: ModelSize, tok: PreTrainedTokenizerFast, variant: str = "base") -> BuiltModel:
    from transformers import Gemma4Config, Gemma4ForConditionalGeneration

    if variant not in VARIANTS:
        raise ValueError(f"unknown gemma4 variant {variant!r}; choose one of {', '.join(VARIANTS)}")
    ids = {t: tok.convert_tokens_to_ids(t) for t in GEMMA4_SPECIAL_TOKENS}
    num_layers = max(size.num_layers, 5)
    head_dim = size.hidden_size // size.num_heads
    text: dict[str, object] = {
        "vocab_size": size.vocab_size,
        "hidden_size": size.hidden_size,
        "intermediate_size": size.intermediate_size,
        "num_hidden_layers": num_layers,
        "num_attention_heads": size.num_heads,
        "num_key_value_heads": size.num_kv_heads,
        "head_dim": head_dim,
        "global_head_dim": 2 * head_dim,  # full layers: wider heads, as the released checkpoints
        "max_position_embeddings": size.max_position_embeddings,
        "sliding_window": SLIDING_WINDOW,
        "layer_types": layer_types(num_layers),
        "rope_parameters": {
            "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
            "full_attention": {
                "rope_type": "proportional",
                "partial_rotary_factor": 0.25,
                "rope_theta": 1000000.0,
            },
        },
        "rms_norm_eps": 1e-6,
        "final_logit_softcapping": 30.0,
        "use_bidirectional_attention": None if variant == "causal_vision" else "vision",
        "vocab_size_per_layer_input": size.vocab_size,
        "hidden_size_per_layer_input": PLE_DIM,
        "num_kv_shared_layers": 0 if variant == "unshared" else NUM_KV_SHARED_LAYERS,
        "use_double_wide_mlp": True,
        "bos_token_id": ids["<bos>"],
        "eos_token_id": [ids["<eos>"], ids["<turn|>"]],
        "pad_token_id": ids["<pad>"],
        "tie_word_embeddings": False,
    }
    if variant == "k_eq_v":
        text.update(attention_k_eq_v=True, num_global_key_value_heads=1)
    if variant == "moe":
        text.update(
            enable_moe_block=True,
            num_experts=4,
            top_k_experts=2,
            moe_intermediate_size=size.intermediate_size // 2,
        )
    vision = {
        "hidden_size": size.vision_hidden_size,
        "intermediate_size": size.vision_intermediate_size,
        "num_hidden_layers": size.vision_depth,
        "num_attention_heads": size.vision_num_heads,
        "num_key_value_heads": size.vision_num_heads,
        "head_dim": size.vision_hidden_size // size.vision_num_heads,
        "patch_size": PATCH_SIZE,
        "pooling_kernel_size": POOLING_KERNEL,
        "position_embedding_size": 256,
        "rope_parameters": {"rope_type": "axial", "rope_theta": 100.0},
        "rms_norm_eps": 1e-6,
    }
    audio = {
        "hidden_size": size.vision_hidden_size,
        "num_hidden_layers": size.vision_depth,
        "num_attention_heads": size.vision_num_heads,
        "subsampling_conv_channels": [128, 4],  # HF sizes its projection as if [0] were the 128 mel bins
        "conv_kernel_size": 5,
        "attention_chunk_size": 12,
        "attention_context_left": 13,
        "attention_context_right": 0,
        "output_proj_dims": size.vision_hidden_size,
        "rms_norm_eps": 1e-6,
    }
    config = Gemma4Config(
        text_config=text,
        vision_config=vision,
        audio_config=audio,
        boi_token_id=ids[BOI],
        eoi_token_id=ids[EOI],
        image_token_id=ids[IMAGE],
        video_token_id=ids[VIDEO],
        boa_token_id=ids[BOA],
        eoa_token_index=ids[EOA],
        audio_token_id=ids[AUDIO],
        # Untied (released checkpoints tie them): with random weights a tied head makes greedy decoding
        # repeat the last token, which would hide errors; the loader ties when the config says so.
        tie_word_embeddings=False,
    )
    for key in ("bos_token_id", "eos_token_id", "pad_token_id"):
        setattr(config, key, text[key])
    config.architectures = ["Gemma4ForConditionalGeneration"]
    return config, Gemma4ForConditionalGeneration


def save_gemma4_processor(out: str, tok: PreTrainedTokenizerFast, chat_template: str) -> None:
    from transformers import (
        Gemma4AudioFeatureExtractor,
        Gemma4ImageProcessor,
        Gemma4Processor,
        Gemma4VideoProcessor,
    )

    vision = {
        "patch_size": PATCH_SIZE,
        "pooling_kernel_size": POOLING_KERNEL,
        "max_soft_tokens": MAX_SOFT_TOKENS,
    }
    proc = Gemma4Processor(
        feature_extractor=Gemma4AudioFeatureExtractor(),
        image_processor=Gemma4ImageProcessor(**vision),
        tokenizer=tok,
        video_processor=Gemma4VideoProcessor(**vision),
        chat_template=chat_template,
        image_seq_length=MAX_SOFT_TOKENS,
    )
    proc.save_pretrained(out)
