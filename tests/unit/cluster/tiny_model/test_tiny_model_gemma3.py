"""The tiny Gemma 3 is a real HF model directory: transformers loads, processes and generates offline;
its layers mix sliding-window and global attention and its window is shorter than any test prompt."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from PIL import Image
from transformers import AutoProcessor, Gemma3ForConditionalGeneration

from tests.media import make_image_array
from tests.tiny_dirs import tiny_model_dir


@pytest.fixture(scope="module")
def model_dir() -> Path:
    return tiny_model_dir("gemma3")


def test_config_mixes_local_and_global_layers(model_dir: Path) -> None:
    cfg = json.loads((model_dir / "config.json").read_text())
    assert (cfg["model_type"], cfg["architectures"]) == ("gemma3", ["Gemma3ForConditionalGeneration"])
    text = cfg["text_config"]
    assert text["layer_types"] == ["sliding_attention", "full_attention"] and text["sliding_window"] == 8
    rope = text["rope_parameters"]
    assert rope["sliding_attention"]["rope_theta"] != rope["full_attention"]["rope_theta"]
    assert cfg["vision_config"]["model_type"] == "siglip_vision_model" and cfg["mm_tokens_per_image"] == 16


def test_hf_processes_and_generates_offline(model_dir: Path) -> None:
    proc = AutoProcessor.from_pretrained(model_dir)
    assert type(proc).__name__ == "Gemma3Processor"
    model = Gemma3ForConditionalGeneration.from_pretrained(model_dir).eval()
    images = [Image.fromarray(make_image_array(w, h, s)) for w, h, s in [(64, 48, 1), (300, 200, 2)]]
    content = [{"type": "image"}, {"type": "image"}, {"type": "text", "text": "Compare."}]
    text = proc.apply_chat_template([{"role": "user", "content": content}], add_generation_prompt=True)
    assert text.startswith("<bos><start_of_turn>user\n<start_of_image><start_of_image>Compare.")
    inputs = proc(text=[text], images=images, return_tensors="pt")
    ids = inputs["input_ids"][0]
    assert int((ids == model.config.image_token_id).sum()) == 2 * 16
    assert torch.equal(inputs["token_type_ids"][0], (ids == model.config.image_token_id).long())
    assert tuple(inputs["pixel_values"].shape) == (2, 3, 64, 64)
    out = model.generate(**inputs, max_new_tokens=6, do_sample=False)
    assert out.shape[1] == ids.shape[0] + 6
