"""The tiny Gemma 4 is a real HF model directory: transformers loads, processes and generates offline
(image, audio and text in one request); its decoder mixes sliding and full layers, has per-layer
embeddings and two KV-shared layers, and its variants turn on ``attention_k_eq_v`` and the MoE block."""

from __future__ import annotations

import json

import pytest
from PIL import Image
from transformers import AutoProcessor, Gemma4ForConditionalGeneration

from cluster.tiny_model import make_tiny_model
from tests.media import make_audio_array, make_image_array
from tests.tiny_dirs import tiny_model_dir


def test_config_has_every_feature() -> None:
    cfg = json.loads((tiny_model_dir("gemma4") / "config.json").read_text())
    assert (cfg["model_type"], cfg["architectures"]) == ("gemma4", ["Gemma4ForConditionalGeneration"])
    text = cfg["text_config"]
    s, f = "sliding_attention", "full_attention"
    assert text["layer_types"] == [s, f, s, s, f]
    assert text["num_kv_shared_layers"] == 2 and text["hidden_size_per_layer_input"] > 0
    assert text["sliding_window"] == 8 and text["use_bidirectional_attention"] == "vision"
    assert {v["head_dim"] for v in text["per_layer_config"].values()} == {2 * text["head_dim"]}
    assert cfg["vision_config"]["pooling_kernel_size"] == 3 and cfg["audio_config"]["num_hidden_layers"] == 2
    assert not text["attention_k_eq_v"] and not text["enable_moe_block"]


def test_variants() -> None:
    keqv = json.loads((tiny_model_dir("gemma4", "k_eq_v") / "config.json").read_text())["text_config"]
    assert keqv["attention_k_eq_v"] and keqv["per_layer_config"]["1"]["num_key_value_heads"] == 1
    moe = json.loads((tiny_model_dir("gemma4", "moe") / "config.json").read_text())["text_config"]
    assert moe["enable_moe_block"] and (moe["num_experts"], moe["top_k_experts"]) == (4, 2)
    unshared = json.loads((tiny_model_dir("gemma4", "unshared") / "config.json").read_text())["text_config"]
    assert unshared["num_kv_shared_layers"] == 0
    with pytest.raises(ValueError, match="unknown gemma4 variant"):
        make_tiny_model("/nonexistent", "gemma4", variant="dense")
    with pytest.raises(ValueError, match="has no variants"):
        make_tiny_model("/nonexistent", "gemma3", variant="moe")


@pytest.mark.parametrize("variant", ["base", "k_eq_v", "moe"])
def test_hf_processes_and_generates_offline(variant: str) -> None:
    model_dir = tiny_model_dir("gemma4", variant)
    proc = AutoProcessor.from_pretrained(model_dir)
    assert type(proc).__name__ == "Gemma4Processor"
    model = Gemma4ForConditionalGeneration.from_pretrained(model_dir).eval()
    lm = model.model.language_model
    assert [layer.self_attn.is_kv_shared_layer for layer in lm.layers] == [False] * 3 + [True] * 2
    images = [Image.fromarray(make_image_array(w, h, s)) for w, h, s in [(64, 48, 1), (90, 120, 2)]]
    content = [{"type": "image"}, {"type": "image"}, {"type": "audio"}, {"type": "text", "text": "Compare."}]
    text = proc.apply_chat_template([{"role": "user", "content": content}], add_generation_prompt=True)
    assert text.startswith("<bos><|turn>user\n<|image|><|image|><|audio|>Compare.")
    inputs = proc(text=[text], images=images, audio=[make_audio_array(1.5)], return_tensors="pt")
    ids = inputs["input_ids"][0]
    n_image = int((ids == model.config.image_token_id).sum())
    # 64x48 -> 108x84 pixels (multiples of 4 x 3, <= 630 patches of 4x4): 27x21 patches, 63 after 3x3
    # pooling; 90x120 -> 84x108, 63 too
    assert n_image == 2 * 63
    assert int((ids == model.config.audio_token_id).sum()) == 38  # 1.5 s: 150 mel frames / 4
    out = model.generate(**inputs, max_new_tokens=4, do_sample=False)
    assert out.shape[1] == ids.shape[0] + 4


def test_largest_item_is_a_30_s_clip() -> None:
    """Images pool to at most max_soft_tokens (70 here); a clip to at most 750 (30 s, 40 ms each)."""
    from encoder_service.families import largest_item_embeds
    from encoder_service.preprocess.media import MediaLimits

    assert largest_item_embeds(tiny_model_dir("gemma4"), None, MediaLimits()) == 750
    assert largest_item_embeds(None, "gemma4", MediaLimits()) == 750
