"""LLMEngine vs transformers on the tiny Qwen3-VL: greedy outputs must agree token for token.

Each image's rows are what HF feeds its language model: the merged embeddings at the image's
positions, then every DeepStack level's rows for those positions (HF's ``deepstack_visual_embeds``
over its visual mask), i.e. the row layout the encoder tower emits. Under test: the Qwen3 decoder,
interleaved M-RoPE, and DeepStack under chunking, preemption and prefix-cache hits.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from llm_service.multimodal import MultiModalInput
from llm_service.outputs import GenerateRequest
from tests.media import make_image_array
from tests.tiny_dirs import tiny_model_dir
from tests.unit.llm_service.hf_ref import (
    GREEDY,
    IMG,
    N,
    RefCase,
    assert_all_free,
    build_case,
    capture_lm_inputs,
    engine,
    hf_generate,
    hf_model,
    image,
    run,
    runs,
)

HIDDEN, LEVELS = 64, 2


@pytest.fixture(scope="module")
def model_dir() -> Path:
    return tiny_model_dir("qwen3-vl")


@pytest.fixture(scope="module")
def vl(model_dir: Path) -> tuple[Any, Any]:
    return hf_model(model_dir)


def deepstack_rows(hf: Any, inputs: dict[str, Any]) -> tuple[list[int], list[torch.Tensor]]:
    """HF's visual positions and its DeepStack levels ``[num_visual, hidden]`` over them."""
    seen: dict[str, Any] = {}

    def hook(_mod, _args, kwargs):  # type: ignore[no-untyped-def]
        seen.update(mask=kwargs["visual_pos_masks"], levels=kwargs["deepstack_visual_embeds"])

    handle = hf.model.language_model.register_forward_pre_hook(hook, with_kwargs=True)
    try:
        with torch.no_grad():
            hf(**inputs)
    finally:
        handle.remove()
    positions = seen["mask"][0].nonzero()[:, 0].tolist()
    return positions, [level.detach().clone() for level in seen["levels"]]


def with_levels(hf: Any, case: RefCase) -> RefCase:
    """``case`` with each item's DeepStack rows appended to its main embeddings."""
    positions, levels = deepstack_rows(hf, case.hf_inputs)
    row_of = {p: i for i, p in enumerate(positions)}
    items = []
    for m in case.mm_inputs:
        rows = [row_of[p] for p in range(m.offset, m.end)]
        full = torch.cat([m.embeddings, *(level[rows] for level in levels)], dim=-1)
        items.append(MultiModalInput.of(full, m.offset, m.mm_hash, m.modality, m.grid_thw))
    return RefCase(case.prompt, items, case.hf_inputs)


def case_of(hf: Any, proc: Any, text: str, mm_hashes: list[str] | None = None, **media: Any) -> RefCase:
    case = build_case(hf, proc, text, mm_hashes, **media)
    return with_levels(hf, case) if case.mm_inputs else case


def video_case(hf: Any, proc: Any, text: str, images: list[Any] | None = None) -> RefCase:
    """A 6-frame clip at 3 fps plus optional images: HF writes the video as 3 timestamped runs, one per
    temporal patch, each a ``(1, h, w)`` item here (as its ``get_rope_index`` splits the grid)."""
    from transformers.video_utils import VideoMetadata

    frames = np.stack([make_image_array(96, 64, 20 + i) for i in range(6)])
    meta = VideoMetadata(total_num_frames=6, fps=3.0, frames_indices=list(range(6)))
    media: dict[str, Any] = {"videos": [frames], "video_metadata": [meta], "do_sample_frames": False}
    if images:
        media["images"] = images
    inputs = dict(proc(text=[text], return_tensors="pt", **media))
    ids = inputs["input_ids"][0].tolist()
    main = capture_lm_inputs(hf, inputs)
    items = []
    for i, grid in enumerate(inputs.get("image_grid_thw", [])):
        off, n = runs(ids, hf.config.image_token_id)[i]
        items.append(
            MultiModalInput.of(main[off : off + n].clone(), off, f"image-{i}", "image", tuple(grid.tolist()))
        )
    t, h, w = inputs["video_grid_thw"][0].tolist()
    video_runs = runs(ids, hf.config.video_token_id)
    assert len(video_runs) == t == 3
    for off, n in video_runs:
        items.append(MultiModalInput.of(main[off : off + n].clone(), off, "video-0", "video", (1, h, w)))
    items.sort(key=lambda m: m.offset)
    return with_levels(hf, RefCase(ids, items, inputs))


def test_family_facts(model_dir: Path) -> None:
    eng = engine(model_dir)
    cfg = eng.runner.text_config
    assert (cfg.model_type, cfg.mrope_section, cfg.head_dim) == ("qwen3_vl", (4, 2, 2), 16)
    assert eng.runner.model.deepstack_levels == LEVELS and eng.mm_row_width == HIDDEN * (1 + LEVELS)


