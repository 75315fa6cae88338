"""Structured outputs in the engine: greedy outputs under a grammar equal HF ``generate`` with the same
grammar's mask (xgrammar's own transformers logits processor), outputs match their grammar, bad
grammars are refused by name, and the matcher survives preemption and failed-step replays."""

from __future__ import annotations

import asyncio
import json
import re
from pathlib import Path
from typing import Any

import pytest
import torch

from llm_service.errors import RequestRejected
from llm_service.outputs import GenerateRequest
from llm_service.sampling_params import SamplingParams
from llm_service.structured.spec import StructuredSpec
from tests.unit.llm_service.hf_ref import (
    IMG,
    RefCase,
    assert_all_free,
    build_case,
    engine,
    hf_generate_constrained,
    hf_model,
    image,
)

PERSON = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 12},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "tags": {"type": "array", "items": {"enum": ["a", "b", "c"]}, "maxItems": 3},
    },
    "required": ["name", "age", "tags"],
    "additionalProperties": False,
}


@pytest.fixture(scope="module")
def vl(tiny_vl_dir: Path) -> tuple[Any, Any]:
    return hf_model(tiny_vl_dir)


@pytest.fixture(scope="module")
def eng(tiny_vl_dir: Path) -> Any:
    return engine(tiny_vl_dir)


def _gen(eng: Any, case: RefCase, params: SamplingParams) -> Any:
    (out,) = eng.generate([GenerateRequest(case.prompt, params, case.mm_inputs)])
    return out


@pytest.mark.parametrize(
    "spec",
    [
        StructuredSpec.json_schema(PERSON),
        StructuredSpec("regex", r"[a-z]{2,6}-\d{3}"),
        StructuredSpec.choice(["positive", "negative", "neutral"]),
    ],
    ids=["json", "regex", "choice"],
)
def test_greedy_under_a_grammar_equals_hf_generate_with_the_same_mask(vl, eng, spec) -> None:
    hf, proc = vl
    case = build_case(hf, proc, f"describe {IMG} as json", images=[image(64, 48, 5)])
    params = SamplingParams(max_tokens=96, structured=spec)
    out = _gen(eng, case, params)
    assert out.token_ids == hf_generate_constrained(hf, case, eng.grammars, spec, 96)
    assert out.finish_reason == "stop"  # the grammar completed and its stop token ended it
    text = proc.tokenizer.decode(out.token_ids, skip_special_tokens=True)
    if spec.kind == "json":
        doc = json.loads(text)
        assert set(doc) == {"name", "age", "tags"} and 0 <= doc["age"] <= 120
        assert not re.search(r"\s", text.replace(doc["name"], ""))  # compact: no free whitespace
    elif spec.kind == "regex":
        assert re.fullmatch(r"[a-z]{2,6}-\d{3}", text)
    else:
        assert text in ("positive", "negative", "neutral")
    assert_all_free(eng)


def test_sampled_outputs_match_and_seeded_ones_repeat(vl, eng) -> None:
    hf, proc = vl
    case = build_case(hf, proc, "say something")
    spec = StructuredSpec.json_schema(PERSON)
    params = SamplingParams(max_tokens=128, temperature=1.0, seed=11, structured=spec)
    outs = eng.generate([GenerateRequest(case.prompt, params, [])] * 3)
    texts = [proc.tokenizer.decode(o.token_ids, skip_special_tokens=True) for o in outs]
    assert texts[0] == texts[1] == texts[2]  # seeded: the batch around it does not matter
    for o, t in zip(outs, texts, strict=True):
        if o.finish_reason == "stop":
            assert set(json.loads(t)) == {"name", "age", "tags"}


def test_ending_by_max_tokens_inside_the_value_says_length(vl, eng) -> None:
    hf, proc = vl
    case = build_case(hf, proc, "say something")
    out = _gen(eng, case, SamplingParams(max_tokens=3, structured=StructuredSpec.json_schema(PERSON)))
    assert out.finish_reason == "length" and len(out.token_ids) == 3


