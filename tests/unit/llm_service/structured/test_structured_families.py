"""Structured outputs on every served family besides Qwen2-VL (test_structured_engine.py has that one):
greedy outputs under a JSON schema equal HF ``generate`` with the same grammar's mask (xgrammar's own
transformers logits processor), on a prompt with the family's media, and they parse and validate.

Each row builds its model, HF model and case as that family's engine-vs-HF test does (its model
directory, its case helper), so the HF inputs carry what the family needs (Gemma's token_type_ids,
Qwen3-VL's DeepStack rows in the engine's items). Each schema is small with bounded strings, arrays
and integers, so a random-weight model closes it well within ``MAX_TOKENS``.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import jsonschema
import pytest

from llm_service.outputs import GenerateRequest
from llm_service.sampling_params import SamplingParams
from llm_service.structured.spec import StructuredSpec
from tests.media import make_audio_array
from tests.tiny_dirs import tiny_model_dir
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

MAX_TOKENS = 160


def _str(n: int) -> dict[str, Any]:
    return {"type": "string", "maxLength": n}


def _obj(**props: Any) -> dict[str, Any]:
    return {"type": "object", "properties": props, "required": list(props), "additionalProperties": False}


@dataclass
class Family:
    """How to get a family's model directory and its reference case, and the schema it answers."""

    model_dir: Callable[[pytest.FixtureRequest], Path]
    case: Callable[[Any, Any], RefCase]  # (hf, processor) -> case
    schema: dict[str, Any]


def _qwen2_audio_case(hf: Any, proc: Any) -> RefCase:
    from tests.unit.llm_service.test_engine_audio import AUDIO

    audio = [make_audio_array(1.0, freq=330.0)]
    return build_case(hf, proc, f"listen {AUDIO} and answer in json", audio=audio, sampling_rate=16000)


def _qwen2_5_vl_dir(_req: pytest.FixtureRequest) -> Path:
    return tiny_model_dir("qwen2.5-vl")


def _qwen3_vl_dir(_req: pytest.FixtureRequest) -> Path:
    return tiny_model_dir("qwen3-vl")


def _qwen3_vl_case(hf: Any, proc: Any) -> RefCase:
    from tests.unit.llm_service.models.test_engine_qwen3_vl import (
        case_of,  # the items carry their DeepStack rows
    )

    return case_of(hf, proc, f"describe {IMG} as json", images=[image(96, 64, 3)])


def _qwen3_5_dir(_req: pytest.FixtureRequest) -> Path:
    return tiny_model_dir("qwen3.5")


def _gemma3_dir(_req: pytest.FixtureRequest) -> Path:
    return tiny_model_dir("gemma3")


def _gemma3_case(hf: Any, proc: Any) -> RefCase:
    from tests.unit.llm_service.models.test_engine_gemma3 import case

    return case((hf, proc), "<image>describe this picture as json", [image(80, 48, 1)])


def _gemma4_dir(_req: pytest.FixtureRequest) -> Path:
    return tiny_model_dir("gemma4")


def _gemma4_case(hf: Any, proc: Any) -> RefCase:
    from tests.unit.llm_service.models.test_engine_gemma4 import case

    return case((hf, proc), "<image>describe this picture as json", [image(64, 48, 2)])


FAMILIES = {
    "qwen2-audio": Family(
        lambda req: req.getfixturevalue("tiny_audio_dir"),
        _qwen2_audio_case,
        _obj(sound=_str(8), loud={"type": "boolean"}),
    ),
    "qwen2.5-vl": Family(
        _qwen2_5_vl_dir,
        lambda hf, proc: build_case(hf, proc, f"describe {IMG} as json", images=[image(120, 90, 1)]),
        _obj(
            objects={"type": "array", "items": _str(6), "maxItems": 2},
            count={"type": "integer", "minimum": 0, "maximum": 9},
        ),
    ),
    "qwen3-vl": Family(
        _qwen3_vl_dir,
        _qwen3_vl_case,
        _obj(color={"enum": ["red", "green", "blue"]}, caption=_str(10)),
    ),
    "qwen3.5": Family(
        _qwen3_5_dir,
        lambda hf, proc: build_case(hf, proc, f"describe {IMG} as json", images=[image(128, 96, 4)]),
        _obj(label=_str(8), score={"type": "integer", "minimum": 0, "maximum": 100}),
    ),
    "gemma3": Family(
        _gemma3_dir,
        _gemma3_case,
        _obj(
            box=_obj(
                x={"type": "integer", "minimum": 0, "maximum": 99},
                y={"type": "integer", "minimum": 0, "maximum": 99},
            ),
            name=_str(6),
        ),
    ),
    "gemma4": Family(
        _gemma4_dir,
        _gemma4_case,
        _obj(
            answer={"enum": ["yes", "no"]},
            why=_str(10),
            tags={"type": "array", "items": _str(4), "maxItems": 2},
        ),
    ),
}


@pytest.mark.parametrize("name", list(FAMILIES))
def test_greedy_json_under_a_schema_equals_hf_generate_with_the_same_mask(
    request: pytest.FixtureRequest, name: str
) -> None:
    fam = FAMILIES[name]
    model_dir = fam.model_dir(request)
    hf, proc = hf_model(model_dir)
    case = fam.case(hf, proc)
    assert case.mm_inputs  # the prompt carries the family's media
    eng = engine(model_dir)
    spec = StructuredSpec.json_schema(fam.schema)
    params = SamplingParams(max_tokens=MAX_TOKENS, structured=spec)
    (out,) = eng.generate([GenerateRequest(case.prompt, params, case.mm_inputs)])
    expected = hf_generate_constrained(hf, case, eng.grammars, spec, MAX_TOKENS)
    assert out.token_ids == expected
    assert out.finish_reason == "stop"  # the grammar closed and its stop token ended it
    assert out.token_ids[-1] in eng.eos_token_ids
    assert not set(out.token_ids) & set(eng.grammars.forbidden_token_ids)  # no <unk>, <|im_start|>, ...
    assert eng.grammars.forbidden_token_ids  # the tiny tokenizers have special tokens to keep out
    text = proc.tokenizer.decode(out.token_ids, skip_special_tokens=False)
    jsonschema.validate(json.loads(text[: text.rindex("}") + 1]), fam.schema)  # all but the stop token
    assert_all_free(eng)
