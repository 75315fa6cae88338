"""LLMEngine vs transformers on the tiny Qwen3.5 (3 Gated DeltaNet layers + 1 gated attention layer):
greedy outputs agree token for token, with the linear layers' states carried in the state cache
across prefill chunks and decodes, dropped on preemption and recomputed on resume.

Each item's rows are what HF feeds its language model (captured), so only the decoder is under test.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest

from cluster.tiny_model.tokenizer import QWEN2_VL_CHAT_TEMPLATE as PLAIN  # turns that extend each other
from llm_service.hybrid_kv_cache_manager import HybridKVCacheManager
from llm_service.multimodal import MultiModalInput
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
    capture_lm_inputs,
    engine,
    hf_generate,
    hf_model,
    image,
    run,
    runs,
)


@pytest.fixture(scope="module")
def model_dir() -> Path:
    return tiny_model_dir("qwen3.5")


@pytest.fixture(scope="module")
def vl(model_dir: Path) -> tuple[Any, Any]:
    return hf_model(model_dir)


def video_case(hf: Any, proc: Any, text: str, images: list[Any] | None = None) -> RefCase:
    """A 6-frame clip at 3 fps (plus optional images): HF writes it as 3 timestamped runs, one per
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
    return RefCase(ids, items, inputs)


def test_family_facts(model_dir: Path) -> None:
    eng = engine(model_dir, max_num_seqs=3)
    cfg = eng.runner.text_config
    assert (cfg.model_type, cfg.mrope_section, cfg.head_dim) == ("qwen3_5", (2, 1, 1), 32)
    assert cfg.num_layers == 1 and len(eng.runner.kv_caches) == 1  # paged KV for the attention layer only
    states = eng.runner.linear_states
    # num_state_slots defaults to max_num_seqs, and as many snapshot slots for prefix caching
    assert (eng.runner.num_state_slots, eng.runner.num_state_snapshots) == (3, 3)
    assert states is not None and states.num_slots == 6
    assert [tuple(c.shape) for c in states.conv] == [(6, 2 * 32 + 64, 3)] * 3  # conv dim, kernel - 1
    assert [tuple(r.shape) for r in states.recurrent] == [(6, 4, 16, 16)] * 3
    assert isinstance(eng.kv, HybridKVCacheManager) and eng.mm_row_width == 64


def test_text_only(vl, model_dir) -> None:
    hf, proc = vl
    case = build_case(hf, proc, "the quick brown fox jumps over the lazy dog")
    assert run(engine(model_dir), [case]) == [hf_generate(hf, case, N)]


def test_one_image(vl, model_dir) -> None:
    hf, proc = vl
    case = build_case(hf, proc, f"describe {IMG} please", images=[image(300, 200, 1)])
    (item,) = case.mm_inputs
    assert item.grid_thw == (1, 12, 18) and item.embeddings.shape == (54, 64)
    expected = hf_generate(hf, case, N)
    assert len(expected) == N
    assert run(engine(model_dir), [case]) == [expected]


def test_two_images(vl, model_dir) -> None:
    hf, proc = vl
    case = build_case(hf, proc, f"a {IMG} and b {IMG} compare", images=[image(64, 64, 2), image(96, 128, 3)])
    assert len(case.mm_inputs) == 2
    assert run(engine(model_dir), [case]) == [hf_generate(hf, case, N)]


def test_video_timestamped_runs(vl, model_dir) -> None:
    hf, proc = vl
    case = video_case(hf, proc, f"what happens {VID} here")
    assert "<0.2 seconds>" in proc.tokenizer.decode(case.prompt)
    assert run(engine(model_dir), [case]) == [hf_generate(hf, case, N)]


def test_chunked_prefill_carries_states(vl, model_dir) -> None:
    """Chunks of 16 cut through the images and the video's runs: every linear layer continues from
    the conv and recurrent states the previous chunk left; a long prompt crosses the kernel's 64-token
    blocks inside a chunk too (budget 100)."""
    hf, proc = vl
    case = video_case(hf, proc, f"a {IMG} then {VID} compare", images=[image(300, 200, 8)])
    first = case.mm_inputs[0]
    assert any(first.offset < k * 16 < first.end for k in range(1, 20))  # a chunk boundary inside
    expected = hf_generate(hf, case, N)
    for budget in (16, 100):
        eng = engine(model_dir, max_num_batched_tokens=budget)
        assert run(eng, [case]) == [expected]
        assert_all_free(eng)


