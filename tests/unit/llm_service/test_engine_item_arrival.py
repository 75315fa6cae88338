"""A request admitted before its media items are encoded (issue 37's overlap): the engine computes
its prompt up to the first item it lacks, waits holding its KV blocks, and goes on as each item's
embeddings arrive, in any order. Greedy outputs equal transformers' on the tiny Qwen2-VL whatever
the arrival order, with chunked prefill, and with the waiting request preempted; an abort while it
waits frees everything."""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from llm_service.multimodal import MultiModalInput
from tests.media import make_image_array
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
)


@pytest.fixture(scope="module")
def vl(tiny_vl_dir: Path) -> tuple[Any, Any]:
    return hf_model(tiny_vl_dir)


@pytest.fixture(scope="module")
def three_items(vl: tuple[Any, Any]) -> tuple[RefCase, list[int]]:
    hf, proc = vl
    frames = np.stack([make_image_array(64, 48, 40 + i) for i in range(4)])
    case = build_case(
        hf,
        proc,
        f"first {IMG} then a clip {VID} and last {IMG} compare them",
        images=[image(64, 48, 41), image(90, 56, 42)],
        videos=[frames],
    )
    assert len(case.mm_inputs) == 3
    return case, hf_generate(hf, case, N)


def _pending(items: list[MultiModalInput]) -> list[MultiModalInput]:
    """The items as the engine is first given them: everything but their rows."""
    return [dataclasses.replace(m, embeddings=None) for m in items]


def _step_until_waiting(eng: Any, tokens: list[int]) -> None:
    """Step while there is work; every output is ``r``'s."""
    while eng.has_unfinished_requests():
        for out in eng.step():
            assert out.finish_reason != "error", out.error
            tokens += out.new_token_ids


@pytest.mark.parametrize("order", [(0, 1, 2), (2, 1, 0), (1, 2, 0)])
@pytest.mark.parametrize("budget", [512, 7])
def test_items_arriving_one_by_one_in_any_order_give_hf_s_answer(
    tiny_vl_dir: Path, three_items: tuple[RefCase, list[int]], order: tuple[int, ...], budget: int
) -> None:
    case, want = three_items
    items = sorted(case.mm_inputs, key=lambda m: m.offset)
    eng = engine(tiny_vl_dir, max_num_batched_tokens=budget)
    eng.add_request("r", case.prompt, GREEDY, _pending(items))
    req = eng.scheduler.requests["r"]
    tokens: list[int] = []
    _step_until_waiting(eng, tokens)
    assert eng.take_parked() == ["r"] and req.num_computed_tokens == items[0].offset
    arrived: set[int] = set()
    for i in order:
        eng.supply_embeddings("r", [items[i]])
        arrived.add(i)
        _step_until_waiting(eng, tokens)
        first_missing = min((j for j in range(3) if j not in arrived), default=None)
        if first_missing is not None:  # computed exactly up to the first item still missing
            assert req.num_computed_tokens == items[first_missing].offset and not tokens
    assert tokens == want and eng.take_parked() == []
    assert_all_free(eng)


def test_a_waiting_request_preempted_for_blocks_resumes_with_hf_s_answer(
    vl: tuple[Any, Any], tiny_vl_dir: Path, three_items: tuple[RefCase, list[int]]
) -> None:
    """A small pool: a text request's decode takes the blocks of the one waiting for its items (the
    latest admitted), which computes its prompt again once they are in."""
    hf, proc = vl
    case, want = three_items
    long_text = build_case(hf, proc, "count with me " * 6)
    items = sorted(case.mm_inputs, key=lambda m: m.offset)
    # each fits alone; the text one's decode needs the blocks the waiting one holds
    need_text, need_r = (-(-(len(c.prompt) + n) // 4) for c, n in ((long_text, 40), (case, N)))
    assert need_r <= need_text + 1 and -(-items[0].offset // 4) > 1
    eng = engine(tiny_vl_dir, num_kv_blocks=need_text + 1)
    eng.add_request("text", long_text.prompt, dataclasses.replace(GREEDY, max_tokens=40))
    eng.add_request("r", case.prompt, GREEDY, _pending(items))
    got: dict[str, list[int]] = {"text": [], "r": []}
    while eng.has_unfinished_requests():
        for out in eng.step():
            assert out.finish_reason != "error", out.error
            got[out.request_id] += out.new_token_ids
    assert eng.scheduler.requests["r"].num_preemptions >= 1 and not got["r"]
    eng.supply_embeddings("r", items[1:])
    eng.supply_embeddings("r", items[:1])
    while eng.has_unfinished_requests():
        for out in eng.step():
            assert out.finish_reason != "error", out.error
            got[out.request_id] += out.new_token_ids
    assert got["r"] == want
    assert got["text"] == hf_generate(hf, long_text, 40)
    assert_all_free(eng)


def test_an_abort_while_waiting_frees_everything(
    tiny_vl_dir: Path, three_items: tuple[RefCase, list[int]]
) -> None:
    """What the replica does when an item fails to encode: the request waiting for it is aborted,
    and its blocks, seat and parked entry are gone; a late arrival for it is ignored."""
    case, _ = three_items
    items = sorted(case.mm_inputs, key=lambda m: m.offset)
    eng = engine(tiny_vl_dir)
    eng.add_request("r", case.prompt, GREEDY, _pending(items))
    _step_until_waiting(eng, [])
    eng.supply_embeddings("r", [items[0]])
    _step_until_waiting(eng, [])
    assert eng.stats().num_free_blocks < eng.stats().num_total_blocks
    eng.abort("r")
    eng.supply_embeddings("r", [items[1]])
    assert not eng.scheduler.requests and not eng.scheduler.running and not eng.scheduler.parked
    assert_all_free(eng)
