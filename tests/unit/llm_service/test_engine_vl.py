"""LLMEngine vs transformers on the tiny Qwen2-VL: greedy outputs must agree token for token."""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from llm_service.errors import RequestRejected
from llm_service.outputs import GenerateRequest
from llm_service.sampling_params import SamplingParams
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
    run,
)


@pytest.fixture(scope="module")
def vl(tiny_vl_dir: Path) -> tuple[Any, Any]:
    return hf_model(tiny_vl_dir)


def test_text_only(vl, tiny_vl_dir) -> None:
    hf, proc = vl
    case = build_case(hf, proc, "the quick brown fox jumps over the lazy dog")
    assert run(engine(tiny_vl_dir), [case]) == [hf_generate(hf, case, N)]


def test_one_image(vl, tiny_vl_dir) -> None:
    hf, proc = vl
    case = build_case(hf, proc, f"describe {IMG} please", images=[image(120, 90, 1)])
    assert case.mm_inputs[0].grid_thw == (1, 6, 8)
    assert run(engine(tiny_vl_dir), [case]) == [hf_generate(hf, case, N)]


def test_two_images(vl, tiny_vl_dir) -> None:
    hf, proc = vl
    case = build_case(hf, proc, f"a {IMG} and b {IMG} compare", images=[image(64, 48, 2), image(90, 120, 3)])
    assert len(case.mm_inputs) == 2
    assert run(engine(tiny_vl_dir), [case]) == [hf_generate(hf, case, N)]


def test_video(vl, tiny_vl_dir) -> None:
    hf, proc = vl
    frames = np.stack([make_image_array(64, 48, 10 + i) for i in range(8)])
    case = build_case(hf, proc, f"what happens {VID} here", videos=[frames])
    assert case.mm_inputs[0].grid_thw == (4, 4, 4)  # t > h/2, w/2: exercises the temporal rows
    assert run(engine(tiny_vl_dir), [case]) == [hf_generate(hf, case, N)]


def eight_cases(hf: Any, proc: Any) -> list[RefCase]:
    texts = ["hi", "one two three four five six seven", "a b c d e f g h i j k l m n o p q r s t u v"]
    cases = [build_case(hf, proc, t) for t in texts]
    cases += [
        build_case(hf, proc, f"img {i} {IMG} ok", images=[image(64 + 28 * i, 48, 20 + i)]) for i in range(3)
    ]
    cases.append(build_case(hf, proc, f"x {IMG} y {IMG}", images=[image(56, 56, 30), image(84, 56, 31)]))
    cases.append(build_case(hf, proc, "the end of the list " * 3))
    return cases


def test_eight_concurrent_requests(vl, tiny_vl_dir) -> None:
    hf, proc = vl
    cases = eight_cases(hf, proc)
    assert len({len(c.prompt) for c in cases}) == 8
    eng = engine(tiny_vl_dir)
    assert run(eng, cases) == [hf_generate(hf, c, N) for c in cases]
    assert_all_free(eng)


def test_chunked_prefill_cuts_through_image(vl, tiny_vl_dir) -> None:
    hf, proc = vl
    case = build_case(hf, proc, f"describe {IMG} please now", images=[image(120, 90, 1)])
    item = case.mm_inputs[0]
    budget = 5
    cut_points = range(budget, len(case.prompt), budget)
    assert any(item.offset < c < item.end for c in cut_points)  # a chunk ends inside the image
    other = build_case(hf, proc, "a short text prompt here")
    eng = engine(tiny_vl_dir, max_num_batched_tokens=budget)
    assert run(eng, [case, other]) == [hf_generate(hf, case, N), hf_generate(hf, other, N)]
    assert_all_free(eng)


def test_preemption_small_pool(vl, tiny_vl_dir) -> None:
    hf, proc = vl
    cases = eight_cases(hf, proc)[:6]
    # enough for the largest request alone, far too few for all of them together
    eng = engine(tiny_vl_dir, num_kv_blocks=12, block_size=4)
    assert run(eng, cases) == [hf_generate(hf, c, N) for c in cases]
    assert eng.stats().num_preemptions > 0
    assert_all_free(eng)


