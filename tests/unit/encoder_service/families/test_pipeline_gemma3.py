"""Gemma 3 through mmserve's own pieces, no Ray: preprocessor (template, soft-token expansion) ->
encoder runner (our SigLIP tower + pooling projector) -> LLMEngine (our decoder, bidirectional image
spans), against transformers' processor + generate on the same images. Greedy tokens must agree."""

from __future__ import annotations

import io
from pathlib import Path

import pytest
import torch
from PIL import Image

from encoder_service.encode.runner import EncoderRunner
from encoder_service.preprocess.media import MediaLimits
from encoder_service.preprocess.processing import Preprocessor
from encoder_service.preprocess.processors.gemma3 import Gemma3Family
from encoder_service.types import MediaRef
from llm_service.config import EngineConfig
from llm_service.engine import LLMEngine
from llm_service.multimodal import MultiModalInput
from llm_service.outputs import GenerateRequest
from llm_service.sampling_params import SamplingParams
from tests.media import make_image_bytes
from tests.tiny_dirs import tiny_model_dir

N = 10


@pytest.fixture(scope="module")
def model_dir() -> Path:
    return tiny_model_dir("gemma3")


def test_preprocess_encode_generate_equals_hf(model_dir: Path) -> None:
    from transformers import Gemma3ForConditionalGeneration

    torch.set_num_threads(1)
    images = [make_image_bytes(300, 200, seed=3), make_image_bytes(50, 90, seed=4)]
    msgs = [
        {"role": "system", "content": "Be brief."},
        {
            "role": "user",
            "content": [
                {"type": "image", "media": MediaRef("image", data=images[0])},
                {"type": "text", "text": "and then"},
                {"type": "image", "media": MediaRef("image", data=images[1])},
                {"type": "text", "text": "what changed?"},
            ],
        },
    ]
    pre = Preprocessor(model_dir, MediaLimits(), {"image": 2})
    out = pre.preprocess_sync(msgs)
    assert isinstance(pre.family, Gemma3Family)
    assert [(it.placeholder.length, it.grid_thw) for it in out.items] == [(16, None), (16, None)]
    runner = EncoderRunner(model_dir, device="cpu")
    inputs_ = [it.data for it in out.items]
    assert all(i is not None for i in inputs_)
    embeds = runner.encode(inputs_)  # type: ignore[arg-type]
    mm = [
        MultiModalInput.of(e, it.placeholder.offset, it.mm_hash, it.modality)
        for it, e in zip(out.items, embeds, strict=True)
    ]
    engine = LLMEngine(EngineConfig(model=str(model_dir), block_size=4, num_kv_blocks=256))
    (ours,) = engine.generate([GenerateRequest(out.prompt_token_ids, SamplingParams(max_tokens=N), mm)])

    hf = Gemma3ForConditionalGeneration.from_pretrained(model_dir).eval()
    proc = pre.family.hf
    content = [{"type": "image"}, {"type": "text", "text": "and then"}, {"type": "image"}]
    content.append({"type": "text", "text": "what changed?"})
    hf_msgs = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": content}]
    text = proc.apply_chat_template(hf_msgs, add_generation_prompt=True)
    pil = [Image.open(io.BytesIO(b)).convert("RGB") for b in images]
    inputs = proc(text=[text], images=pil, return_tensors="pt")
    assert inputs["input_ids"][0].tolist() == out.prompt_token_ids
    with torch.no_grad():
        ref_embeds = hf.model.get_image_features(pixel_values=inputs["pixel_values"]).pooler_output
        ref = hf.generate(**inputs, max_new_tokens=N, do_sample=False)[0, len(out.prompt_token_ids) :]
    for ours_e, ref_e in zip(embeds, ref_embeds, strict=True):
        torch.testing.assert_close(ours_e, ref_e, atol=1e-5, rtol=1e-5)
    assert ours.token_ids == ref.tolist()
