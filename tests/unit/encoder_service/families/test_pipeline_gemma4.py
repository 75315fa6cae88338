"""Gemma 4 through mmserve's own pieces, no Ray: preprocessor (template, soft-token expansion per image
size and per audio length) -> encoder runner (our vision tower + pooler, our conformer) -> LLMEngine
(our decoder: PLE, shared KV, bidirectional image spans on sliding layers), against transformers'
processor + generate on the same media. Greedy tokens must agree."""

from __future__ import annotations

import io
from pathlib import Path

import pytest
import soundfile as sf
import torch
from PIL import Image

from encoder_service.encode.runner import EncoderRunner
from encoder_service.preprocess.media import MediaLimits
from encoder_service.preprocess.processing import Preprocessor
from encoder_service.preprocess.processors.gemma4 import Gemma4Family
from encoder_service.types import MediaRef
from llm_service.config import EngineConfig
from llm_service.engine import LLMEngine
from llm_service.multimodal import MultiModalInput
from llm_service.outputs import GenerateRequest
from llm_service.sampling_params import SamplingParams
from tests.media import make_audio_bytes, make_image_bytes
from tests.tiny_dirs import tiny_model_dir

N = 10
CASES = {
    "one-image": [("image", (300, 200))],
    "two-images": [("image", (300, 200)), ("image", (50, 90))],
    "audio": [("audio", 1.3)],
    "image+audio": [("image", (120, 80)), ("audio", 0.9)],
}


@pytest.fixture(scope="module")
def model_dir() -> Path:
    return tiny_model_dir("gemma4")


@pytest.fixture(scope="module")
def parts(model_dir: Path):  # type: ignore[no-untyped-def]
    """One preprocessor, encoder runner, engine and HF model for every case."""
    from transformers import Gemma4ForConditionalGeneration

    torch.set_num_threads(1)
    pre = Preprocessor(model_dir, MediaLimits(), {"image": 2, "audio": 2})
    runner = EncoderRunner(model_dir, device="cpu")
    engine = LLMEngine(EngineConfig(model=str(model_dir), block_size=4, num_kv_blocks=256))
    return pre, runner, engine, Gemma4ForConditionalGeneration.from_pretrained(model_dir).eval()


def media_bytes(kind: str, spec, seed: int) -> bytes:  # type: ignore[no-untyped-def]
    return make_image_bytes(*spec, seed=seed) if kind == "image" else make_audio_bytes(spec, seed=seed)


@pytest.mark.parametrize("name", list(CASES))
def test_preprocess_encode_generate_equals_hf(parts, name: str) -> None:  # type: ignore[no-untyped-def]
    pre, runner, engine, hf = parts
    media = [(kind, media_bytes(kind, spec, 3 + i)) for i, (kind, spec) in enumerate(CASES[name])]
    content: list[dict] = []
    for kind, data in media:
        content += [{"type": kind, "media": MediaRef(kind, data=data)}, {"type": "text", "text": "and"}]  # type: ignore[arg-type]
    content.append({"type": "text", "text": "what changed?"})
    out = pre.preprocess_sync([{"role": "user", "content": content}])
    assert isinstance(pre.family, Gemma4Family)
    inputs_ = [it.data for it in out.items]
    assert all(i is not None for i in inputs_)
    embeds = runner.encode(inputs_)  # type: ignore[arg-type]
    mm = [
        MultiModalInput.of(e, it.placeholder.offset, it.mm_hash, it.modality)
        for it, e in zip(out.items, embeds, strict=True)
    ]
    (ours,) = engine.generate([GenerateRequest(out.prompt_token_ids, SamplingParams(max_tokens=N), mm)])

    proc = pre.family.hf
    hf_content: list[dict] = []
    for kind, _ in media:
        hf_content += [{"type": kind}, {"type": "text", "text": "and"}]
    hf_content.append({"type": "text", "text": "what changed?"})
    text = proc.apply_chat_template([{"role": "user", "content": hf_content}], add_generation_prompt=True)
    images = [Image.open(io.BytesIO(b)).convert("RGB") for k, b in media if k == "image"]
    audios = [sf.read(io.BytesIO(b), dtype="float32")[0] for k, b in media if k == "audio"]
    inputs = proc(text=[text], images=images or None, audio=audios or None, return_tensors="pt")
    assert inputs["input_ids"][0].tolist() == out.prompt_token_ids  # the placeholder rule is HF's
    for kind, tok in (("image", hf.config.image_token_id), ("audio", hf.config.audio_token_id)):
        n = int((inputs["input_ids"][0] == tok).sum())
        assert sum(it.placeholder.length for it in out.items if it.modality == kind) == n
    with torch.no_grad():
        ref = hf.generate(**inputs, max_new_tokens=N, do_sample=False)[0, len(out.prompt_token_ids) :]
    assert ours.token_ids == ref.tolist()


def test_multi_turn_chat_equals_hf(parts) -> None:  # type: ignore[no-untyped-def]
    """An image and a clip in the first user turn, the model's answer, a follow-up: same prompt ids and
    greedy answer as HF's template + processor + generate."""
    pre, runner, engine, hf = parts
    image, clip = make_image_bytes(90, 60, seed=8), make_audio_bytes(0.6, seed=9)
    first = [
        {"type": "image", "media": MediaRef("image", data=image)},
        {"type": "audio", "media": MediaRef("audio", data=clip)},
        {"type": "text", "text": "what are these?"},
    ]
    turns = [
        {"role": "assistant", "content": "a picture and a tone"},
        {"role": "user", "content": "which is louder?"},
    ]
    out = pre.preprocess_sync([{"role": "user", "content": first}, *turns])
    embeds = runner.encode([it.data for it in out.items])
    mm = [
        MultiModalInput.of(e, it.placeholder.offset, it.mm_hash, it.modality)
        for it, e in zip(out.items, embeds, strict=True)
    ]
    (ours,) = engine.generate([GenerateRequest(out.prompt_token_ids, SamplingParams(max_tokens=N), mm)])
    proc = pre.family.hf
    hf_first = [{"type": "image"}, {"type": "audio"}, {"type": "text", "text": "what are these?"}]
    text = proc.apply_chat_template(
        [{"role": "user", "content": hf_first}, *turns], add_generation_prompt=True
    )
    assert text.count("<|turn>") == 4  # three turns and the generation prompt
    inputs = proc(
        text=[text],
        images=[Image.open(io.BytesIO(image)).convert("RGB")],
        audio=[sf.read(io.BytesIO(clip), dtype="float32")[0]],
        return_tensors="pt",
    )
    assert inputs["input_ids"][0].tolist() == out.prompt_token_ids
    with torch.no_grad():
        ref = hf.generate(**inputs, max_new_tokens=N, do_sample=False)[0, len(out.prompt_token_ids) :]
    assert ours.token_ids == ref.tolist()
