"""A seeded sampled request handed off from a prefill engine to a decode engine (the tiny Qwen2-VL)
draws the same tokens as on one colocated engine: the prefill side's generator state after the first
token travels with that token (``RequestOutput.rng_state``) and the decode side resumes from it, on a
plain hand-off (the first token with the reservation) and an early one (with the last pull). A state
the decode side's generator cannot take fails the request cleanly, nothing held."""

from __future__ import annotations

import dataclasses
import pickle
from pathlib import Path
from typing import Any

import pytest

from llm_service.engine import LLMEngine
from llm_service.kv_handoff import KVTransferFailed
from llm_service.outputs import RequestOutput
from llm_service.sampling_params import SamplingParams
from tests.unit.llm_service.hf_ref import (
    IMG,
    RefCase,
    assert_all_free,
    build_case,
    engine,
    hf_model,
    image,
    run,
)

SEEDS = (0, 7, 1234, -5)


def sampled(seed: int | None) -> SamplingParams:
    return SamplingParams(temperature=1.0, top_p=0.9, max_tokens=12, seed=seed, ignore_eos=True)


@pytest.fixture(scope="module")
def cases(tiny_vl_dir: Path) -> list[RefCase]:
    hf, proc = hf_model(tiny_vl_dir)
    return [
        build_case(hf, proc, "the quick brown fox jumps over the lazy dog " * 3),
        build_case(hf, proc, f"describe {IMG} please", images=[image(120, 90, 1)]),
    ]


@pytest.fixture(scope="module")
def engines(tiny_vl_dir: Path) -> tuple[LLMEngine, LLMEngine, LLMEngine]:
    """A prefill engine (its prompts in several chunks), a decode engine, and a colocated one."""
    return engine(tiny_vl_dir, max_num_batched_tokens=32), engine(tiny_vl_dir), engine(tiny_vl_dir)


def _prefill(p: LLMEngine, rid: str) -> RequestOutput:
    while True:
        outs = [o for o in p.step() if o.request_id == rid]
        if outs:
            return outs[0]


def hand_off(
    p: LLMEngine,
    d: LLMEngine,
    rid: str,
    case: RefCase,
    params: SamplingParams,
    early: bool,
    tamper: Any = None,
) -> list[int]:
    """Prefill on ``p``, import on ``d`` (the first token with the reservation, or with the last pull
    when ``early``: the reservation made before the prefill ran), decode there: every token."""
    no_embeddings = [dataclasses.replace(m, embeddings=None) for m in case.mm_inputs]
    p.add_request(rid, case.prompt, params, case.mm_inputs, handoff=True)
    if early:
        slots = d.reserve_import(rid, case.prompt, params, no_embeddings, None, None)
    first = _prefill(p, rid)
    assert first.finish_reason == "handoff"
    first = dataclasses.replace(first, finished=False, finish_reason=None)  # as the prefill replica sends it
    first = pickle.loads(pickle.dumps(first))  # its wire form (``RequestOutput.to_wire``), as over the link
    first = tamper(first) if tamper else first
    if not early:
        slots = d.reserve_import(rid, case.prompt, params, no_embeddings, None, first)
    blocks = p.handoff_blocks(rid)
    d.runner.write_kv_blocks(
        slots.block_ids, p.runner.read_kv_blocks(rid, blocks[slots.hit_blocks :], slots.hit_blocks)
    )
    p.release_handoff(rid)
    d.admit_import(rid, first=first if early else None)
    tokens: list[int] = []
    while d.has_unfinished_requests():
        for o in d.step():
            assert o.rng_state is None  # the state stays inside the engines
            tokens += o.new_token_ids
            if o.finish_reason == "error":
                raise KVTransferFailed(o.error or "")
    return tokens


@pytest.mark.parametrize("early", [False, True], ids=["plain", "early"])
def test_seeded_requests_draw_as_on_a_colocated_engine(engines, cases, early: bool) -> None:
    p, d, both = engines
    for seed in SEEDS:
        for i, case in enumerate(cases):
            params = sampled(seed)
            want = run(both, [case], params)[0]
            got = hand_off(p, d, f"s{seed}-{i}-{early}", case, params, early)
            assert got == want, f"seed {seed}, case {i}"
    assert_all_free(d)
    assert not p.runner.states and not d.runner.states and not p.scheduler.handed_off


def test_without_the_state_the_decode_side_draws_otherwise(engines, cases) -> None:
    """The check above could fail: a hand-off whose state is dropped (the decode side's generator
    starts from the seed, as before it travelled) draws other tokens after the first."""
    p, d, both = engines
    drop = lambda f: dataclasses.replace(f, rng_state=None)  # noqa: E731
    differ = 0
    for seed in SEEDS:
        want = run(both, [cases[0]], sampled(seed))[0]
        got = hand_off(p, d, f"n{seed}", cases[0], sampled(seed), False, drop)
        assert got[0] == want[0]  # the first token is the prefill side's
        differ += got != want
    assert differ >= len(SEEDS) // 2  # (a peaked distribution may draw the same by chance)


def test_an_unseeded_handoff_carries_no_state(engines, cases) -> None:
    p, _, _ = engines
    p.add_request("u1", cases[0].prompt, sampled(None), [], handoff=True)
    first = _prefill(p, "u1")
    assert first.finish_reason == "handoff" and first.rng_state is None
    p.release_handoff("u1")


@pytest.mark.parametrize("early", [False, True], ids=["plain", "early"])
@pytest.mark.parametrize("state", [b"\x00" * 16, b"\x00" * 5056], ids=["wrong-size", "invalid"])
def test_a_state_the_generator_cannot_take_fails_the_request_cleanly(engines, cases, early, state) -> None:
    p, d, _ = engines
    rid = f"bad-{early}-{len(state)}"
    with pytest.raises(KVTransferFailed, match="generator state"):
        hand_off(p, d, rid, cases[0], sampled(3), early, lambda f: dataclasses.replace(f, rng_state=state))
    p.release_handoff(rid)
    assert_all_free(d)
    assert not d.runner.states and rid not in d.scheduler.requests