def test_batch_of_prefills_and_decodes(vl, model_dir) -> None:
    """Three requests at once (prefill chunks beside batched decodes, each in its own slot)."""
    hf, proc = vl
    cases = [
        build_case(
            hf, proc, f"picture {i} {IMG} tell me", [f"img-{i}"], images=[image(128, 96 + 32 * i, 10 + i)]
        )
        for i in range(3)
    ]
    eng = engine(model_dir, max_num_batched_tokens=40)
    assert run(eng, cases) == [hf_generate(hf, c, N) for c in cases]
    assert_all_free(eng)
    assert eng.kv.num_free_state_slots == eng.runner.num_state_slots


def test_preemption_drops_and_recomputes_states(vl, model_dir) -> None:
    hf, proc = vl
    cases = [
        build_case(
            hf, proc, f"picture {i} {IMG} tell me", [f"img-{i}"], images=[image(128, 96 + 32 * i, 10 + i)]
        )
        for i in range(3)
    ]
    eng = engine(model_dir, num_kv_blocks=24, block_size=4)
    assert run(eng, cases) == [hf_generate(hf, c, N) for c in cases]
    assert eng.stats().num_preemptions > 0
    assert_all_free(eng)
    assert eng.kv.num_free_state_slots == eng.runner.num_state_slots


def test_state_budget_bounds_the_running_batch(vl, model_dir) -> None:
    """One state slot: requests run one after another (admission waits for the slot), each from
    zero states, whatever the slot's previous owner left in it."""
    hf, proc = vl
    cases = [build_case(hf, proc, text) for text in ("a cat sat on the mat", "one two three four five six")]
    eng = engine(model_dir, num_state_slots=1)
    assert eng.runner.num_state_slots == 1
    for c in cases:
        eng.add_request(f"r-{len(eng.scheduler.requests)}", c.prompt, SamplingParams(max_tokens=N))
    eng.step()
    assert len(eng.scheduler.running) == 1 and len(eng.scheduler.waiting) == 1
    while eng.has_unfinished_requests():
        eng.step()
    outs = eng.generate([GenerateRequest(c.prompt, GREEDY) for c in cases])
    assert [o.token_ids for o in outs] == [hf_generate(hf, c, N) for c in cases]
    assert_all_free(eng)


@pytest.mark.parametrize("budget", [512, 12])  # whole prompts in one step; chunked prefill
def test_poisoned_neighbour_fails_alone_and_states_stay_right(vl, model_dir, budget) -> None:
    """A request whose image has an +inf row fails in a step; the step is replayed for the others.
    Their states are committed once, after the replay succeeds, so they still equal HF."""
    hf, proc = vl
    normal = [
        build_case(hf, proc, f"look {IMG} at this", ["img-a"], images=[image(96, 64, 30)]),
        build_case(hf, proc, "one two three four five six seven eight"),
    ]
    bad = build_case(hf, proc, f"a poisoned {IMG} item", ["img-p"], images=[image(64, 96, 31)])
    (m,) = bad.mm_inputs
    emb = m.embeddings.clone()
    emb[1, 3] = float("inf")
    eng = engine(model_dir, max_num_batched_tokens=budget)
    for i, c in enumerate(normal):
        eng.add_request(f"ok{i}", c.prompt, GREEDY, c.mm_inputs)
    eng.add_request(
        "bad", bad.prompt, GREEDY, [MultiModalInput.of(emb, m.offset, "poison", "image", m.grid_thw)]
    )
    got: dict[str, list[int]] = {"ok0": [], "ok1": [], "bad": []}
    errors = {}
    while eng.has_unfinished_requests():
        for o in eng.step():
            got[o.request_id].extend(o.new_token_ids)
            if o.error:
                errors[o.request_id] = o.error
    assert list(errors) == ["bad"] and got["bad"] == []
    assert [got["ok0"], got["ok1"]] == [hf_generate(hf, c, N) for c in normal]
    assert_all_free(eng)
    assert eng.kv.num_free_state_slots == eng.runner.num_state_slots


