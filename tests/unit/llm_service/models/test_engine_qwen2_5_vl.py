"""LLMEngine vs transformers on the tiny Qwen2.5-VL: greedy outputs must agree token for token.

The embeddings are the rows HF feeds its own language model, so what is under test is the decoder,
the M-RoPE positions (absolute time for videos) and the engine's chunking, preemption and caching.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from llm_service.mrope import prompt_mrope_positions
from llm_service.outputs import GenerateRequest
from llm_service.sampling_params import SamplingParams
from tests.media import make_image_array
from tests.tiny_dirs import tiny_model_dir
from tests.unit.llm_service.hf_ref import (
    GREEDY,
    IMG,
    VID,
    N,
    RefCase,
    assert_all_free,
    build_case,
    engine,
    hf_generate,
    hf_model,
    image,
    run,
)


@pytest.fixture(scope="module")
def model_dir() -> Path:
    return tiny_model_dir("qwen2.5-vl")


@pytest.fixture(scope="module")
def vl(model_dir: Path) -> tuple[Any, Any]:
    return hf_model(model_dir)


def video_case(hf: Any, proc: Any, text: str, num_frames: int, fps: float, seed: int = 10) -> RefCase:
    """A video sampled at ``fps``: HF turns that into ``second_per_grid_ts``; we carry it per item.

    The mm_hash names the fps too, as the real one does (its bytes and sampling kwargs fix the fps):
    the prefix cache must not serve one clip's KV, computed at its time positions, to another.
    """
    from transformers.video_utils import VideoMetadata

    frames = np.stack([make_image_array(64, 48, seed + i) for i in range(num_frames)])
    meta = VideoMetadata(total_num_frames=num_frames, fps=fps, frames_indices=list(range(num_frames)))
    mm_hash = f"video-{seed}-{num_frames}@{fps}"
    case = build_case(hf, proc, text, [mm_hash], videos=[frames], video_metadata=[meta])
    seconds = iter(case.hf_inputs["second_per_grid_ts"].tolist())
    items = [
        dataclasses.replace(m, feature=dataclasses.replace(m.feature, second_per_grid_ts=next(seconds)))
        if m.modality == "video"
        else m
        for m in case.mm_inputs
    ]
    return RefCase(case.prompt, items, case.hf_inputs)


def test_family_facts(model_dir: Path) -> None:
    eng = engine(model_dir)
    cfg = eng.runner.text_config
    assert (cfg.model_type, cfg.tokens_per_second, cfg.mrope_section) == ("qwen2_5_vl", 2.0, (2, 3, 3))
    assert eng.runner.model.uses_mrope


def test_text_only(vl, model_dir) -> None:
    hf, proc = vl
    case = build_case(hf, proc, "the quick brown fox jumps over the lazy dog")
    assert run(engine(model_dir), [case]) == [hf_generate(hf, case, N)]


def test_one_image(vl, model_dir) -> None:
    hf, proc = vl
    case = build_case(hf, proc, f"describe {IMG} please", images=[image(120, 90, 1)])
    assert case.mm_inputs[0].grid_thw == (1, 6, 8)
    assert run(engine(model_dir), [case]) == [hf_generate(hf, case, N)]


def test_two_images(vl, model_dir) -> None:
    hf, proc = vl
    case = build_case(hf, proc, f"a {IMG} and b {IMG} compare", images=[image(64, 48, 2), image(90, 120, 3)])
    assert len(case.mm_inputs) == 2
    assert run(engine(model_dir), [case]) == [hf_generate(hf, case, N)]


@pytest.mark.parametrize("fps", [3.0, 0.5])
def test_video_absolute_time_positions(vl, model_dir, fps: float) -> None:
    """fps 3: 2/3 s per temporal patch, positions 0, 1, 2, 4 (float32 truncation); fps 0.5: 0, 8, 16, 24."""
    hf, proc = vl
    case = video_case(hf, proc, f"what happens {VID} here", num_frames=8, fps=fps)
    item = case.mm_inputs[0]
    assert item.grid_thw == (4, 4, 4) and item.second_per_grid_ts == pytest.approx(2 / fps)
    ours, delta = prompt_mrope_positions(len(case.prompt), case.mm_inputs, 2, 2.0)
    ref, ref_delta = hf.model.get_rope_index(
        case.hf_inputs["input_ids"],
        case.hf_inputs["mm_token_type_ids"],
        video_grid_thw=case.hf_inputs["video_grid_thw"],
        second_per_grid_ts=case.hf_inputs["second_per_grid_ts"],
    )
    assert torch.equal(ours, ref[:, 0])
    assert delta == int(ref[:, 0, -1].max()) + 1 - len(case.prompt)  # generate continues from the last token
    assert delta <= int(ref_delta)
    temporal = ours[0, item.offset : item.end : 4].tolist()
    start = temporal[0]
    assert [t - start for t in temporal] == ([0, 1, 2, 4] if fps == 3.0 else [0, 8, 16, 24])
    assert run(engine(model_dir), [case]) == [hf_generate(hf, case, N)]


def test_video_time_scale_changes_logits_as_in_hf(vl, model_dir) -> None:
    """Same frames, other fps: only the temporal positions differ, and our logprobs follow HF's."""
    hf, proc = vl
    slow = video_case(hf, proc, f"what happens {VID} here", num_frames=8, fps=0.5)
    fast = video_case(hf, proc, f"what happens {VID} here", num_frames=8, fps=3.0)
    assert slow.prompt == fast.prompt
    assert torch.equal(slow.mm_inputs[0].embeddings, fast.mm_inputs[0].embeddings)
    eng = engine(model_dir)
    params = SamplingParams(max_tokens=1, logprobs=5)
    tops = []
    for case in (slow, fast):
        with torch.no_grad():
            ref = torch.log_softmax(hf(**case.hf_inputs).logits[0, -1].float(), -1)
        (out,) = eng.generate([GenerateRequest(case.prompt, params, case.mm_inputs)])
        assert out.logprobs is not None
        top = out.logprobs[0].top
        assert [t for t, _ in top] == torch.topk(ref, 5).indices.tolist()
        assert [v for _, v in top] == pytest.approx(torch.topk(ref, 5).values.tolist(), abs=1e-4)
        tops.append([v for _, v in top])
    assert max(abs(a - b) for a, b in zip(*tops, strict=True)) > 1e-3


