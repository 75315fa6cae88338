"""The ingress's hit path without the HF processor, per family, against the loaded processor:

- ``HitPathFacts`` (read as plain JSON) equals what transformers' processor says: geometry, frame
  and audio rules, placeholder ids, log settings, the draft decode;
- a request the encoder cache holds whole gets, from the record and the tokenizer alone, the same
  mm_hashes, prompt ids and placeholder runs as the full processor gives it (images of several
  sizes, a video, audio clips: what each family takes);
- building the ingress's preparer imports none of transformers' image stack (torchvision,
  ``torch._dynamo``, scipy), in a fresh interpreter.
"""

from __future__ import annotations

import asyncio
import dataclasses
import functools
import json
import subprocess
import sys
from pathlib import Path

import pytest

from encoder_service.preprocess.hit_path_facts import read_hit_path_facts
from encoder_service.preprocess.hit_path_family import HitPathFamily
from encoder_service.preprocess.media import MediaLimits
from encoder_service.preprocess.processing import NeedsEncoding, Preprocessor
from encoder_service.types import EmbeddingMeta, EncoderInput, MediaRef, PreprocessedRequest
from router.journey.orchestrator import chat_tokenizer
from tests.media import make_audio_bytes, make_image_bytes, make_video_bytes
from tests.tiny_dirs import tiny_model_dir

LIMITS = MediaLimits(video_fps=2.0)
IMAGES = [
    (300, 200, "PNG"),
    (50, 90, "PNG"),
    (1000, 600, "JPEG"),
    (1800, 1200, "JPEG"),
]  # the last: a draft decode
VIDEO = {"image": len(IMAGES), "video": 1}
# family -> the media one request carries (at most what the family takes)
FAMILIES: dict[str, dict[str, int]] = {
    "qwen2-vl": VIDEO,
    "qwen2.5-vl": VIDEO,
    "qwen3-vl": VIDEO,
    "qwen3.5": VIDEO,
    "gemma3": {"image": len(IMAGES)},
    "gemma4": {"image": len(IMAGES), "audio": 2},
    "qwen2-audio": {"audio": 2},
}


@pytest.fixture(scope="module", params=list(FAMILIES))
def family(request: pytest.FixtureRequest) -> tuple[str, Preprocessor, Preprocessor]:
    """(name, the encoder's preprocessor over the HF processor, the ingress's over record + tokenizer)."""
    name = request.param
    model_dir = tiny_model_dir(name)
    limit = FAMILIES[name]
    full = Preprocessor(model_dir, LIMITS, limit, processor_cache_bytes=0)
    tokenizer = chat_tokenizer(str(model_dir))  # the ingress's, as IngressServer loads it
    light = HitPathFamily(read_hit_path_facts(model_dir), tokenizer, LIMITS)
    hit = Preprocessor(model_dir, LIMITS, limit, processor_cache_bytes=0, family=light)
    return name, full, hit


def test_facts_equal_the_hf_processor(family: tuple[str, Preprocessor, Preprocessor]) -> None:
    name, full, hit = family
    hf, facts = full.processor.hf, hit.facts
    ours, theirs = hit.family, full.family
    assert ours.modalities == theirs.modalities
    assert ours.placeholder_token_ids == theirs.placeholder_token_ids
    assert (ours.uses_mrope, ours.sampling_rate) == (theirs.uses_mrope, theirs.sampling_rate)
    assert ours.frame_multiple == theirs.frame_multiple
    for modality in ours.modalities:
        assert ours.log_kwargs(modality) == theirs.log_kwargs(modality), modality
        assert ours.decode_kwargs(modality) == theirs.decode_kwargs(modality), modality
    for sub, geometry in (
        ("image_processor", facts.image_geometry),
        ("video_processor", facts.video_geometry),
    ):
        if geometry is None:
            continue
        proc = getattr(hf, sub)
        assert geometry.patch_size == proc.patch_size and geometry.merge_size == proc.merge_size
        assert geometry.temporal_patch_size == proc.temporal_patch_size
        assert (geometry.min_pixels, geometry.max_pixels) == (proc.size.shortest_edge, proc.size.longest_edge)
    if facts.image_seq_length is not None:
        assert facts.image_seq_length == hf.image_seq_length
    if "audio" in ours.modalities:
        assert facts.sampling_rate == hf.feature_extractor.sampling_rate
    text = hf.apply_chat_template(
        _messages(name, with_media=False), add_generation_prompt=True, tokenize=False
    )
    assert ours.prompt_text(text) == theirs.prompt_text(text)


def test_placeholders_and_prompt_equal_the_full_processor(
    family: tuple[str, Preprocessor, Preprocessor],
) -> None:
    """Every item of the request processed by the full processor, then the same request on the hit
    path answered from those entries: the same mm_hashes, prompt ids and runs."""
    name, full, hit = family
    messages = _messages(name)
    want = full.preprocess_sync(messages)
    assert len(want.items) >= sum(FAMILIES[name].values())  # every item became at least one run
    entries = {it.mm_hash: _entry(it.data) for it in want.items if isinstance(it.data, EncoderInput)}
    got = asyncio.run(hit.preprocess(messages, lambda hashes: entries, process=False))
    assert got.prompt_token_ids == want.prompt_token_ids
    assert _runs(got) == _runs(want)
    assert got.processor_kwargs == want.processor_kwargs  # the settings the request's log line names


