"""The tiny models are real HF model directories: transformers itself loads, processes and generates."""

from __future__ import annotations

import hashlib
import io
from pathlib import Path

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from PIL import Image
from transformers import (
    AutoProcessor,
    AutoTokenizer,
    Qwen2AudioForConditionalGeneration,
    Qwen2VLForConditionalGeneration,
)

from cluster.cli import main as cli_main
from cluster.tiny_model import PRESETS, ModelSize, make_tiny_model
from tests.media import make_audio_array, make_image_bytes, make_video_bytes


def _sha(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def _decode_video(data: bytes) -> np.ndarray:
    import av

    with av.open(io.BytesIO(data)) as c:
        return np.stack([f.to_ndarray(format="rgb24") for f in c.decode(video=0)])


def test_qwen2_vl_image_placeholders_and_generate(tiny_vl_dir: Path) -> None:
    proc = AutoProcessor.from_pretrained(tiny_vl_dir)
    model = Qwen2VLForConditionalGeneration.from_pretrained(tiny_vl_dir).eval()
    images = [
        Image.open(io.BytesIO(make_image_bytes(w, h, fmt)))
        for w, h, fmt in [(64, 48, "PNG"), (120, 90, "JPEG")]
    ]
    msgs = [
        {
            "role": "user",
            "content": [{"type": "image"}, {"type": "image"}, {"type": "text", "text": "Compare."}],
        }
    ]
    text = proc.apply_chat_template(msgs, add_generation_prompt=True)
    inputs = proc(text=[text], images=images, return_tensors="pt")
    # Qwen2-VL: one embedding per 28x28 pixels after the 2x2 merge, images resized to multiples of 28.
    expected = [round(h / 28) * round(w / 28) for w, h in [(64, 48), (120, 90)]]
    grid = inputs["image_grid_thw"]
    assert [int(t * h * w // 4) for t, h, w in grid] == expected
    assert int((inputs["input_ids"] == model.config.image_token_id).sum()) == sum(expected)
    out = model.generate(**inputs, max_new_tokens=8, do_sample=False)
    assert out.shape[1] == inputs["input_ids"].shape[1] + 8


def test_qwen2_vl_video_placeholders_and_generate(tiny_vl_dir: Path) -> None:
    proc = AutoProcessor.from_pretrained(tiny_vl_dir)
    model = Qwen2VLForConditionalGeneration.from_pretrained(tiny_vl_dir).eval()
    frames = _decode_video(make_video_bytes(width=112, height=84, num_frames=8))
    assert frames.shape == (8, 84, 112, 3)
    msgs = [{"role": "user", "content": [{"type": "video"}, {"type": "text", "text": "What happens?"}]}]
    text = proc.apply_chat_template(msgs, add_generation_prompt=True)
    inputs = proc(text=[text], videos=[frames], return_tensors="pt")
    t, h, w = (int(x) for x in inputs["video_grid_thw"][0])
    assert (t, h, w) == (8 // 2, 84 // 14, 112 // 14)  # temporal patch 2, spatial patch 14
    assert int((inputs["input_ids"] == model.config.video_token_id).sum()) == t * h * w // 4
    out = model.generate(**inputs, max_new_tokens=4, do_sample=False)
    assert out.shape[1] == inputs["input_ids"].shape[1] + 4


def test_qwen2_audio_placeholders_and_generate(tiny_audio_dir: Path) -> None:
    proc = AutoProcessor.from_pretrained(tiny_audio_dir)
    model = Qwen2AudioForConditionalGeneration.from_pretrained(tiny_audio_dir).eval()
    audio = make_audio_array(seconds=2.0)
    msgs = [{"role": "user", "content": [{"type": "audio"}, {"type": "text", "text": "Transcribe."}]}]
    text = proc.apply_chat_template(msgs, add_generation_prompt=True)
    inputs = proc(text=[text], audio=[audio], sampling_rate=16000, return_tensors="pt")
    # Whisper: 100 mel frames per second; conv stride 2 then avg-pool 2 -> 25 embeddings per second.
    frames = int(inputs["feature_attention_mask"].sum())
    assert frames == 200
    expected = ((frames - 1) // 2 + 1 - 2) // 2 + 1
    assert expected == 50
    assert int((inputs["input_ids"] == model.config.audio_token_index).sum()) == expected
    out = model.generate(**inputs, max_new_tokens=4, do_sample=False)
    assert out.shape[1] == inputs["input_ids"].shape[1] + 4


def test_same_flags_byte_identical_and_seeds_differ(tmp_path: Path) -> None:
    size = ModelSize(seed=7)
    a = make_tiny_model(tmp_path / "a", "qwen2-audio", size)
    b = make_tiny_model(tmp_path / "b", "qwen2-audio", size)
    c = make_tiny_model(tmp_path / "c", "qwen2-audio", ModelSize(seed=8))
    for name in ("model.safetensors", "tokenizer.json", "config.json"):
        assert _sha(a / name) == _sha(b / name), name
    assert _sha(a / "model.safetensors") != _sha(c / "model.safetensors")
    assert _sha(a / "tokenizer.json") == _sha(c / "tokenizer.json")


def test_cli_writes_a_loadable_model_with_flag_sizes(tmp_path: Path) -> None:
    out = tmp_path / "m"
    argv = [
        str(out),
        "--family",
        "qwen2-vl",
        "--hidden-size",
        "96",
        "--num-heads",
        "6",
        "--num-kv-heads",
        "2",
    ]
    assert cli_main(["make-tiny-model", *argv]) == 0
    model = Qwen2VLForConditionalGeneration.from_pretrained(out)
    assert model.config.text_config.hidden_size == 96
    assert model.config.text_config.num_attention_heads == 6
    with pytest.raises(ValueError, match="divide"):
        make_tiny_model(tmp_path / "bad", "qwen2-vl", ModelSize(hidden_size=100, num_heads=3))


def test_presets_sizes() -> None:
    # The small preset is what benchmarks use: its parameter count is tens of millions.
    def params(size: ModelSize) -> int:
        h, i, v = size.hidden_size, size.intermediate_size, size.vocab_size
        kv = size.num_kv_heads * (h // size.num_heads)
        layer = h * h * 2 + h * kv * 2 + 3 * h * i
        return size.num_layers * layer + 2 * v * h

    assert 10_000_000 < params(PRESETS["small"]) < 100_000_000
    assert params(PRESETS["tiny"]) < 1_000_000


@pytest.fixture(scope="module")
def tokenizer(tiny_vl_dir: Path):  # type: ignore[no-untyped-def]
    return AutoTokenizer.from_pretrained(tiny_vl_dir)


@settings(max_examples=200, deadline=None)
@given(text=st.text(alphabet=st.characters(blacklist_categories=("Cs",)), max_size=200))
def test_tokenizer_round_trips_utf8(tokenizer, text: str) -> None:  # type: ignore[no-untyped-def]
    ids = tokenizer.encode(text, add_special_tokens=False)
    assert tokenizer.decode(ids) == text


def test_special_tokens_are_single_ids(tokenizer) -> None:  # type: ignore[no-untyped-def]
    for tok in (
        "<|im_start|>",
        "<|vision_start|>",
        "<|image_pad|>",
        "<|video_pad|>",
        "<|audio_bos|>",
        "<|AUDIO|>",
    ):
        ids = tokenizer.encode(tok, add_special_tokens=False)
        assert len(ids) == 1 and tokenizer.convert_ids_to_tokens(ids[0]) == tok
    assert torch.tensor(tokenizer.encode("hello")).dtype == torch.int64
