"""The tiny Qwen3.5 is a real HF model directory: transformers loads, processes and generates offline,
with both decoder layer kinds and a vision tower without DeepStack."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image
from transformers import AutoProcessor, Qwen3_5ForConditionalGeneration

from cluster.tiny_model import FAMILIES
from tests.media import make_image_array
from tests.tiny_dirs import tiny_model_dir


@pytest.fixture(scope="module")
def model_dir() -> Path:
    return tiny_model_dir("qwen3.5")


def test_config_is_a_hybrid_qwen3_5(model_dir: Path) -> None:
    cfg = json.loads((model_dir / "config.json").read_text())
    assert "qwen3.5" in FAMILIES
    assert (cfg["model_type"], cfg["architectures"]) == ("qwen3_5", ["Qwen3_5ForConditionalGeneration"])
    text = cfg["text_config"]
    assert text["layer_types"] == ["linear_attention"] * 3 + ["full_attention"]
    assert (text["linear_num_key_heads"], text["linear_num_value_heads"]) == (2, 4)  # grouped values
    rope = text["rope_parameters"]
    assert (rope["partial_rotary_factor"], rope["mrope_section"], text["head_dim"]) == (0.25, [2, 1, 1], 32)
    assert "deepstack_visual_indexes" not in cfg["vision_config"]


def test_hf_processes_and_generates_offline(model_dir: Path) -> None:
    proc = AutoProcessor.from_pretrained(model_dir)
    assert type(proc).__name__ == "Qwen3VLProcessor"
    model = Qwen3_5ForConditionalGeneration.from_pretrained(model_dir).eval()
    layers = model.model.language_model.layers
    kinds = [type(getattr(layer, "linear_attn", None) or layer.self_attn).__name__ for layer in layers]
    assert kinds == ["Qwen3_5GatedDeltaNet"] * 3 + ["Qwen3_5Attention"]
    images = [Image.fromarray(make_image_array(w, h, s)) for w, h, s in [(64, 64, 1), (300, 200, 2)]]
    content = [{"type": "image"}, {"type": "image"}, {"type": "text", "text": "Compare."}]
    text = proc.apply_chat_template([{"role": "user", "content": content}], add_generation_prompt=True)
    inputs = proc(text=[text], images=images, return_tensors="pt")
    # patch 16, 2x2 merge: one embedding per 32x32 pixels after resizing to multiples of 32
    assert [int(g.prod()) // 4 for g in inputs["image_grid_thw"]] == [4, 54]
    out = model.generate(**inputs, max_new_tokens=6, do_sample=False)
    assert out.shape[1] == inputs["input_ids"].shape[1] + 6
    with torch.no_grad():  # one merger, no DeepStack: rows are the LLM's width
        feats = model.model.get_image_features(inputs["pixel_values"], inputs["image_grid_thw"])
    assert [tuple(f.shape) for f in feats.pooler_output] == [(4, 64), (54, 64)]
    video = np.stack([make_image_array(96, 64, 10 + i) for i in range(4)])
    v_text = ["<|vision_start|><|video_pad|><|vision_end|> what"]
    v_inputs = proc(text=v_text, videos=[video], return_tensors="pt", do_sample_frames=False)
    assert v_inputs["video_grid_thw"][0].tolist() == [2, 4, 6]
