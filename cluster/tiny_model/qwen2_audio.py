"""The tiny Qwen2-Audio: a Whisper-style audio encoder behind a Qwen2 decoder (1-D RoPE), the
Qwen2-style tokenizer with the audio chat template, and Whisper's feature extractor at 128 mel bins."""

from __future__ import annotations

from typing import TYPE_CHECKING

from cluster.tiny_model.qwen_vl import qwen2_text_config, qwen_token_ids

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerFast

    from cluster.tiny_model.families import BuiltModel, ModelSize


def build_qwen2_audio(size: ModelSize, tok: PreTrainedTokenizerFast) -> BuiltModel:
    from transformers import Qwen2AudioConfig, Qwen2AudioForConditionalGeneration

    ids = qwen_token_ids(tok)
    text = qwen2_text_config(size, ids["<|endoftext|>"], ids["<|im_end|>"], ids["<|endoftext|>"])
    text["model_type"] = "qwen2"
    text["rope_parameters"] = {"rope_type": "default", "rope_theta": 1000000.0}
    audio = {
        "d_model": size.vision_hidden_size,
        "encoder_layers": size.vision_depth,
        "encoder_attention_heads": size.vision_num_heads,
        "encoder_ffn_dim": size.vision_intermediate_size,
        "num_mel_bins": 128,
        "max_source_positions": 1500,
    }
    config = Qwen2AudioConfig(
        audio_config=audio,
        text_config=text,
        audio_token_index=ids["<|AUDIO|>"],
        bos_token_id=text["bos_token_id"],
        eos_token_id=text["eos_token_id"],
        pad_token_id=text["pad_token_id"],
    )
    config.architectures = ["Qwen2AudioForConditionalGeneration"]
    return config, Qwen2AudioForConditionalGeneration


def save_qwen2_audio_processor(out: str, tok: PreTrainedTokenizerFast, chat_template: str) -> None:
    from transformers import Qwen2AudioProcessor, WhisperFeatureExtractor

    proc = Qwen2AudioProcessor(
        feature_extractor=WhisperFeatureExtractor(feature_size=128),
        tokenizer=tok,
        chat_template=chat_template,
    )
    proc.save_pretrained(out)
