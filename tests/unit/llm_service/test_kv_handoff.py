"""E/P/D hand-off on two engines of the tiny Qwen2-VL: a prefill engine runs the prompt (chunked) and
samples the first token; its blocks are read, written into blocks a decode engine allocated, and the
decode engine runs on. Greedy tokens must equal HF generate; blocks are registered under the same
chained hashes on both sides; nothing is left held. Plus the prefill side's pin books (pure)."""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

import pytest

from llm_service.engine import LLMEngine
from llm_service.kv_handoff import HandoffPins, HeldKV
from llm_service.outputs import GenerateRequest, RequestOutput
from llm_service.sampling_params import SamplingParams
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


@pytest.fixture(scope="module")
def vl(tiny_vl_dir: Path) -> tuple[Any, Any]:
    return hf_model(tiny_vl_dir)


@pytest.fixture(scope="module")
def pair(tiny_vl_dir: Path) -> tuple[LLMEngine, LLMEngine]:
    # a small chunk budget: the prefill side computes long prompts in several chunks
    return engine(tiny_vl_dir, max_num_batched_tokens=32), engine(tiny_vl_dir)


def prefill(eng: LLMEngine, rid: str, case: RefCase, params: SamplingParams = GREEDY) -> RequestOutput:
    eng.add_request(rid, case.prompt, params, case.mm_inputs, handoff=True)
    while True:
        outs = [o for o in eng.step() if o.request_id == rid]
        if outs:
            return outs[0]


def hand_off(p: LLMEngine, d: LLMEngine, rid: str, case: RefCase) -> tuple[list[int], int]:
    """Prefill on ``p``, import on ``d``, decode there to the end: the tokens and the decode side's hits."""
    first = prefill(p, rid, case)
    assert first.finish_reason == "handoff" and len(first.new_token_ids) == 1
    blocks = p.handoff_blocks(rid)
    no_embeddings = [dataclasses.replace(m, embeddings=None) for m in case.mm_inputs]
    slots = d.reserve_import(rid, case.prompt, GREEDY, no_embeddings, None, first)
    payload = p.runner.read_kv_blocks(rid, blocks[slots.hit_blocks :], slots.hit_blocks)
    assert payload.num_blocks == len(slots.block_ids) == len(blocks) - slots.hit_blocks
    d.runner.write_kv_blocks(slots.block_ids, payload)
    p.release_handoff(rid)
    d.admit_import(rid)
    tokens: list[int] = []
    while d.has_unfinished_requests():
        for o in d.step():
            tokens += o.new_token_ids
    assert p.scheduler.requests == {} and not p.scheduler.handed_off
    return tokens, slots.hit_blocks


def test_text_one_and_two_images_equal_hf(vl, pair) -> None:
    hf, proc = vl
    p, d = pair
    cases = [
        build_case(hf, proc, "the quick brown fox jumps over the lazy dog " * 3),
        build_case(hf, proc, f"describe {IMG} please", images=[image(120, 90, 1)]),
        build_case(hf, proc, f"a {IMG} and b {IMG} compare", images=[image(64, 48, 2), image(90, 120, 3)]),
    ]
    for i, case in enumerate(cases):
        tokens, _ = hand_off(p, d, f"r{i}", case)
        assert tokens == hf_generate(hf, case, N)
    assert_all_free(d)
    assert not p.runner.states and p.stats().num_free_blocks == p.stats().num_total_blocks


