"""Prompt logprobs (``SamplingParams.prompt_logprobs``, what ``/v1/completions``' ``echo`` with
``logprobs`` reads) against the log-softmax of transformers' logits over the same prompt: in one
prefill, in chunks, with an image, and after the same prompt is in the prefix cache."""

from __future__ import annotations

import pickle
from pathlib import Path
from typing import Any

import pytest
import torch

from llm_service.outputs import GenerateRequest, RequestOutput, TokenLogprob
from llm_service.sampling_params import SamplingParams
from tests.unit.llm_service.hf_ref import IMG, build_case, engine, hf_model, image

K = 3


@pytest.fixture(scope="module")
def vl(tiny_vl_dir: Path) -> tuple[Any, Any]:
    return hf_model(tiny_vl_dir)


def _reference(hf: Any, case: Any) -> torch.Tensor:
    with torch.no_grad():
        return torch.log_softmax(hf(**case.hf_inputs).logits[0].float(), -1)


def _check(got: list[TokenLogprob] | None, ref: torch.Tensor, prompt: list[int]) -> None:
    assert got is not None and len(got) == len(prompt) - 1
    for p, lp in enumerate(got, start=1):  # row p - 1 scores token p
        assert lp.token_id == prompt[p]
        assert lp.logprob == pytest.approx(float(ref[p - 1, prompt[p]]), abs=1e-4)
        top = torch.topk(ref[p - 1], K)
        assert [t for t, _ in lp.top] == top.indices.tolist()
        assert [v for _, v in lp.top] == pytest.approx(top.values.tolist(), abs=1e-4)


@pytest.mark.parametrize("chunk", [None, 8], ids=["one-prefill", "chunked"])
def test_prompt_logprobs_match_hf(vl: Any, tiny_vl_dir: Path, chunk: int | None) -> None:
    hf, proc = vl
    case = build_case(
        hf, proc, f"look at {IMG} and tell me what the quick brown fox did", images=[image(56, 56, 3)]
    )
    kw = {} if chunk is None else {"max_num_batched_tokens": chunk}
    params = SamplingParams(max_tokens=2, prompt_logprobs=K)
    (out,) = engine(tiny_vl_dir, **kw).generate([GenerateRequest(case.prompt, params, case.mm_inputs)])
    _check(out.prompt_logprobs, _reference(hf, case), case.prompt)


def test_a_cached_prompt_is_computed_again_for_its_logprobs(vl: Any, tiny_vl_dir: Path) -> None:
    hf, proc = vl
    case = build_case(hf, proc, "the quick brown fox jumps over the lazy dog again and again")
    eng = engine(tiny_vl_dir)
    (warm,) = eng.generate([GenerateRequest(case.prompt, SamplingParams(max_tokens=1))])
    (again,) = eng.generate([GenerateRequest(case.prompt, SamplingParams(max_tokens=1))])
    assert warm.prompt_logprobs is None and again.num_cached_tokens > 0  # the prefix cache holds it
    (out,) = eng.generate([GenerateRequest(case.prompt, SamplingParams(max_tokens=1, prompt_logprobs=0))])
    assert out.num_cached_tokens == 0
    assert out.prompt_logprobs is not None and all(lp.top == [] for lp in out.prompt_logprobs)
    ref = _reference(hf, case)
    assert [lp.logprob for lp in out.prompt_logprobs] == pytest.approx(
        [float(ref[p - 1, case.prompt[p]]) for p in range(1, len(case.prompt))], abs=1e-4
    )


def test_prompt_logprobs_cross_the_wire() -> None:
    lps = [TokenLogprob(5, -1.5, [(5, -1.5), (7, -2.0)])]
    out = RequestOutput("r", [1], None, False, None, 3, 0, prompt_logprobs=lps)
    assert pickle.loads(pickle.dumps(out)).prompt_logprobs == lps
    params = SamplingParams(prompt_logprobs=4)
    assert SamplingParams.from_wire(params.to_wire()) == params
