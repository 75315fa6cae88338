"""E/P/D hand-off for the families whose KV is more than one group of full-attention blocks, on two
engines each: Gemma 3 and Gemma 4 (a sliding-window block group: only the window's blocks move;
Gemma 4's KV-shared layers own no cache, so nothing of theirs moves) and Qwen3.5 (hybrid: the
linear-attention conv and recurrent state after the prompt moves with the blocks). The prefill engine
computes the prompt in chunks and samples the first token; the decode engine runs on from there.
Greedy tokens must equal HF ``generate``; a longer next turn pulls only what the decode side's prefix
cache lacks; a decode side short of blocks preempts and recomputes; nothing is left held."""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

import pytest

from llm_service.engine import LLMEngine
from llm_service.kv_cache_manager import cdiv
from llm_service.kv_handoff import ImportSlots, KVBlocks
from llm_service.outputs import GenerateRequest, RequestOutput
from llm_service.sampling_params import SamplingParams
from llm_service.sequence import Request
from tests.tiny_dirs import tiny_model_dir
from tests.unit.llm_service.hf_ref import (
    GREEDY,
    IMG,
    N,
    RefCase,
    assert_all_free,
    build_case,
    engine,
    hf_generate,
    hf_model,
    image,
)


def prefill(eng: LLMEngine, rid: str, case: RefCase, params: SamplingParams = GREEDY) -> RequestOutput:
    eng.add_request(rid, case.prompt, params, case.mm_inputs, handoff=True)
    while True:
        outs = [o for o in eng.step() if o.request_id == rid]
        if outs:
            return outs[0]


def transfer(p: LLMEngine, d: LLMEngine, rid: str, slots: ImportSlots) -> KVBlocks:
    """What ``PrefillHandoffs.pull`` and ``DecodeImports`` do over the link: read on ``p``, write on ``d``."""
    held = p.handoff_kv(rid)
    payload = p.runner.read_kv_blocks(
        rid,
        held.block_ids[slots.hit_blocks :],
        slots.hit_blocks,
        held.window_ids[slots.window_from :],
        slots.window_from,
        held.state_slot,
        held.snapshot_slot,
    )
    d.runner.write_kv_blocks(
        slots.block_ids, payload, slots.window_ids, slots.state_slot, slots.snapshot_slot
    )
    p.release_handoff(rid)
    d.admit_import(rid, payload.snapshot)
    return payload


def decoded(p: LLMEngine, d: LLMEngine, rid: str, case: RefCase) -> tuple[list[int], ImportSlots, KVBlocks]:
    """The answer's tokens (the first one the prefill side's), the decode side's slots, what moved."""
    first = prefill(p, rid, case)
    assert first.finish_reason == "handoff" and len(first.new_token_ids) == 1
    no_embeddings = [dataclasses.replace(m, embeddings=None) for m in case.mm_inputs]
    slots = d.reserve_import(rid, case.prompt, GREEDY, no_embeddings, None, first)
    payload = transfer(p, d, rid, slots)
    tokens: list[int] = []
    while d.has_unfinished_requests():
        for o in d.step():
            tokens += o.new_token_ids
    assert not p.scheduler.requests and not p.scheduler.handed_off
    return tokens, slots, payload


def next_turn(one: RefCase, answer: list[int], more: list[int]) -> RefCase:
    """A chat's next turn: the first turn's prompt, its answer and more tokens (HF's inputs extended
    alike: the new positions are text)."""
    import torch

    extra = [*answer, *more]
    n = len(one.prompt)
    inputs = dict(one.hf_inputs)
    for key, value in one.hf_inputs.items():
        if isinstance(value, torch.Tensor) and value.dim() == 2 and value.shape == (1, n):
            fill = extra if key == "input_ids" else [int(key == "attention_mask")] * len(extra)
            inputs[key] = torch.cat([value, torch.tensor([fill], dtype=value.dtype)], dim=1)
    return RefCase(one.prompt + extra, one.mm_inputs, inputs)


def window_layers(eng: LLMEngine) -> list[bool]:
    return [w is not None for w in eng.runner.text_config.kv_layer_windows()]


# ---- Gemma 3: window layers -----------------------------------------------------------------------
@pytest.fixture(scope="module")
def gemma3() -> tuple[Any, Any]:
    return hf_model(tiny_model_dir("gemma3"))


