"""LLMEngine vs transformers on the tiny Gemma 3: greedy outputs must agree token for token.

The tiny model's sliding window is 8 tokens and each image is 16 soft tokens, so every case below
runs past the window, and an image's tokens attend each other both ways across it (transformers'
``token_type_ids`` masks). The embeddings are the rows HF feeds its own language model, so what is
under test is the decoder, the masks and the engine's chunking, preemption and caching.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from PIL import Image

from llm_service.errors import RequestRejected
from llm_service.outputs import GenerateRequest
from llm_service.sampling_params import SamplingParams
from tests.media import make_image_array
from tests.tiny_dirs import tiny_model_dir
from tests.unit.llm_service.hf_ref import (
    GREEDY,
    N,
    RefCase,
    assert_all_free,
    capture_lm_inputs,
    engine,
    hf_generate,
    run,
    runs,
)


@pytest.fixture(scope="module")
def model_dir() -> Path:
    return tiny_model_dir("gemma3")


@pytest.fixture(scope="module")
def gemma(model_dir: Path) -> tuple[Any, Any]:
    from transformers import AutoProcessor, Gemma3ForConditionalGeneration

    torch.set_num_threads(1)
    proc = AutoProcessor.from_pretrained(model_dir)
    hf = Gemma3ForConditionalGeneration.from_pretrained(model_dir).eval()
    return hf, proc


def image(w: int, h: int, seed: int) -> Image.Image:
    return Image.fromarray(make_image_array(w, h, seed))


def case(gemma: tuple[Any, Any], text: str, images: list[Image.Image] | None = None, hashes=None) -> RefCase:  # type: ignore[no-untyped-def]
    """``text`` as a user turn (``<image>`` marks each image) through HF's template and processor."""
    from llm_service.multimodal import MultiModalInput

    hf, proc = gemma
    parts: list[dict[str, Any]] = []
    for i, piece in enumerate(text.split("<image>")):
        if i:
            parts.append({"type": "image"})
        if piece:
            parts.append({"type": "text", "text": piece})
    prompt = proc.apply_chat_template([{"role": "user", "content": parts}], add_generation_prompt=True)
    inputs = dict(proc(text=[prompt], images=images or None, return_tensors="pt"))
    ids = inputs["input_ids"][0].tolist()
    spans = runs(ids, hf.config.image_token_id)
    assert inputs["token_type_ids"][0].tolist() == [int(t == hf.config.image_token_id) for t in ids]
    embeds = capture_lm_inputs(hf, inputs) if spans else None
    items = []
    for i, (off, n) in enumerate(spans):
        assert embeds is not None
        items.append(
            MultiModalInput.of(embeds[off : off + n].clone(), off, (hashes or {}).get(i, f"img-{i}"), "image")
        )
    return RefCase(ids, items, inputs)


def test_family_facts(model_dir: Path) -> None:
    from llm_service.models.gemma3 import Gemma3TextConfig

    cfg = engine(model_dir).runner.text_config
    assert isinstance(cfg, Gemma3TextConfig)
    assert cfg.model_type == "gemma3" and cfg.mrope_section is None
    assert cfg.layer_is_sliding == (True, False) and cfg.sliding_window == 8
    assert (cfg.local_rope_theta, cfg.rope_theta, cfg.global_rope_factor) == (10000.0, 1000000.0, 8.0)


def test_text_longer_than_window(gemma, model_dir) -> None:
    c = case(gemma, "the quick brown fox jumps over the lazy dog and keeps running far away")
    assert len(c.prompt) > 3 * 8
    assert run(engine(model_dir), [c]) == [hf_generate(gemma[0], c, N)]


def test_one_image(gemma, model_dir) -> None:
    c = case(gemma, "<image>describe this picture please", [image(80, 48, 1)])
    assert [m.length for m in c.mm_inputs] == [16]
    assert run(engine(model_dir), [c]) == [hf_generate(gemma[0], c, N)]


def test_two_images(gemma, model_dir) -> None:
    c = case(gemma, "a <image> and b <image> compare them", [image(64, 48, 2), image(90, 120, 3)])
    assert len(c.mm_inputs) == 2
    assert run(engine(model_dir), [c]) == [hf_generate(gemma[0], c, N)]


