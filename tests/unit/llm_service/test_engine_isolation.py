"""One request's failure fails that request only: the step goes on for the others, which still equal
HF generate, and no KV block stays held. Tiny temperatures sample greedily (no NaN, no crash)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from PIL import Image

from llm_service.config import EngineConfig
from llm_service.engine import LLMEngine
from llm_service.errors import RequestRejected
from llm_service.multimodal import MultiModalInput
from llm_service.outputs import GenerateRequest
from llm_service.sampler import NonFiniteLogits, sample
from llm_service.sampling_params import SAMPLING_EPS, SamplingParams
from tests.media import make_image_array
from tests.unit.llm_service.hf_ref import RefCase, build_case, hf_generate

N = 8
IMG = "<|vision_start|><|image_pad|><|vision_end|>"
GREEDY = SamplingParams(max_tokens=N)


@pytest.fixture(scope="module")
def vl(tiny_vl_dir: Path) -> tuple[Any, Any]:
    from transformers import AutoProcessor, Qwen2VLForConditionalGeneration

    torch.set_num_threads(1)
    proc = AutoProcessor.from_pretrained(tiny_vl_dir)
    hf = Qwen2VLForConditionalGeneration.from_pretrained(tiny_vl_dir).eval()
    return hf, proc


@pytest.fixture(scope="module")
def cases(vl: tuple[Any, Any]) -> list[RefCase]:
    hf, proc = vl
    img = [Image.fromarray(make_image_array(64 + 28 * i, 56, 40 + i)) for i in range(3)]
    return [
        build_case(hf, proc, "the quick brown fox"),
        build_case(hf, proc, f"look {IMG} at this", images=[img[0]]),
        build_case(hf, proc, "one two three four five six seven eight"),
        build_case(hf, proc, f"and {IMG} this one", images=[img[1]]),
        build_case(hf, proc, f"a poisoned {IMG} item", images=[img[2]]),
    ]


def engine(model_dir: Path, **kw: Any) -> LLMEngine:
    kw.setdefault("block_size", 4)
    kw.setdefault("num_kv_blocks", 256)
    return LLMEngine(EngineConfig(model=str(model_dir), **kw))


def assert_all_free(eng: LLMEngine) -> None:
    st = eng.stats()
    assert not eng.has_unfinished_requests()
    assert st.num_free_blocks == st.num_total_blocks and st.kv_usage == 0.0
    assert not eng.runner.states  # every request's tensors dropped as it left


def poisoned(case: RefCase) -> list[MultiModalInput]:
    """The item's embeddings with one +inf row, as an fp16 vision tower that overflowed returns them:
    valid shape and placement (admitted), but the model's logits for this prompt become NaN."""
    (m,) = case.mm_inputs
    emb = m.embeddings.clone()
    emb[1, 3] = float("inf")
    return [MultiModalInput.of(emb, m.offset, "poison-" + m.mm_hash, m.modality, m.grid_thw)]


def run_all(eng: LLMEngine, reqs: dict[str, GenerateRequest]) -> dict[str, list[Any]]:
    """Step to the end; per request id its tokens and its last output's finish_reason and error."""
    for rid, r in reqs.items():
        eng.add_request(rid, r.prompt_token_ids, r.sampling_params, r.mm_inputs)
    got: dict[str, list[Any]] = {rid: [[], None, None] for rid in reqs}
    while eng.has_unfinished_requests():
        for o in eng.step():
            got[o.request_id][0].extend(o.new_token_ids)
            if o.finished:
                got[o.request_id][1:] = [o.finish_reason, o.error]
    return got