def test_interleaved_mrope_layout(model_dir: Path) -> None:
    """Frequencies 1, 4 take the height row and 2, 5 the width row (sections [4, 2, 2] of 8)."""
    rotary = engine(model_dir).runner.model.rotary
    pos = torch.tensor([[100], [2000], [30000]])
    cos, _ = rotary(pos, torch.float32)
    rows = torch.tensor([100, 2000, 30000, 100, 2000, 30000, 100, 100], dtype=torch.float32)
    expected = (rows * rotary.inv_freq).cos()
    torch.testing.assert_close(cos[0], torch.cat([expected, expected]))


def test_text_only(vl, model_dir) -> None:
    hf, proc = vl
    case = case_of(hf, proc, "the quick brown fox jumps over the lazy dog")
    assert run(engine(model_dir), [case]) == [hf_generate(hf, case, N)]


def test_one_image_and_deepstack_matters(vl, model_dir) -> None:
    hf, proc = vl
    case = case_of(hf, proc, f"describe {IMG} please", images=[image(300, 200, 1)])
    (item,) = case.mm_inputs
    assert item.grid_thw == (1, 12, 18) and item.embeddings.shape == (54, HIDDEN * (1 + LEVELS))
    expected = hf_generate(hf, case, N)
    assert run(engine(model_dir), [case]) == [expected]
    flat = item.embeddings.clone()
    flat[:, HIDDEN:] = 0  # the same image without its DeepStack levels answers otherwise
    plain = RefCase(case.prompt, [MultiModalInput.of(flat, item.offset, "no-ds", "image", item.grid_thw)], {})
    assert run(engine(model_dir), [plain]) != [expected]


def test_two_images(vl, model_dir) -> None:
    hf, proc = vl
    case = case_of(hf, proc, f"a {IMG} and b {IMG} compare", images=[image(64, 64, 2), image(96, 128, 3)])
    assert len(case.mm_inputs) == 2
    assert run(engine(model_dir), [case]) == [hf_generate(hf, case, N)]


def test_chunked_prefill_cuts_through_images(vl, model_dir) -> None:
    hf, proc = vl
    case = case_of(hf, proc, f"a {IMG} and b {IMG} compare", images=[image(300, 200, 4), image(96, 128, 5)])
    first = case.mm_inputs[0]
    eng = engine(model_dir, max_num_batched_tokens=16)
    assert any(first.offset < k * 16 < first.end for k in range(1, 10))  # a chunk boundary inside
    assert run(eng, [case]) == [hf_generate(hf, case, N)]
    assert_all_free(eng)


def test_preemption_small_pool(vl, model_dir) -> None:
    hf, proc = vl
    cases = [
        case_of(
            hf, proc, f"picture {i} {IMG} tell me", [f"img-{i}"], images=[image(128, 96 + 32 * i, 10 + i)]
        )
        for i in range(3)
    ]
    eng = engine(model_dir, num_kv_blocks=24, block_size=4)
    assert run(eng, cases) == [hf_generate(hf, c, N) for c in cases]
    assert eng.stats().num_preemptions > 0
    assert_all_free(eng)


def test_prefix_hit_ends_inside_the_image(vl, model_dir) -> None:
    """The second request finds its prefix cached up to a block boundary inside the image: the rest
    of the image is recomputed, and only those positions get their DeepStack rows."""
    hf, proc = vl
    case = case_of(hf, proc, f"look {IMG}", ["img-A"], images=[image(300, 200, 6)])
    (item,) = case.mm_inputs
    n = len(case.prompt)
    bs = next(b for b in range(4, 64) if item.offset < (n - 1) // b * b < item.end)
    eng = engine(model_dir, block_size=bs)
    expected = hf_generate(hf, case, N)
    (a,) = eng.generate([GenerateRequest(case.prompt, GREEDY, case.mm_inputs)])
    assert a.token_ids == expected and a.num_cached_tokens == 0
    (b,) = eng.generate([GenerateRequest(case.prompt, GREEDY, case.mm_inputs)])
    assert item.offset < b.num_cached_tokens < item.end
    assert b.token_ids == expected
    other = case_of(hf, proc, f"look {IMG}", ["img-B"], images=[image(300, 200, 7)])
    (c,) = eng.generate([GenerateRequest(other.prompt, GREEDY, other.mm_inputs)])
    assert c.token_ids == hf_generate(hf, other, N)


VID = "<|vision_start|><|video_pad|><|vision_end|>"


def test_video_timestamped_runs(vl, model_dir) -> None:
    hf, proc = vl
    case = video_case(hf, proc, f"what happens {VID} here")
    text = proc.tokenizer.decode(case.prompt)
    assert "<0.2 seconds>" in text and "<0.8 seconds>" in text and "<1.5 seconds>" in text
    assert run(engine(model_dir), [case]) == [hf_generate(hf, case, N)]


def test_video_and_image_chunked(vl, model_dir) -> None:
    hf, proc = vl
    case = video_case(hf, proc, f"a {IMG} then {VID} compare", images=[image(300, 200, 8)])
    eng = engine(model_dir, max_num_batched_tokens=16)
    assert run(eng, [case]) == [hf_generate(hf, case, N)]
    assert_all_free(eng)
