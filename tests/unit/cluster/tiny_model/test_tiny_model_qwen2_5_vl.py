"""The tiny Qwen2.5-VL is a real HF model directory: transformers loads, processes and generates offline."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image
from transformers import AutoProcessor, Qwen2_5_VLForConditionalGeneration

from cluster.tiny_model import FAMILIES
from tests.media import make_image_array
from tests.tiny_dirs import tiny_model_dir


@pytest.fixture(scope="module")
def model_dir() -> Path:
    return tiny_model_dir("qwen2.5-vl")


def test_config_is_qwen2_5_vl(model_dir: Path) -> None:
    cfg = json.loads((model_dir / "config.json").read_text())
    assert "qwen2.5-vl" in FAMILIES
    assert cfg["model_type"] == "qwen2_5_vl"
    assert cfg["architectures"] == ["Qwen2_5_VLForConditionalGeneration"]
    vc = cfg["vision_config"]
    assert (vc["depth"], vc["fullatt_block_indexes"], vc["window_size"]) == (2, [1], 112)
    assert (vc["hidden_size"], vc["out_hidden_size"], vc["tokens_per_second"]) == (32, 64, 2)
    assert cfg["text_config"]["rope_parameters"]["mrope_section"] == [2, 3, 3]


def test_norm_weights_are_not_all_one(model_dir: Path) -> None:
    """Qwen2.5-VL's tiny norms carry noise, so a norm weight loaded into the wrong place shows in tests."""
    from safetensors import safe_open

    with safe_open(str(model_dir / "model.safetensors"), "pt") as f:
        w = f.get_tensor("model.visual.blocks.0.norm1.weight")
    assert not torch.allclose(w, torch.ones_like(w)) and (w - 1).abs().max() < 1


def test_hf_processes_and_generates_offline(model_dir: Path) -> None:
    proc = AutoProcessor.from_pretrained(model_dir)
    assert type(proc).__name__ == "Qwen2_5_VLProcessor"
    model = Qwen2_5_VLForConditionalGeneration.from_pretrained(model_dir).eval()
    images = [Image.fromarray(make_image_array(w, h, s)) for w, h, s in [(64, 48, 1), (300, 200, 2)]]
    video = np.stack([make_image_array(84, 56, 10 + i) for i in range(4)])
    content = [{"type": "image"}, {"type": "image"}, {"type": "video"}, {"type": "text", "text": "Compare."}]
    text = proc.apply_chat_template([{"role": "user", "content": content}], add_generation_prompt=True)
    inputs = proc(text=[text], images=images, videos=[video], return_tensors="pt")
    # one embedding per 28x28 pixels after the 2x2 merge, sizes rounded to multiples of 28
    expected = [round(h / 28) * round(w / 28) for w, h in [(64, 48), (300, 200)]]
    assert [int(g.prod()) // 4 for g in inputs["image_grid_thw"]] == expected
    assert int((inputs["input_ids"] == model.config.image_token_id).sum()) == sum(expected)
    assert inputs["video_grid_thw"][0].tolist() == [2, 4, 6]
    assert int((inputs["input_ids"] == model.config.video_token_id).sum()) == 2 * 4 * 6 // 4
    out = model.generate(**inputs, max_new_tokens=6, do_sample=False)
    assert out.shape[1] == inputs["input_ids"].shape[1] + 6