# ---- prefix caching for the hybrid: KV blocks + a snapshot of the linear states where they end ----


def test_resent_prompt_restores_a_snapshot(vl, model_dir) -> None:
    """The same image prompt again: its KV blocks up to the last block an identical prompt can hit
    come from the cache, the linear layers start from the snapshot taken there; equal to HF. A text
    prompt before it shares its first blocks (the chat template's header), which the image prompt
    computes again (no snapshot there) in a pool so small that it reuses the older copies: its own
    copies must stay findable (``BlockPool.cache`` gives a held duplicate the hash of a free one)."""
    hf, proc = vl

    def chat(content: Any) -> str:  # the plain template: a system header both prompts share
        return str(
            proc.apply_chat_template(
                [{"role": "user", "content": content}], add_generation_prompt=True, chat_template=PLAIN
            )
        )

    text = build_case(hf, proc, chat("hello there, tell me more"))
    content = [{"type": "image"}, {"type": "text", "text": "look at it"}]
    case = build_case(hf, proc, chat(content), ["img-A"], images=[image(300, 200, 6)])
    assert case.prompt[:8] == text.prompt[:8]
    n = len(case.prompt)
    eng = engine(model_dir, max_num_batched_tokens=16, num_kv_blocks=(n + N - 1 + 3) // 4)  # one request's
    assert run(eng, [text]) == [hf_generate(hf, text, N)]
    expected = hf_generate(hf, case, N)
    (a,) = eng.generate([GenerateRequest(case.prompt, GREEDY, case.mm_inputs)])
    assert a.token_ids == expected and a.num_cached_tokens == 0
    (b,) = eng.generate([GenerateRequest(case.prompt, GREEDY, case.mm_inputs)])
    assert b.num_cached_tokens == (n - 1) // 4 * 4 and b.token_ids == expected
    other = build_case(hf, proc, chat(content), ["img-B"], images=[image(300, 200, 7)])
    (c,) = eng.generate([GenerateRequest(other.prompt, GREEDY, other.mm_inputs)])
    assert c.token_ids == hf_generate(hf, other, N) and c.num_cached_tokens < 8  # another image: no hit
    assert_all_free(eng)


def test_three_turn_chat_resending_its_image(vl, model_dir) -> None:
    """Each turn re-sends the conversation with its image: the next turn hits at least the previous
    turn's prompt (its prompt-end snapshot), and every answer equals HF's. (With the plain template:
    Qwen3.5's released one opens ``<think>`` in the generation prompt but writes a past answer without
    it, so no turn's prompt is a prefix of the next one and no prompt-end snapshot could be hit.)"""
    hf, proc = vl
    img = image(300, 200, 9)
    messages: list[dict[str, Any]] = []
    eng = engine(model_dir, max_num_batched_tokens=32)
    prev_prompt = 0
    for turn, question in enumerate(["what is this?", "and the colours?", "anything else?"]):
        content = [{"type": "image"}, {"type": "text", "text": question}] if turn == 0 else question
        messages.append({"role": "user", "content": content})
        text = proc.apply_chat_template(messages, add_generation_prompt=True, chat_template=PLAIN)
        case = build_case(hf, proc, text, ["chat-img"], images=[img])
        expected = hf_generate(hf, case, N)
        (out,) = eng.generate([GenerateRequest(case.prompt, GREEDY, case.mm_inputs)])
        assert out.token_ids == expected, turn
        if turn:
            assert out.num_cached_tokens >= prev_prompt // 4 * 4, turn
        prev_prompt = len(case.prompt)
        answer = proc.tokenizer.decode(out.token_ids, skip_special_tokens=True)
        messages.append({"role": "assistant", "content": answer})
    assert_all_free(eng)
