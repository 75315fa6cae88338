"""``tool_choice`` required on every served family's tiny model (random weights), in the engine: the
answer under the family's call grammar, decoded as the ingress decodes it (special tokens skipped),
parses with the family's format into calls to the allowed functions whose arguments validate against
their schemas. Sampled, several seeds: the grammar, not luck, makes each call valid. One call per
answer (``parallel_tool_calls: false``): random weights would chain parallel calls past any bound;
several calls are test_tool_grammar.py's."""

from __future__ import annotations

import json
from typing import Any

import jsonschema
import pytest
from transformers import AutoTokenizer

from llm_service.models.families import DECODER_FAMILIES
from llm_service.outputs import GenerateRequest
from llm_service.sampling_params import SamplingParams
from llm_service.structured.spec import StructuredSpec
from llm_service.tools.formats import tool_format
from llm_service.tools.grammar import call_grammar
from tests.tiny_dirs import tiny_model_dir
from tests.unit.llm_service.hf_ref import assert_all_free, engine

SCHEMAS: dict[str, Any] = {
    "get_weather": {
        "type": "object",
        "properties": {
            "city": {"type": "string", "enum": ["Paris", "Oslo"]},
            "note": {"type": "string", "maxLength": 6},
            "days": {"type": "integer"},
            "alerts": {"type": "boolean"},
        },
        "required": ["city", "alerts"],
    },
    "get_time": {"type": "object", "properties": {"zone": {"enum": ["CET", "UTC"]}}, "required": ["zone"]},
}
FAMILIES = ["qwen2.5-vl", "qwen3-vl", "qwen3.5", "gemma3", "gemma4"]
MAX_TOKENS = 400


@pytest.mark.slow
@pytest.mark.parametrize("family", FAMILIES)
def test_required_calls_parse_and_validate_on_every_family(family: str) -> None:
    model_dir = tiny_model_dir(family)
    model_type = json.loads((model_dir / "config.json").read_text())["model_type"]
    fmt = tool_format(DECODER_FAMILIES[model_type].tool_format).for_tools(SCHEMAS)
    functions = [(name, schema, f"tools[{i}].function") for i, (name, schema) in enumerate(SCHEMAS.items())]
    spec = StructuredSpec("grammar", call_grammar(fmt.syntax, functions, parallel=False), "tools")
    tok = AutoTokenizer.from_pretrained(model_dir)
    prompt = tok("What is the weather in Paris, and the time?")["input_ids"]
    eng = engine(model_dir)
    requests = [
        GenerateRequest(
            prompt, SamplingParams(max_tokens=MAX_TOKENS, temperature=1.0, seed=s, structured=spec)
        )
        for s in range(4)
    ]
    for out in eng.generate(requests):
        assert out.finish_reason == "stop"  # the grammar closed, its stop token ended it
        text = tok.decode(out.token_ids, skip_special_tokens=True)  # as the ingress decodes
        parsed = fmt.parse(text)
        assert len(parsed.calls) == 1 and parsed.content is None, text
        for call in parsed.calls:
            jsonschema.validate(json.loads(call.arguments), SCHEMAS[call.name])
    assert_all_free(eng)