def test_image_attention_is_bidirectional(gemma, model_dir) -> None:
    """Causal attention over the image would give other logits: HF's own model, masked causally,
    disagrees with HF (so the bidirectional span matters here), and we agree with HF."""
    hf, _ = gemma
    c = case(gemma, "<image>what is it", [image(64, 64, 4)])
    with torch.no_grad():
        ref = hf(**c.hf_inputs).logits[0, -1]
        causal = hf(
            **{**c.hf_inputs, "token_type_ids": torch.zeros_like(c.hf_inputs["token_type_ids"])}
        ).logits[0, -1]
    assert (ref - causal).abs().max() > 1e-2
    (out,) = engine(model_dir).generate(
        [GenerateRequest(c.prompt, SamplingParams(max_tokens=1, logprobs=5), c.mm_inputs)]
    )
    assert out.logprobs is not None
    ours = [v for _, v in out.logprobs[0].top]
    ref_top = torch.topk(torch.log_softmax(ref.float(), -1), 5)
    assert [t for t, _ in out.logprobs[0].top] == ref_top.indices.tolist()
    assert ours == pytest.approx(ref_top.values.tolist(), abs=1e-4)


def test_chunk_budget_never_cuts_an_image(gemma, model_dir) -> None:
    c = case(gemma, "look here <image> and say", [image(80, 60, 5)])
    item = c.mm_inputs[0]
    budget = 20
    assert item.length <= budget
    assert any(item.offset < cut < item.end for cut in range(budget, len(c.prompt), budget))
    eng = engine(model_dir, max_num_batched_tokens=budget)
    steps: list[tuple[int, int]] = []  # the image request's chunks
    real = eng.runner.execute

    def spy(out):  # type: ignore[no-untyped-def]
        mine = (ch for ch in out.chunks if ch.request.num_prompt_tokens == len(c.prompt))
        steps.extend((ch.start, ch.start + ch.num_tokens) for ch in mine)
        return real(out)

    eng.runner.execute = spy  # type: ignore[method-assign]
    other = case(gemma, "a short text prompt here")
    assert run(eng, [c, other]) == [hf_generate(gemma[0], x, N) for x in (c, other)]
    assert steps[0] == (0, item.offset)  # ended before the image it could not finish
    assert steps[1] == (item.offset, item.offset + budget)  # then the image whole, in the next chunk
    assert all(e <= item.offset or s >= item.end or (s <= item.offset and e >= item.end) for s, e in steps)
    assert_all_free(eng)


def test_image_longer_than_budget_is_rejected(gemma, model_dir) -> None:
    c = case(gemma, "<image>x", [image(64, 64, 6)])
    eng = engine(model_dir, max_num_batched_tokens=15)
    with pytest.raises(RequestRejected, match="max_num_batched_tokens is 15"):
        eng.add_request("r", c.prompt, GREEDY, c.mm_inputs)


def mixed_cases(gemma: tuple[Any, Any]) -> list[RefCase]:
    texts = ["hi", "one two three four five six seven", "a b c d e f g h i j k l m n o p q r s t u v"]
    cases = [case(gemma, t) for t in texts]
    cases += [case(gemma, f"img {i} <image> ok", [image(64 + 28 * i, 48, 20 + i)]) for i in range(2)]
    return cases


def test_preemption_small_pool(gemma, model_dir) -> None:
    cases = mixed_cases(gemma)
    eng = engine(model_dir, num_kv_blocks=14, block_size=4, max_num_batched_tokens=24)
    assert run(eng, cases) == [hf_generate(gemma[0], c, N) for c in cases]
    assert eng.stats().num_preemptions > 0
    assert_all_free(eng)


def test_prefix_cache_repeat_and_other_image(gemma, model_dir) -> None:
    text = "look at this <image> and then describe it in words"
    first = case(gemma, text, [image(64, 48, 7)], {0: "img-A"})
    other = case(gemma, text, [image(64, 48, 8)], {0: "img-B"})
    assert first.prompt == other.prompt
    bs = 5
    eng = engine(model_dir, block_size=bs)
    ref_first, ref_other = hf_generate(gemma[0], first, N), hf_generate(gemma[0], other, N)
    (a,) = eng.generate([GenerateRequest(first.prompt, GREEDY, first.mm_inputs)])
    assert a.token_ids == ref_first and a.num_cached_tokens == 0
    (b,) = eng.generate([GenerateRequest(first.prompt, GREEDY, first.mm_inputs)])
    assert b.token_ids == ref_first
    assert b.num_cached_tokens == len(first.prompt) // bs * bs
    (c,) = eng.generate([GenerateRequest(other.prompt, GREEDY, other.mm_inputs)])
    assert c.token_ids == ref_other
    assert c.num_cached_tokens == other.mm_inputs[0].offset // bs * bs
    assert_all_free(eng)