@pytest.mark.parametrize("budget", [512, 6])  # whole prompts in one step; chunked prefill
def test_poisoned_request_fails_alone_and_the_batch_equals_hf(vl, tiny_vl_dir, cases, budget) -> None:
    hf, _ = vl
    *normal, bad = cases
    eng = engine(tiny_vl_dir, max_num_batched_tokens=budget)
    reqs = {f"ok{i}": GenerateRequest(c.prompt, GREEDY, c.mm_inputs) for i, c in enumerate(normal)}
    reqs["bad"] = GenerateRequest(bad.prompt, GREEDY, poisoned(bad))
    got = run_all(eng, reqs)
    tokens, reason, error = got.pop("bad")
    assert tokens == [] and reason == "error"
    assert "NaN or infinite" in error
    for i, c in enumerate(normal):
        assert got[f"ok{i}"][0] == hf_generate(hf, c, N), f"ok{i}"
        assert got[f"ok{i}"][2] is None
    assert_all_free(eng)
    # The engine goes on serving, the clean item included (its prefix cache was not poisoned).
    (again,) = eng.generate([GenerateRequest(bad.prompt, GREEDY, bad.mm_inputs)])
    assert again.token_ids == hf_generate(hf, bad, N) and again.error is None
    assert_all_free(eng)


def test_seeded_neighbour_of_a_culprit_samples_as_if_alone(vl, tiny_vl_dir, cases) -> None:
    _, _ = vl
    *normal, bad = cases
    seeded = SamplingParams(max_tokens=N, temperature=1.0, top_p=0.9, seed=77, ignore_eos=True)
    eng = engine(tiny_vl_dir)
    (alone,) = eng.generate([GenerateRequest(normal[1].prompt, seeded, normal[1].mm_inputs)])
    got = run_all(
        eng,
        {
            "bad": GenerateRequest(bad.prompt, GREEDY, poisoned(bad)),
            "seeded": GenerateRequest(normal[1].prompt, seeded, normal[1].mm_inputs),
            "other": GenerateRequest(normal[0].prompt, seeded, normal[0].mm_inputs),
        },
    )
    assert got["bad"][1] == "error" and got["seeded"][0] == alone.token_ids
    assert_all_free(eng)