def test_preempted_requests_keep_their_matchers(vl, tiny_vl_dir) -> None:
    hf, proc = vl
    cases = [build_case(hf, proc, f"item {i} please describe it at length") for i in range(4)]
    spec = StructuredSpec.json_schema(PERSON)
    params = SamplingParams(max_tokens=40, structured=spec)
    roomy = engine(tiny_vl_dir).generate([GenerateRequest(c.prompt, params, []) for c in cases])
    tight = engine(tiny_vl_dir, num_kv_blocks=14)  # too few blocks for four at once: preemptions
    outs = tight.generate([GenerateRequest(c.prompt, params, []) for c in cases])
    assert tight.scheduler.num_preemptions > 0
    assert [o.token_ids for o in outs] == [o.token_ids for o in roomy]


@pytest.mark.parametrize(
    ("spec", "words"),
    [
        (StructuredSpec.json_schema({"type": "nonsense"}, "response_format"), "response_format (json)"),
        (StructuredSpec("regex", "(?=a)b"), "Lookahead"),
        (StructuredSpec("regex", "[^\\x00-\\U0010FFFF]"), "no output can match"),
        (StructuredSpec("grammar", "root ::= undefined_rule"), "undefined_rule"),
        (StructuredSpec.json_schema({"$ref": "#/$defs/x", "$defs": {"x": {"$ref": "#/$defs/x"}}}), "json"),
        (
            StructuredSpec.json_schema(
                {"type": "object", "properties": {f"p{i}": {} for i in range(10_000)}}
            ),
            "at most",
        ),
        (StructuredSpec.choice([]), "choice must be"),
    ],
)
def test_a_grammar_that_cannot_compile_is_refused_naming_the_field(eng, spec, words) -> None:
    with pytest.raises(RequestRejected) as e:
        asyncio.run(eng.prepare_structured(spec))
    assert e.value.code == "bad_structured_output" and words in str(e.value)
    assert spec.field in str(e.value)
    with pytest.raises(RequestRejected):  # the same refusal from add_request, and cached
        eng.add_request("bad", [1, 2, 3], SamplingParams(structured=spec))
    assert "bad" not in eng.scheduler.requests


def test_logit_bias_and_stop_ids_outside_the_vocabulary_are_refused(eng) -> None:
    for params, name in (
        (SamplingParams(logit_bias=((eng.vocab_size, 1.0),)), "logit_bias"),
        (SamplingParams(stop_token_ids=(eng.vocab_size + 5,)), "stop_token_ids"),
    ):
        with pytest.raises(RequestRejected, match=name):
            eng.add_request("oov", [1, 2, 3], params)


def test_a_batch_fill_on_all_rows_or_some_equals_filling_each_row_alone(eng) -> None:
    """``fill_rows`` (one call for the batch, then the special tokens kept out: through a view when
    the rows are the batch's first ones, else an indexed write) against ``GrammarState.fill`` row by
    row, after the matchers have moved apart; the rows it was not given stay as they were."""
    from llm_service.structured.grammars import fill_rows

    backend = eng.grammars
    states = [backend.matcher(StructuredSpec.json_schema(PERSON)) for _ in range(3)]
    one = backend.allocate(1)
    for st, steps in zip(states, (0, 2, 5), strict=True):
        for _ in range(steps):  # each time the last allowed token
            st.fill(one, 0)
            bits = [(int(one[0, t // 32]) >> (t % 32)) & 1 for t in range(backend.vocab_size)]
            assert st.accept(max(t for t, b in enumerate(bits) if b))
    want = backend.allocate(3)
    for i, st in enumerate(states):
        st.fill(want, i)
    assert not torch.equal(want[0], want[2])
    every = backend.allocate(3)
    fill_rows(states, every, [0, 1, 2])
    assert torch.equal(every, want)
    some = backend.allocate(4)
    some[0] = 7
    fill_rows([states[2], states[0]], some, [3, 1])
    assert torch.equal(some[3], want[2]) and torch.equal(some[1], want[0])
    assert int(some[0, 0]) == 7 and bool((some[2] == -1).all())