def test_gemma3_moves_only_the_window_blocks_and_equals_hf(gemma3) -> None:
    from tests.unit.llm_service.models.test_engine_gemma3 import case

    model_dir = tiny_model_dir("gemma3")
    p, d = engine(model_dir, max_num_batched_tokens=24), engine(model_dir)
    assert p.runner.window is not None
    cases = [
        case(gemma3, "the quick brown fox jumps over the lazy dog " * 3),
        case(gemma3, "describe <image> please", [image(96, 64, 1)]),
        case(gemma3, "a <image> and b <image> compare", [image(64, 48, 2), image(90, 120, 3)]),
    ]
    bs, window = p.config.block_size, p.runner.window
    for i, c in enumerate(cases):
        tokens, slots, payload = decoded(p, d, f"g{i}", c)
        assert tokens == hf_generate(gemma3[0], c, N), i
        n = len(c.prompt)
        # the window layers' blocks: those the first decode reads, never the whole prompt's
        assert slots.window_from == (n - window + 1) // bs
        assert len(slots.window_ids) == cdiv(n, bs) - slots.window_from < cdiv(n, bs)
        flags = window_layers(p)
        assert any(flags) and not all(flags)
        for shape, w in zip(payload.shapes, flags, strict=True):
            assert shape[1] == (len(slots.window_ids) if w else cdiv(n, bs))
    assert_all_free(d)


def test_gemma3_next_turn_and_decode_side_preemption(gemma3) -> None:
    """The decode side registered both groups' imported blocks: a longer next turn pulls only the
    rest; a decode side short of blocks preempts and recomputes from its cache, equal to HF."""
    from tests.unit.llm_service.models.test_engine_gemma3 import case

    model_dir = tiny_model_dir("gemma3")
    p, d = engine(model_dir, max_num_batched_tokens=24), engine(model_dir)
    turn = "look <image> and tell me what you see in it, in detail"
    one = case(gemma3, turn, [image(80, 64, 7)])
    answer, _, _ = decoded(p, d, "t1", one)
    two = next_turn(one, answer, gemma3[1].tokenizer.encode(" and then more words", add_special_tokens=False))
    tokens, slots, _ = decoded(p, d, "t2", two)
    assert tokens == hf_generate(gemma3[0], two, N)
    # turn one's prompt and answer (its window blocks too) were in the decode side's cache: not pulled
    assert slots.hit_blocks == (len(one.prompt) + len(answer) - 1) // p.config.block_size
    _preempted_equal_colocated(model_dir, num_kv_blocks=24, max_num_batched_tokens=24)


def test_gemma3_decode_side_preemption_of_image_requests_swaps_their_window_blocks(gemma3) -> None:
    """Image requests preempted on the decode side, their blocks evicted: swapped out and back in, the
    window group only from the first block the next query reads; equal to HF."""
    from tests.unit.llm_service.models.test_engine_gemma3 import case
    from tests.unit.llm_service.test_kv_handoff import preempted_images_equal_hf

    cases = [
        case(gemma3, "describe <image> please, in a few words", [image(96, 64, 11 + i)], {0: f"img-{i}"})
        for i in range(4)
    ]
    d, failed = preempted_images_equal_hf(gemma3[0], tiny_model_dir("gemma3"), cases)
    assert not failed
    assert d.runner.window is not None and len(cases[0].prompt) > d.runner.window  # past the window


def _preempted_equal_colocated(model_dir: Path, **decode_kw: Any) -> None:
    """Four imported text requests whose decodes outgrow the decode engine's pool: preempted and
    recomputed there; every answer equals a colocated engine's."""
    prompts = [[(5 * i + 17 * r) % 130 + 15 for i in range(20)] for r in range(4)]
    params = SamplingParams(max_tokens=12, ignore_eos=True)
    expected = [
        o.token_ids for o in engine(model_dir).generate([GenerateRequest(q, params) for q in prompts])
    ]
    p, d = engine(model_dir), engine(model_dir, **decode_kw)
    for i, q in enumerate(prompts):
        first = prefill(p, f"q{i}", RefCase(q, [], {}), params)
        transfer(p, d, f"q{i}", d.reserve_import(f"q{i}", q, params, [], None, first))
    got: dict[str, list[int]] = {f"q{i}": [] for i in range(4)}
    while d.has_unfinished_requests():
        for o in d.step():
            got[o.request_id] += o.new_token_ids
    assert d.scheduler.num_preemptions > 0
    assert [got[f"q{i}"] for i in range(4)] == expected
    assert_all_free(d)


# ---- Gemma 4: window layers and KV-shared layers ---------------------------------------------------
@pytest.fixture(scope="module")
def gemma4() -> tuple[Any, Any]:
    return hf_model(tiny_model_dir("gemma4"))