def corrupt(eng: LLMEngine, request_id: str) -> None:
    """Break one admitted request's own runner state (its item's embeddings lose rows), so the real
    forward raises a plain RuntimeError for it alone: no culprit is named, bisection must find it."""
    state = eng.runner.states[request_id]
    state.mm = [(off, n, None if emb is None else emb[: n // 2]) for off, n, emb in state.mm]


def test_unnamed_fault_is_bisected_to_its_request(vl, tiny_vl_dir, cases) -> None:
    hf, _ = vl
    eng = engine(tiny_vl_dir)
    for i, c in enumerate(cases):
        eng.add_request(f"r{i}", c.prompt, GREEDY, c.mm_inputs)
    corrupt(eng, "r3")
    got: dict[str, list[int]] = {f"r{i}": [] for i in range(len(cases))}
    errors = {}
    while eng.has_unfinished_requests():
        for o in eng.step():
            got[o.request_id].extend(o.new_token_ids)
            if o.finish_reason == "error":
                errors[o.request_id] = o.error
    assert list(errors) == ["r3"] and errors["r3"].startswith("RuntimeError")
    for i, c in enumerate(cases):
        if i != 3:
            assert got[f"r{i}"] == hf_generate(hf, c, N), f"r{i}"
    assert_all_free(eng)


def test_a_fault_every_request_shares_is_raised(vl, tiny_vl_dir, cases) -> None:
    image_cases = [c for c in cases if c.mm_inputs]
    eng = engine(tiny_vl_dir)
    for i, c in enumerate(image_cases):
        eng.add_request(f"r{i}", c.prompt, GREEDY, c.mm_inputs)
        corrupt(eng, f"r{i}")
    with pytest.raises(RuntimeError):
        eng.step()
    for i in range(len(image_cases)):
        eng.abort(f"r{i}")
    assert_all_free(eng)


@pytest.mark.parametrize("temperature", [1e-300, 1e-7, 0.0, SAMPLING_EPS / 2])
def test_tiny_temperature_is_greedy_and_equals_hf(vl, tiny_vl_dir, cases, temperature) -> None:
    hf, _ = vl
    params = SamplingParams(max_tokens=N, temperature=temperature, seed=3)
    outs = engine(tiny_vl_dir).generate([GenerateRequest(c.prompt, params, c.mm_inputs) for c in cases])
    assert [o.token_ids for o in outs] == [hf_generate(hf, c, N) for c in cases]
    assert all(o.error is None for o in outs)


def test_sampler_is_finite_for_extreme_logits_and_temperatures() -> None:
    gen = torch.Generator().manual_seed(0)
    huge = torch.tensor([[3e38, -3e38, 0.0, 1.0]])
    # Unshifted, 3e38 / 1e-5 overflows to inf and softmax gives NaN; shifted, the argmax has mass 1.
    for t in (SAMPLING_EPS, 1e-3, 1.0, 1e30):
        p = SamplingParams(temperature=t, top_p=0.5 if t > 1 else 1.0)
        tokens, _ = sample(huge, [p], [gen])
        assert tokens == [0], t
    # A subnormal top_p is 0 in float32: the nucleus still keeps the most likely token.
    assert sample(huge, [SamplingParams(temperature=1.0, top_p=5e-324)], [gen])[0] == [0]
    tie = torch.tensor([[1.0, 5.0, 5.0 - 1e-6, -2.0]])
    assert sample(tie, [SamplingParams(temperature=1e-300)], [gen])[0] == [1]


def test_sampler_names_rows_with_nan_or_inf_logits() -> None:
    gen = torch.Generator().manual_seed(0)
    logits = torch.zeros(4, 5)
    logits[1, 2] = float("nan")
    logits[3, 0] = float("inf")
    with pytest.raises(NonFiniteLogits) as e:
        sample(logits, [SamplingParams()] * 4, [gen] * 4)
    assert e.value.rows == [1, 3]
    all_masked = torch.full((1, 5), float("-inf"))
    with pytest.raises(NonFiniteLogits):
        sample(all_masked, [SamplingParams(temperature=1.0)], [gen])


@pytest.mark.parametrize(
    "kw, field",
    [
        ({"temperature": float("nan")}, "temperature"),
        ({"temperature": float("inf")}, "temperature"),
        ({"temperature": -1e-9}, "temperature"),
        ({"top_p": float("nan")}, "top_p"),
        ({"top_p": 0.0}, "top_p"),
        ({"top_k": -2}, "top_k"),
        ({"seed": 1 << 64}, "seed"),
        ({"seed": -(1 << 63) - 1}, "seed"),
        ({"logprobs": 21}, "logprobs"),
        ({"max_tokens": 0}, "max_tokens"),
    ],
)
def test_engine_rejects_out_of_range_params_by_name(kw: dict[str, Any], field: str) -> None:
    with pytest.raises(RequestRejected) as e:
        SamplingParams(**kw).validate()
    assert e.value.code == "bad_sampling_params" and e.value.message.startswith(field)


def test_extreme_seeds_are_accepted() -> None:
    for seed in (-(1 << 63), (1 << 64) - 1, 0):
        SamplingParams(seed=seed, temperature=1.0).validate()
        torch.Generator().manual_seed(seed)


def test_an_errored_output_and_its_exception_cross_processes() -> None:
    import pickle

    from llm_service.errors import RequestFailed
    from llm_service.outputs import RequestOutput

    out = RequestOutput("r", [], None, True, "error", 7, 4, error="NaN logits")
    assert pickle.loads(pickle.dumps(out)) == out
    plain = RequestOutput("r", [3], None, False, None, 7, 4)
    assert pickle.loads(pickle.dumps(plain)).error is None
    err = pickle.loads(pickle.dumps(RequestFailed("r", "NaN logits")))
    assert (err.request_id, err.message, err.status_code, err.code) == (
        "r",
        "NaN logits",
        500,
        "request_failed",
    )