def mixed_cases(hf: Any, proc: Any) -> list[RefCase]:
    texts = ["hi", "one two three four five six seven", "a b c d e f g h i j k l m n o p q r s t u v"]
    cases = [build_case(hf, proc, t) for t in texts]
    cases += [
        build_case(hf, proc, f"img {i} {IMG} ok", images=[image(64 + 28 * i, 48, 20 + i)]) for i in range(2)
    ]
    cases.append(video_case(hf, proc, f"clip {VID} now", num_frames=4, fps=1.0, seed=40))
    return cases


def test_chunked_prefill_cuts_through_image(vl, model_dir) -> None:
    hf, proc = vl
    case = build_case(hf, proc, f"describe {IMG} please now", images=[image(120, 90, 1)])
    vid = video_case(hf, proc, f"then {VID} this", num_frames=8, fps=3.0)
    budget = 5
    for c in (case, vid):
        item = c.mm_inputs[0]
        assert any(item.offset < cut < item.end for cut in range(budget, len(c.prompt), budget))
    other = build_case(hf, proc, "a short text prompt here")
    eng = engine(model_dir, max_num_batched_tokens=budget)
    expected = [hf_generate(hf, c, N) for c in (case, vid, other)]
    assert run(eng, [case, vid, other]) == expected
    assert_all_free(eng)


def test_preemption_small_pool(vl, model_dir) -> None:
    hf, proc = vl
    cases = mixed_cases(hf, proc)
    eng = engine(model_dir, num_kv_blocks=12, block_size=4)
    assert run(eng, cases) == [hf_generate(hf, c, N) for c in cases]
    assert eng.stats().num_preemptions > 0
    assert_all_free(eng)


def test_prefix_cache_repeat_and_other_image(vl, model_dir) -> None:
    hf, proc = vl
    text = f"look at this {IMG} and then describe it in words"
    first = build_case(hf, proc, text, mm_hashes=["img-A"], images=[image(64, 48, 5)])
    other = build_case(hf, proc, text, mm_hashes=["img-B"], images=[image(64, 48, 6)])
    assert first.prompt == other.prompt
    bs = 5
    assert len(first.prompt) % bs != 0
    eng = engine(model_dir, block_size=bs)
    ref_first, ref_other = hf_generate(hf, first, N), hf_generate(hf, other, N)
    (a,) = eng.generate([GenerateRequest(first.prompt, GREEDY, first.mm_inputs)])
    assert a.token_ids == ref_first and a.num_cached_tokens == 0
    (b,) = eng.generate([GenerateRequest(first.prompt, GREEDY, first.mm_inputs)])
    assert b.token_ids == ref_first
    assert b.num_cached_tokens == len(first.prompt) // bs * bs
    (c,) = eng.generate([GenerateRequest(other.prompt, GREEDY, other.mm_inputs)])
    assert c.token_ids == ref_other
    assert c.num_cached_tokens == other.mm_inputs[0].offset // bs * bs
    assert_all_free(eng)


def test_qwen2_vl_long_video_decodes_from_last_position(tiny_vl_dir: Path) -> None:
    """Qwen2-VL too: 8 temporal patches run past the text after the video; generate continues from
    the last prompt token, not from the largest position (the rule both families share in mrope.py)."""
    from transformers import AutoProcessor, Qwen2VLForConditionalGeneration

    proc = AutoProcessor.from_pretrained(tiny_vl_dir)
    hf = Qwen2VLForConditionalGeneration.from_pretrained(tiny_vl_dir).eval()
    frames = np.stack([make_image_array(64, 48, 50 + i) for i in range(16)])
    case = build_case(hf, proc, f"what {VID} ok", videos=[frames])
    item = case.mm_inputs[0]
    assert item.grid_thw is not None and item.grid_thw[0] == 8 and item.end < len(case.prompt)
    pos, _ = prompt_mrope_positions(len(case.prompt), case.mm_inputs, 2)
    assert int(pos.max()) > int(pos[0, -1])  # the video's temporal positions pass the trailing text
    assert run(engine(tiny_vl_dir), [case]) == [hf_generate(hf, case, N)]
