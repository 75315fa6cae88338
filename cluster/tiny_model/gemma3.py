"""The tiny Gemma 3: SigLIP tower + average-pooling projector + a Gemma 3 decoder whose layers mix
sliding-window (local) and global attention, with Gemma's own special tokens and chat template.

The sliding window is 8 tokens, so every test prompt runs past it; the layer pattern alternates
local and global layers, each with its own RoPE base (local: 10,000, default; global: 1,000,000
with linear scaling 8, as the 4B+ checkpoints).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from transformers import PreTrainedTokenizerFast

from cluster.tiny_model.tokenizer import train_bpe

if TYPE_CHECKING:
    from cluster.tiny_model.families import BuiltModel, ModelSize

GEMMA3_SPECIAL_TOKENS = [
    "<pad>",
    "<eos>",
    "<bos>",
    "<unk>",
    "<start_of_turn>",
    "<end_of_turn>",
    "<start_of_image>",
    "<end_of_image>",
    "<image_soft_token>",
]

# Gemma 3's released template, shortened: system text joins the first user turn, images are
# <start_of_image> (the processor widens each to its soft tokens), the assistant is "model".
GEMMA3_CHAT_TEMPLATE = (
    "{{ bos_token }}{% if messages[0]['role'] == 'system' %}"
    "{% if messages[0]['content'] is string %}{% set first_user_prefix = messages[0]['content'] + '\n\n' %}"
    "{% else %}{% set first_user_prefix = messages[0]['content'][0]['text'] + '\n\n' %}{% endif %}"
    "{% set loop_messages = messages[1:] %}{% else %}{% set first_user_prefix = '' %}"
    "{% set loop_messages = messages %}{% endif %}"
    "{% for message in loop_messages %}"
    "{% set role = 'model' if message['role'] == 'assistant' else message['role'] %}"
    "<start_of_turn>{{ role }}\n{{ first_user_prefix if loop.first else '' }}"
    "{% if message['content'] is string %}{{ message['content'] | trim }}"
    "{% else %}{% for item in message['content'] %}"
    "{% if item['type'] == 'image' or 'image' in item or 'image_url' in item %}<start_of_image>"
    "{% elif item['type'] == 'text' %}{{ item['text'] | trim }}{% endif %}{% endfor %}{% endif %}"
    "<end_of_turn>\n{% endfor %}{% if add_generation_prompt %}<start_of_turn>model\n{% endif %}"
)

SLIDING_WINDOW = 8
IMAGE_SIZE, PATCH_SIZE, TOKENS_PER_IMAGE = 64, 8, 16  # 8x8 patches pooled 2x2 -> 16 soft tokens


def gemma3_tokenizer(vocab_size: int, chat_template: str) -> PreTrainedTokenizerFast:
    tok = PreTrainedTokenizerFast(
        tokenizer_object=train_bpe(vocab_size, GEMMA3_SPECIAL_TOKENS),
        bos_token="<bos>",
        eos_token="<eos>",
        pad_token="<pad>",
        unk_token="<unk>",
        extra_special_tokens={
            "boi_token": "<start_of_image>",
            "eoi_token": "<end_of_image>",
            "image_token": "<image_soft_token>",
        },
        clean_up_tokenization_spaces=False,
        model_max_length=32768,
    )
    tok.add_special_tokens({"additional_special_tokens": ["<start_of_turn>", "<end_of_turn>"]})
    tok.chat_template = chat_template
    return tok


def layer_types(num_layers: int) -> list[str]:
    """Local and global layers alternate (the released checkpoints: five local, then one global)."""
    return ["sliding_attention" if i % 2 == 0 else "full_attention" for i in range(num_layers)]


def build_gemma3(size: ModelSize, tok: PreTrainedTokenizerFast) -> BuiltModel:
    from transformers import Gemma3Config, Gemma3ForConditionalGeneration

    ids = {t: tok.convert_tokens_to_ids(t) for t in GEMMA3_SPECIAL_TOKENS}
    head_dim = size.hidden_size // size.num_heads
    text = {
        "vocab_size": size.vocab_size,
        "hidden_size": size.hidden_size,
        "intermediate_size": size.intermediate_size,
        "num_hidden_layers": size.num_layers,
        "num_attention_heads": size.num_heads,
        "num_key_value_heads": size.num_kv_heads,
        "head_dim": head_dim,
        "query_pre_attn_scalar": head_dim,
        "max_position_embeddings": size.max_position_embeddings,
        "sliding_window": SLIDING_WINDOW,
        "layer_types": layer_types(size.num_layers),
        "rope_parameters": {
            "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
            "full_attention": {"rope_type": "linear", "factor": 8.0, "rope_theta": 1000000.0},
        },
        "rms_norm_eps": 1e-6,
        "bos_token_id": ids["<bos>"],
        "eos_token_id": [ids["<eos>"], ids["<end_of_turn>"]],
        "pad_token_id": ids["<pad>"],
        "tie_word_embeddings": False,
    }
    vision = {
        "model_type": "siglip_vision_model",
        "hidden_size": size.vision_hidden_size,
        "intermediate_size": size.vision_intermediate_size,
        "num_hidden_layers": size.vision_depth,
        "num_attention_heads": size.vision_num_heads,
        "image_size": IMAGE_SIZE,
        "patch_size": PATCH_SIZE,
        "layer_norm_eps": 1e-6,
        "vision_use_head": False,
    }
    config = Gemma3Config(
        text_config=text,
        vision_config=vision,
        mm_tokens_per_image=TOKENS_PER_IMAGE,
        boi_token_index=ids["<start_of_image>"],
        eoi_token_index=ids["<end_of_image>"],
        image_token_index=ids["<image_soft_token>"],
        # Untied (released checkpoints tie them): with random weights a tied head makes greedy decoding
        # repeat the last token, which would hide errors; the loader ties when the config says so.
        tie_word_embeddings=False,
    )
    for key in ("bos_token_id", "eos_token_id", "pad_token_id"):
        setattr(config, key, text[key])
    config.architectures = ["Gemma3ForConditionalGeneration"]
    return config, Gemma3ForConditionalGeneration


def save_gemma3_processor(out: str, tok: PreTrainedTokenizerFast, chat_template: str) -> None:
    from transformers import Gemma3ImageProcessor, Gemma3Processor

    image = Gemma3ImageProcessor(
        size={"height": IMAGE_SIZE, "width": IMAGE_SIZE},
        image_mean=[0.5, 0.5, 0.5],
        image_std=[0.5, 0.5, 0.5],
        do_pan_and_scan=False,
    )
    proc = Gemma3Processor(
        image_processor=image,
        tokenizer=tok,
        chat_template=chat_template,
        image_seq_length=TOKENS_PER_IMAGE,
    )
    proc.save_pretrained(out)