def test_prefix_cache_repeat_and_other_image(vl, tiny_vl_dir) -> None:
    hf, proc = vl
    text = f"look at this {IMG} and then describe it in words"
    first = build_case(hf, proc, text, mm_hashes=["img-A"], images=[image(64, 48, 5)])
    other = build_case(hf, proc, text, mm_hashes=["img-B"], images=[image(64, 48, 6)])
    assert first.prompt == other.prompt  # same placeholder ids
    bs = 5
    assert len(first.prompt) % bs != 0
    eng = engine(tiny_vl_dir, block_size=bs)
    ref_first, ref_other = hf_generate(hf, first, N), hf_generate(hf, other, N)
    (a,) = eng.generate([GenerateRequest(first.prompt, GREEDY, first.mm_inputs)])
    assert a.token_ids == ref_first and a.num_cached_tokens == 0
    (b,) = eng.generate([GenerateRequest(first.prompt, GREEDY, first.mm_inputs)])
    assert b.token_ids == ref_first
    assert b.num_cached_tokens == len(first.prompt) // bs * bs  # every full block
    (c,) = eng.generate([GenerateRequest(other.prompt, GREEDY, other.mm_inputs)])
    assert c.token_ids == ref_other
    assert c.num_cached_tokens == other.mm_inputs[0].offset // bs * bs  # only blocks before the image
    st = eng.stats()
    assert st.prefix_hit_tokens == b.num_cached_tokens + c.num_cached_tokens
    assert st.prefix_query_tokens == 3 * len(first.prompt)
    assert_all_free(eng)


def test_logprobs_match_hf_logits(vl, tiny_vl_dir) -> None:
    hf, proc = vl
    case = build_case(hf, proc, f"tell me {IMG} now", images=[image(64, 48, 8)])
    with torch.no_grad():
        logits = hf(**case.hf_inputs).logits[0, -1]
    ref = torch.log_softmax(logits.float(), -1)
    params = SamplingParams(max_tokens=1, logprobs=5)
    (out,) = engine(tiny_vl_dir).generate([GenerateRequest(case.prompt, params, case.mm_inputs)])
    assert out.logprobs is not None
    lp = out.logprobs[0]
    assert lp.token_id == int(ref.argmax())
    assert lp.logprob == pytest.approx(float(ref[lp.token_id]), abs=1e-4)
    top = torch.topk(ref, 5)
    assert [t for t, _ in lp.top] == top.indices.tolist()
    assert [v for _, v in lp.top] == pytest.approx(top.values.tolist(), abs=1e-4)


def test_sampling_seed_topk(vl, tiny_vl_dir) -> None:
    hf, proc = vl
    case = build_case(hf, proc, "once upon a time")
    eng = engine(tiny_vl_dir)
    seeded = SamplingParams(max_tokens=N, temperature=1.0, top_p=0.9, seed=1234, ignore_eos=True)
    alone = run(eng, [case], seeded)[0]
    fillers = eight_cases(hf, proc)[:3]
    batched = run(eng, [*fillers, case], seeded)[-1]  # other requests around it
    assert alone == batched
    other_seed = run(eng, [case], SamplingParams(max_tokens=N, temperature=1.0, seed=99, ignore_eos=True))[0]
    assert other_seed != alone
    topk1 = SamplingParams(max_tokens=N, temperature=1.0, top_k=1, seed=7)
    assert run(eng, [case], topk1)[0] == hf_generate(hf, case, N)


def test_stop_at_eos_and_rejections(vl, tiny_vl_dir) -> None:
    hf, proc = vl
    case = build_case(hf, proc, "stop here please")
    ref = hf_generate(hf, case, N)
    eng = engine(tiny_vl_dir, max_model_len=64, num_kv_blocks=8)
    stop = ref[3]
    (out,) = eng.generate(
        [GenerateRequest(case.prompt, SamplingParams(max_tokens=N, stop_token_ids=(stop,)))]
    )
    assert out.token_ids == ref[: ref.index(stop) + 1] and out.finish_reason == "stop"
    with pytest.raises(RequestRejected) as e:
        eng.add_request("long", [1] * 65, GREEDY)
    assert e.value.code == "prompt_too_long"
    with pytest.raises(RequestRejected) as e:
        eng.add_request("big", [1] * 40, GREEDY)  # 40 + 11 tokens need 13 blocks of 4; the pool has 8
    assert e.value.code == "too_many_blocks"
    with pytest.raises(RequestRejected) as e:
        eng.add_request("t", [1, 2], SamplingParams(top_p=0.0))
    assert e.value.code == "bad_sampling_params"
    img = build_case(hf, proc, f"x {IMG}", images=[image(64, 48, 1)])
    item = img.mm_inputs[0]
    bad_grid = type(item).of(item.embeddings, item.offset, item.mm_hash, "image", (1, 2, 2))
    with pytest.raises(RequestRejected, match="grid_thw") as e:
        eng.add_request("g", img.prompt, GREEDY, [bad_grid])
    assert e.value.code == "bad_mm_input"
    with pytest.raises(RequestRejected, match="outside the prompt"):
        eng.add_request("o", img.prompt[:-3], GREEDY, [item])
    with pytest.raises(RequestRejected, match="overlaps"):
        eng.add_request("ov", img.prompt, GREEDY, [item, item])
    n = item.length
    with pytest.raises(RequestRejected, match=rf"shape \({n}, 8\), expected \[{n}, 64\]"):
        eng.add_request(
            "h", img.prompt, GREEDY, [type(item).of(item.embeddings[:, :8], item.offset, "h", "image")]
        )
    with pytest.raises(RequestRejected, match=rf"shape \({n - 1}, 64\), expected \[{n}, 64\]"):
        eng.add_request("rows", img.prompt, GREEDY, [type(item)(item.feature, item.embeddings[1:])])
    assert not eng.has_unfinished_requests()