def test_gemma4_moves_owner_layers_window_blocks_and_equals_hf(gemma4) -> None:
    from tests.media import make_audio_array
    from tests.unit.llm_service.models.test_engine_gemma4 import case

    model_dir = tiny_model_dir("gemma4")
    p, d = engine(model_dir, max_num_batched_tokens=72), engine(model_dir)
    cfg = p.runner.text_config
    cases = [
        case(gemma4, "the quick brown fox jumps over the lazy dog " * 3),
        case(gemma4, "describe <image> please", [image(64, 48, 1)]),
        case(gemma4, "<image> and <audio> together", [image(72, 56, 4)], [make_audio_array(0.9)]),
    ]
    for i, c in enumerate(cases):
        tokens, slots, payload = decoded(p, d, f"g{i}", c)
        assert tokens == hf_generate(gemma4[0], c, N), i
        # one buffer per layer that owns a cache: the KV-shared layers read their owners' and move nothing
        assert len(payload.shapes) == len(p.runner.kv_caches) < len(cfg.kv_source)
        assert len(slots.window_ids) < cdiv(len(c.prompt), p.config.block_size)
    assert_all_free(d)


# ---- Qwen3.5: linear-attention state -------------------------------------------------------------
@pytest.fixture(scope="module")
def qwen35() -> tuple[Any, Any]:
    return hf_model(tiny_model_dir("qwen3.5"))


@pytest.mark.slow
def test_qwen3_5_moves_the_linear_state_and_equals_hf(qwen35) -> None:
    from tests.unit.llm_service.models.test_engine_qwen3_5 import video_case

    hf, proc = qwen35
    model_dir = tiny_model_dir("qwen3.5")
    p, d = engine(model_dir, max_num_batched_tokens=16), engine(model_dir)
    cases = [
        build_case(hf, proc, "the quick brown fox jumps over the lazy dog " * 3),
        build_case(hf, proc, f"describe {IMG} please", images=[image(96, 64, 1)]),
        build_case(hf, proc, f"a {IMG} and b {IMG} compare", images=[image(64, 64, 2), image(96, 128, 3)]),
        video_case(hf, proc, "<|vision_start|><|video_pad|><|vision_end|>what happens?"),
    ]
    states = p.runner.linear_states
    assert states is not None
    for i, c in enumerate(cases):
        tokens, slots, payload = decoded(p, d, f"h{i}", c)
        assert tokens == hf_generate(hf, c, N), i
        assert slots.state_slot is not None and payload.snapshot
        # conv then recurrent per linear layer: the state after the prompt, then the snapshot at its
        # last full block, which the decode side filed as a colocated engine files its own
        assert len(payload.states) == 4 * len(states.conv)
        # so a colocated-style hit there (a preempted request's resume) reaches the prompt's last full
        # block: the KV blocks and the snapshot at their end
        spans = [(m.offset, m.length, m.mm_hash) for m in c.mm_inputs]
        probe = Request("probe", [*c.prompt, 0], GREEDY, mm_spans=spans)
        assert len(d.kv.get_computed_blocks(probe)) == len(c.prompt) // d.config.block_size
    assert_all_free(d)
    assert d.kv.states.num_free == d.kv.states.num_slots  # type: ignore[attr-defined]


def test_qwen3_5_next_turn_and_decode_side_preemption(qwen35) -> None:
    hf, proc = qwen35
    model_dir = tiny_model_dir("qwen3.5")
    p, d = engine(model_dir, max_num_batched_tokens=16), engine(model_dir)
    turn = f"look {IMG} and tell me what you see in it, in detail"
    one = build_case(hf, proc, turn, images=[image(80, 64, 7)])
    answer, _, _ = decoded(p, d, "t1", one)
    two = next_turn(one, answer, proc.tokenizer.encode(" and then more words", add_special_tokens=False))
    tokens, slots, _ = decoded(p, d, "t2", two)
    assert tokens == hf_generate(hf, two, N)
    # the imported blocks and the generated ones were registered: only the rest was pulled
    assert slots.hit_blocks == (len(one.prompt) + len(answer) - 1) // p.config.block_size
    _preempted_equal_colocated(model_dir, num_kv_blocks=24)


def test_qwen3_5_decode_side_preemption_of_image_requests_swaps_their_state(qwen35) -> None:
    """Image requests preempted on the decode side, their blocks evicted: their KV and their linear
    layers' state slot swapped out and back in (no snapshot, no recompute); equal to HF."""
    from tests.unit.llm_service.test_kv_handoff import preempted_images_equal_hf

    hf, proc = qwen35
    cases = [
        build_case(
            hf, proc, f"describe {IMG} please, in a few words", [f"img-{i}"], images=[image(96, 64, 11 + i)]
        )
        for i in range(4)
    ]
    d, failed = preempted_images_equal_hf(hf, tiny_model_dir("qwen3.5"), cases)
    assert not failed
    assert d.kv.states.num_free == d.kv.states.num_slots  # type: ignore[attr-defined]