def test_next_turn_hits_both_sides_under_the_same_hashes(vl, pair) -> None:
    """The prefill side keeps the blocks it handed off as cache; the decode side registered the imported
    ones under the same chained hashes, so a longer prompt sharing the prefix pulls only the rest."""
    hf, proc = vl
    p, d = pair
    turn = f"look {IMG} and tell me what you see in it, in detail"
    first = build_case(hf, proc, turn, images=[image(80, 64, 7)])
    hand_off(p, d, "t1", first)
    second = build_case(hf, proc, turn + " and then more words follow here", images=[image(80, 64, 7)])
    assert second.prompt[: len(first.prompt)] == first.prompt
    tokens, decode_hits = hand_off(p, d, "t2", second)
    assert tokens == hf_generate(hf, second, N)
    bs = p.config.block_size
    assert decode_hits == len(first.prompt) // bs  # every full block of turn one: not pulled again
    assert p.stats().prefix_hit_tokens >= (len(first.prompt) // bs) * bs  # the prefill side's own hit


def test_failed_import_frees_its_blocks(vl, pair) -> None:
    hf, proc = vl
    p, d = pair
    case = build_case(hf, proc, "words and more words to fill a few blocks of kv")
    first = prefill(p, "f1", case)
    free = d.stats().num_free_blocks
    d.reserve_import("f1", case.prompt, GREEDY, [], None, first)
    assert d.stats().num_free_blocks < free
    d.cancel_import("f1")
    assert d.stats().num_free_blocks == free and not d.runner.states
    p.abort("f1")  # an abort of a handed-off request frees its pin's blocks too
    assert not p.scheduler.handed_off


def test_first_token_that_ends_the_request_is_no_handoff(vl, pair) -> None:
    hf, proc = vl
    p, _ = pair
    case = build_case(hf, proc, "one token only")
    out = prefill(p, "s1", case, SamplingParams(max_tokens=1))
    assert out.finish_reason == "length" and not p.scheduler.handed_off


def test_pins_end_once_by_pull_or_deadline() -> None:
    now = [0.0]
    pins = HandoffPins(clock=lambda: now[0])
    pins.pin("a", HeldKV([3, 4]), deadline_s=5.0)
    pins.pin("b", HeldKV([7]), deadline_s=5.0)
    assert pins.take("a") == HeldKV([3, 4])
    assert pins.take("a") is None  # one pull per hand-off
    now[0] = 6.0
    assert pins.expire("a") is False  # a pull started in time runs to its end
    assert pins.done("a") is True and pins.done("a") is False
    assert pins.take("b") is None  # past its deadline: no pull
    assert pins.expire("b") is True and pins.expire("b") is False
    assert len(pins) == 0
    old = pins.pin("c", HeldKV([1]), deadline_s=5.0)
    pins.pin("c", HeldKV([2], [0, 5], 1, state_slot=3), deadline_s=50.0)  # prefilled again: replaced
    assert pins.expire("c", old) is False and pins.take("c") == HeldKV([2], [0, 5], 1, 3)


@pytest.mark.slow
@pytest.mark.parametrize("family", ["qwen2.5-vl", "qwen3-vl", "qwen2-audio"])
def test_other_families_hand_off_equal_to_hf(family: str) -> None:
    """The families whose KV is one group of full-attention blocks: a text prompt handed off equals
    HF generate on the same weights."""
    from tests.hf_oracle import hf_generate_ids
    from tests.tiny_dirs import tiny_model_dir

    model_dir = tiny_model_dir(family)
    p, d = engine(model_dir, max_num_batched_tokens=16), engine(model_dir)
    prompt = [(11 * i + 5) % 120 + 20 for i in range(29)]
    case = RefCase(prompt, [], {})
    tokens, _ = hand_off(p, d, "x", case)
    assert tokens == hf_generate_ids(model_dir, prompt, N)
    assert_all_free(d)


def test_decode_side_preemption_recomputes_from_the_imported_blocks(tiny_vl_dir: Path) -> None:
    """Four imported requests whose decodes outgrow the decode engine's KV pool: some are preempted and
    recomputed there from the imported blocks its prefix cache holds (no embeddings, no prefill
    replica); every answer still equals a colocated engine's."""
    prompts = [[(5 * i + 17 * r) % 130 + 15 for i in range(20)] for r in range(4)]
    params = SamplingParams(max_tokens=12, ignore_eos=True)
    cases = [RefCase(p, [], {}) for p in prompts]
    expected = [
        o.token_ids for o in engine(tiny_vl_dir).generate([GenerateRequest(p, params) for p in prompts])
    ]
    p, d = engine(tiny_vl_dir), engine(tiny_vl_dir, num_kv_blocks=24)  # 4 x 8 blocks at their peak: 32
    for i, case in enumerate(cases):
        first = prefill(p, f"q{i}", case, params)
        slots = d.reserve_import(f"q{i}", case.prompt, params, [], None, first)
        d.runner.write_kv_blocks(
            slots.block_ids, p.runner.read_kv_blocks(f"q{i}", p.handoff_blocks(f"q{i}"), 0)
        )
        p.release_handoff(f"q{i}")
        d.admit_import(f"q{i}")
    got: dict[str, list[int]] = {f"q{i}": [] for i in range(4)}
    while d.has_unfinished_requests():
        for o in d.step():
            got[o.request_id] += o.new_token_ids
    assert d.scheduler.num_preemptions > 0
    assert [got[f"q{i}"] for i in range(4)] == expected
    assert_all_free(d)


def preempted_images_equal_hf(
    hf: Any, model_dir: Path, cases: list[RefCase], spare: int = 2, n: int = 32, swap_mib: float | None = None
) -> tuple[LLMEngine, dict[str, BaseException]]:
    """Image requests imported into a decode engine whose pool holds their prompts and ``spare`` blocks
    more: their ``n``-token decodes outgrow it, so some are preempted and their blocks taken by the
    others (the images' blocks evicted from its prefix cache). With no embeddings there (the decode
    pool never fetches media), they are swapped to host memory and back; every answer equals HF
    ``generate``, but for those ended because their copy would have passed the swap space
    (``swap_mib``: ``kv_swap_space_mib``), returned with their errors. After every step the swap
    space's books equal the bytes it holds, within its budget. Returns the decode engine."""
    params = SamplingParams(max_tokens=n)
    p = engine(model_dir, max_num_batched_tokens=32)
    bs = p.config.block_size
    d = engine(
        model_dir,
        num_kv_blocks=sum(-(-len(c.prompt) // bs) for c in cases) + spare,
        kv_swap_space_mib=swap_mib,
    )
    for i, case in enumerate(cases):
        rid = f"m{i}"
        first = prefill(p, rid, case, params)
        held = p.handoff_kv(rid)
        no_embeddings = [dataclasses.replace(m, embeddings=None) for m in case.mm_inputs]
        slots = d.reserve_import(rid, case.prompt, params, no_embeddings, None, first)
        payload = p.runner.read_kv_blocks(
            rid,
            held.block_ids[slots.hit_blocks :],
            slots.hit_blocks,
            held.window_ids[slots.window_from :],
            slots.window_from,
            held.state_slot,
        )
        d.runner.write_kv_blocks(slots.block_ids, payload, slots.window_ids, slots.state_slot)
        p.release_handoff(rid)
        d.admit_import(rid)
    got: dict[str, list[int]] = {f"m{i}": [] for i in range(len(cases))}
    failed: dict[str, BaseException] = {}
    budget = d.swap.budget_bytes
    assert budget is not None
    while d.has_unfinished_requests():
        for o in d.step():
            assert o.finish_reason != "error", o.error
            got[o.request_id] += o.new_token_ids
        failed.update(d.take_failed())
        held = sum(blocks.nbytes for _, blocks in d.swap._held.values())
        assert d.swap.held_bytes == held <= budget
    for i, case in enumerate(cases):
        if f"m{i}" not in failed:
            assert got[f"m{i}"] == hf_generate(hf, case, n), i
    assert d.scheduler.num_preemptions + d.swap.refused > 0 and d.swap.swapped_out + d.swap.refused > 0
    assert_all_free(d)
    assert len(d.swap) == 0 and d.swap.held_bytes == 0 and not d.runner.states
    return d, failed


def test_decode_side_preemption_of_image_requests_swaps_their_kv(vl, tiny_vl_dir: Path) -> None:
    hf, proc = vl
    cases = [
        build_case(
            hf, proc, f"describe {IMG} please, in a few words", [f"img-{i}"], images=[image(96, 64, 11 + i)]
        )
        for i in range(4)
    ]
    d, failed = preempted_images_equal_hf(hf, tiny_vl_dir, cases)
    assert not failed and d.swap.refused == 0  # the default budget: the KV cache's size


def test_a_swap_past_the_swap_space_ends_its_request_with_a_retryable_503(vl, tiny_vl_dir: Path) -> None:
    """``kv_swap_space_mib`` smaller than a preempted request's copy (its prompt's blocks alone): the
    request that would be swapped out ends instead (``kv_swap_full``, 503, Retry-After), its blocks
    freed for the others, which equal HF; nothing is held in host memory past the budget. (The
    default budget, the KV cache's size, swapped every one: the test above.)"""
    hf, proc = vl
    cases = [
        build_case(
            hf, proc, f"describe {IMG} please, in a few words", [f"img-{i}"], images=[image(96, 64, 11 + i)]
        )
        for i in range(4)
    ]
    from llm_service.kv_io import swap_sizes

    block = swap_sizes(engine(tiny_vl_dir, num_kv_blocks=8).runner).block
    prompt = -(-len(cases[0].prompt) // 4) * block  # the least a preempted request's copy takes
    d, failed = preempted_images_equal_hf(hf, tiny_vl_dir, cases, swap_mib=0.5 * prompt / 2**20)
    assert failed and d.swap.refused == len(failed), (d.swap.swapped_out, d.swap.refused)
    for err in failed.values():
        assert (getattr(err, "status_code", None), getattr(err, "code", None)) == (503, "kv_swap_full")
        assert getattr(err, "retry_after_s", None) and "kv_swap_space_mib" in str(err)