def test_a_miss_is_handed_on_not_processed(family: tuple[str, Preprocessor, Preprocessor]) -> None:
    name, _, hit = family
    with pytest.raises(NeedsEncoding) as e:
        asyncio.run(hit.preprocess(_messages(name), lambda hashes: {}, process=False))
    assert len(e.value.hashes) == sum(FAMILIES[name].values())


def test_the_older_layout_and_defaults_equal_the_hf_processor(tmp_path: Path) -> None:
    """A checkpoint with only ``preprocessor_config.json`` (flat, ``min_pixels`` / ``max_pixels``, no
    ``patch_size``): the video processor reads it too, and a missing key is the class's default."""
    import shutil

    from transformers import AutoProcessor

    src = tiny_model_dir("qwen2.5-vl")
    for name in ("config.json", "tokenizer.json", "tokenizer_config.json", "chat_template.jinja"):
        shutil.copy(src / name, tmp_path / name)
    image = dict(json.loads((src / "processor_config.json").read_text())["image_processor"])
    size = image.pop("size")
    del image["patch_size"]
    image.update(min_pixels=2 * size["shortest_edge"], max_pixels=size["longest_edge"] // 2)
    image["processor_class"] = "Qwen2_5_VLProcessor"
    (tmp_path / "preprocessor_config.json").write_text(json.dumps(image))
    hf = AutoProcessor.from_pretrained(str(tmp_path), use_fast=True)
    facts = read_hit_path_facts(tmp_path)
    for proc, geometry in (
        (hf.image_processor, facts.image_geometry),
        (hf.video_processor, facts.video_geometry),
    ):
        assert geometry is not None
        got = (geometry.patch_size, geometry.merge_size, geometry.min_pixels, geometry.max_pixels)
        assert got == (proc.patch_size, proc.merge_size, proc.size.shortest_edge, proc.size.longest_edge)
    assert facts.frame_multiple == hf.video_processor.temporal_patch_size


@pytest.mark.parametrize("name", ["qwen2-vl", "gemma4"])  # Gemma 4's own config class imports the stack
def test_the_ingress_preparer_imports_no_image_stack(name: str) -> None:
    """``router.http.app``'s hit path as the ingress builds it: its tokenizer, then ``make_preparer``."""
    model_dir = tiny_model_dir(name)
    code = f"""
import json, sys
from encoder_service.preprocess.make_preparer import make_preparer
from encoder_service.preprocess.media import MediaLimits
from router.journey.orchestrator import chat_tokenizer
tokenizer = chat_tokenizer({str(model_dir)!r})
preparer = make_preparer({str(model_dir)!r}, limits=MediaLimits(), limit_mm_per_prompt={{"image": 1}},
    processor_cache_bytes=0, cache=None, encode=None, tokenizer=tokenizer)
assert type(preparer.preprocessor.family).__name__ == "HitPathFamily"
heavy = ("torchvision", "torch._dynamo", "scipy", "sympy", "transformers.image_utils",
         "transformers.processing_utils")
print(json.dumps([m for m in heavy if m in sys.modules]))
"""
    out = subprocess.run(
        [sys.executable, "-c", code], check=True, capture_output=True, text=True, cwd=_root()
    )
    assert json.loads(out.stdout.strip().splitlines()[-1]) == []


@functools.cache  # the media are made once per family (the messages are only read)
def _messages(name: str, with_media: bool = True) -> list[dict[str, object]]:
    limit = FAMILIES[name]
    content: list[dict[str, object]] = []
    for i, (w, h, fmt) in enumerate(IMAGES[: limit.get("image", 0)]):
        data = make_image_bytes(w, h, fmt, seed=i)
        content.append(
            {"type": "image", "media": MediaRef("image", data=data)} if with_media else {"type": "image"}
        )
    if limit.get("video"):
        data = make_video_bytes(64, 48, num_frames=8, fps=4)
        content.append(
            {"type": "video", "media": MediaRef("video", data=data)} if with_media else {"type": "video"}
        )
    for i, seconds in enumerate((1.3, 0.6)[: limit.get("audio", 0)]):
        data = make_audio_bytes(seconds, seed=i)
        content.append(
            {"type": "audio", "media": MediaRef("audio", data=data)} if with_media else {"type": "audio"}
        )
    content.append({"type": "text", "text": "What is in these?"})
    return [{"role": "user", "content": content}]


def _entry(enc: EncoderInput) -> EmbeddingMeta:
    """The cache entry the encoder would commit for ``enc`` (the LLM's width does not matter here)."""
    return EmbeddingMeta.of(enc.mm_hash, enc.modality, enc.facts, hidden_size=8, dtype="float32")


def _runs(pre: PreprocessedRequest) -> list[object]:
    return [dataclasses.replace(it, metadata=None) for it in pre.items]


def _root() -> Path:
    return Path(__file__).resolve().parents[4]