def test_online_step_and_abort(vl, tiny_vl_dir) -> None:
    hf, proc = vl
    case = build_case(hf, proc, "step by step")
    eng = engine(tiny_vl_dir)
    eng.add_request("a", case.prompt, GREEDY)
    eng.add_request("b", case.prompt, GREEDY)
    outs = eng.step()
    assert {o.request_id for o in outs} == {"a", "b"} and all(len(o.new_token_ids) == 1 for o in outs)
    st = eng.stats()
    assert st.num_running == 2 and st.num_free_blocks < st.num_total_blocks
    eng.abort("b")
    eng.abort("b")
    eng.abort("never-seen")
    got = outs[0].new_token_ids
    while eng.has_unfinished_requests():
        for o in eng.step():
            assert o.request_id == "a"
            got += o.new_token_ids
    assert got == hf_generate(hf, case, N)
    assert_all_free(eng)


def _drive(eng: Any, rid: str) -> list[int]:
    tokens: list[int] = []
    while eng.has_unfinished_requests():
        for out in eng.step():
            assert out.finish_reason != "error", out.error
            if out.request_id == rid:
                tokens += out.new_token_ids
    return tokens


def _without_rows(case: RefCase) -> list[Any]:
    from llm_service.multimodal import MultiModalInput

    return [MultiModalInput(m.feature, None) for m in case.mm_inputs]


def test_an_image_whose_span_is_prefix_cached_needs_no_embeddings(vl, tiny_vl_dir) -> None:
    """The same prompt again, its image sent without embeddings: its positions come from the prefix
    cache, so the answer is the first one's (and HF's) and the request is never parked."""
    hf, proc = vl
    case = build_case(hf, proc, f"describe {IMG} please", images=[image(120, 90, 1)])
    eng = engine(tiny_vl_dir)
    eng.add_request("first", case.prompt, GREEDY, case.mm_inputs)
    want = _drive(eng, "first")
    assert want == hf_generate(hf, case, N)
    eng.add_request("again", case.prompt, GREEDY, _without_rows(case))
    assert _drive(eng, "again") == want
    assert eng.take_parked() == []
    assert_all_free(eng)


def test_an_unfetched_image_outside_the_prefix_cache_waits_until_supplied(vl, tiny_vl_dir) -> None:
    """A fresh engine caches nothing: the request computes its text up to the image, is reported
    for its embeddings and waits (no step to run meanwhile); once they are supplied it answers as if
    it had had them from the start."""
    hf, proc = vl
    case = build_case(hf, proc, f"describe {IMG} please", images=[image(120, 90, 1)])
    eng = engine(tiny_vl_dir)
    eng.add_request("r", case.prompt, GREEDY, _without_rows(case))
    assert eng.step() == [] and eng.take_parked() == ["r"]
    assert eng.scheduler.requests["r"].num_computed_tokens == case.mm_inputs[0].offset
    assert not eng.has_unfinished_requests()
    with pytest.raises(RequestRejected):  # rows that do not fit the item it was sent without
        m = case.mm_inputs[0]
        eng.supply_embeddings("r", [dataclasses.replace(m, embeddings=m.embeddings[:-1])])
    eng.supply_embeddings("r", case.mm_inputs)
    assert _drive(eng, "r") == hf_generate(hf, case, N)
    assert_all_free(eng)
