"""The encoder-heavy preset: the tiny Qwen2-VL LLM behind a deep, wide vision tower. Its directory is
the same bytes on every build, transformers loads it, and mmserve's own pieces (preprocessor -> our
tower -> LLMEngine, no Ray) answer one image greedily exactly as transformers does."""

from __future__ import annotations

import hashlib
import io
from pathlib import Path
from typing import Any

import pytest
import torch
from PIL import Image

from cluster.cli import main as cli_main
from cluster.tiny_model import PRESETS, make_tiny_model
from encoder_service.encode.runner import EncoderRunner
from encoder_service.preprocess.processing import Preprocessor
from encoder_service.types import MediaRef
from llm_service.multimodal import MultiModalInput
from llm_service.outputs import GenerateRequest
from tests.media import make_image_bytes
from tests.unit.llm_service.hf_ref import GREEDY, N, capture_lm_inputs, engine, hf_model

HEAVY = PRESETS["encoder-heavy"]


def _digests(model_dir: Path) -> dict[str, str]:
    return {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(model_dir.iterdir())}


@pytest.fixture(scope="module")
def heavy_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("encoder-heavy") / "model"
    argv = ["make-tiny-model", str(out), "--family", "qwen2-vl", "--preset", "encoder-heavy"]
    assert cli_main(argv) == 0  # the documented command
    return out


@pytest.fixture(scope="module")
def hf(heavy_dir: Path) -> tuple[Any, Any]:
    return hf_model(heavy_dir)


def test_two_builds_are_byte_identical(heavy_dir: Path, tmp_path: Path) -> None:
    again = make_tiny_model(tmp_path / "again", "qwen2-vl", HEAVY)
    first = _digests(heavy_dir)
    assert {"config.json", "model.safetensors", "tokenizer.json", "processor_config.json"} <= set(first)
    assert _digests(again) == first


def test_a_deep_wide_tower_before_the_tiny_llm(hf: tuple[Any, Any]) -> None:
    model, _ = hf
    vision, text = model.config.vision_config, model.config.text_config
    assert (vision.depth, vision.embed_dim, vision.num_heads) == (
        HEAVY.vision_depth,
        HEAVY.vision_hidden_size,
        HEAVY.vision_num_heads,
    )
    assert (text.hidden_size, text.num_hidden_layers, text.num_attention_heads) == (
        HEAVY.hidden_size,
        HEAVY.num_layers,
        HEAVY.num_heads,
    )
    assert text.hidden_size // text.num_attention_heads == 32  # vLLM's CPU attention takes no narrower
    tower = sum(p.numel() for p in model.model.visual.parameters())
    rest = sum(p.numel() for p in model.parameters()) - tower
    assert tower > 25 * rest  # the tower is the model; the LLM stays tiny


def test_one_image_through_our_tower_and_engine_equals_hf(heavy_dir: Path, hf: tuple[Any, Any]) -> None:
    model, proc = hf
    data = make_image_bytes(224, 168, seed=5)
    msgs = [
        {
            "role": "user",
            "content": [
                {"type": "image", "media": MediaRef("image", data=data)},
                {"type": "text", "text": "describe it"},
            ],
        }
    ]
    out = Preprocessor(heavy_dir, None, {"image": 1}).preprocess_sync(msgs)
    (item,) = out.items
    assert item.data is not None
    (emb,) = EncoderRunner(heavy_dir, device="cpu").encode([item.data])
    assert emb.shape[0] == (224 // 28) * (168 // 28)

    content = [{"type": "image"}, {"type": "text", "text": "describe it"}]
    text = proc.apply_chat_template([{"role": "user", "content": content}], add_generation_prompt=True)
    image = Image.open(io.BytesIO(data)).convert("RGB")
    inputs = dict(proc(text=[text], images=[image], return_tensors="pt"))
    assert inputs["input_ids"][0].tolist() == out.prompt_token_ids
    rows = slice(item.placeholder.offset, item.placeholder.offset + emb.shape[0])
    ref_emb = capture_lm_inputs(model, inputs)[rows]
    torch.testing.assert_close(emb, ref_emb, rtol=1e-4, atol=1e-4)  # 1e-5-scale drift over the tower

    mm = [MultiModalInput.of(emb, item.placeholder.offset, item.mm_hash, item.modality, item.grid_thw)]
    (ours,) = engine(heavy_dir).generate([GenerateRequest(out.prompt_token_ids, GREEDY, mm)])
    with torch.no_grad():
        ref = model.generate(**inputs, max_new_tokens=N, do_sample=False)[0, len(out.prompt_token_ids) :]
    assert len(ref) == N and ours.token_ids == ref.tolist()
