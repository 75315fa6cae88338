"""Gemma 4 through mmserve's own pieces, no Ray: preprocessor (template, soft-token expansion per image
size) -> encoder runner (our vision tower + pooler + embedder) -> LLMEngine (our decoder: PLE, shared
KV, bidirectional image spans on sliding layers), against transformers' processor + generate on the
same images. Greedy tokens must agree."""

from __future__ import annotations

import io
from pathlib import Path

import pytest
import torch
from PIL import Image

from encoder_service.media import MediaLimits
from encoder_service.processing import Preprocessor
from encoder_service.processors.gemma4 import Gemma4Family
from encoder_service.runner import EncoderRunner
from encoder_service.types import MediaRef
from llm_service.config import EngineConfig
from llm_service.engine import LLMEngine
from llm_service.multimodal import MultiModalInput
from llm_service.outputs import GenerateRequest
from llm_service.sampling_params import SamplingParams
from tests.media import make_image_bytes
from tests.unit.gemma4_dir import tiny_gemma4_dir

N = 10


@pytest.fixture(scope="module")
def model_dir() -> Path:
    return tiny_gemma4_dir()


@pytest.mark.parametrize("sizes", [[(300, 200)], [(300, 200), (50, 90)]], ids=["one-image", "two-images"])
def test_preprocess_encode_generate_equals_hf(model_dir: Path, sizes: list[tuple[int, int]]) -> None:
    from transformers import Gemma4ForConditionalGeneration

    torch.set_num_threads(1)
    images = [make_image_bytes(w, h, seed=3 + i) for i, (w, h) in enumerate(sizes)]
    content: list[dict] = []
    for data in images:
        content += [{"type": "image", "media": MediaRef("image", data=data)}, {"type": "text", "text": "and"}]
    content.append({"type": "text", "text": "what changed?"})
    pre = Preprocessor(model_dir, MediaLimits(), {"image": 2})
    out = pre.preprocess_sync([{"role": "user", "content": content}])
    assert isinstance(pre.family, Gemma4Family)
    runner = EncoderRunner(model_dir, device="cpu")
    inputs_ = [it.encoder_input for it in out.items]
    assert all(i is not None for i in inputs_)
    embeds = runner.encode(inputs_)  # type: ignore[arg-type]
    mm = [
        MultiModalInput(e, it.placeholder.offset, it.mm_hash, it.modality)
        for it, e in zip(out.items, embeds, strict=True)
    ]
    engine = LLMEngine(EngineConfig(model=str(model_dir), block_size=4, num_kv_blocks=256))
    (ours,) = engine.generate([GenerateRequest(out.prompt_token_ids, SamplingParams(max_tokens=N), mm)])

    hf = Gemma4ForConditionalGeneration.from_pretrained(model_dir).eval()
    proc = pre.family.hf
    hf_content: list[dict] = []
    for _ in images:
        hf_content += [{"type": "image"}, {"type": "text", "text": "and"}]
    hf_content.append({"type": "text", "text": "what changed?"})
    text = proc.apply_chat_template([{"role": "user", "content": hf_content}], add_generation_prompt=True)
    pil = [Image.open(io.BytesIO(b)).convert("RGB") for b in images]
    inputs = proc(text=[text], images=pil, return_tensors="pt")
    assert inputs["input_ids"][0].tolist() == out.prompt_token_ids  # the placeholder rule is HF's
    n_image = int((inputs["input_ids"][0] == hf.config.image_token_id).sum())
    assert sum(it.placeholder.length for it in out.items) == n_image
    with torch.no_grad():
        ref = hf.generate(**inputs, max_new_tokens=N, do_sample=False)[0, len(out.prompt_token_ids) :]
    assert ours.token_ids == ref.tolist()
