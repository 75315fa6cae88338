"""``tool_choice`` grammars, a row per family format: what xgrammar admits is a call to an allowed
function in the family's syntax, and the family's parser reads arguments that validate against the
schema; what breaks the schema or the syntax is refused."""

from __future__ import annotations

import json

import jsonschema
import pytest
import xgrammar as xgr
from xgrammar.testing import _is_grammar_accept_string

from llm_service.tools.formats import TOOL_FORMATS
from llm_service.tools.grammar import ToolGrammarError, call_grammar

SCHEMA = {
    "type": "object",
    "properties": {
        "city": {"type": "string", "enum": ["Paris", "Oslo"]},
        "days": {"type": "integer"},
        "units": {"type": "string", "maxLength": 4, "description": "C or F"},
        "tags": {"type": "array", "items": {"type": "boolean"}, "maxItems": 2},
        "extra": {},
    },
    "required": ["city"],
}
FUNCTIONS = [("get_weather", SCHEMA, "tools[0].function"), ("noop", None, "tools[1].function")]

# (format, admitted outputs, refused outputs)
ROWS = [
    (
        "hermes",
        [
            '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "days": -12, "tags": [true, false], "extra": {"x": [1, null]}}}\n</tool_call>',
            '<tool_call>\n{"name": "noop", "arguments": {}}\n</tool_call>\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo"}}\n</tool_call>',
        ],
        [
            '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Rome"}}\n</tool_call>',
            '<tool_call>\n{"name": "get_weather", "arguments": {"days": 1}}\n</tool_call>',
            '<tool_call>\n{"name": "other", "arguments": {}}\n</tool_call>',
            'text <tool_call>\n{"name": "noop", "arguments": {}}\n</tool_call>',
            "",
        ],
    ),
    (
        "qwen3_xml",
        [
            "<tool_call>\n<function=get_weather>\n<parameter=city>\nParis\n</parameter>\n<parameter=units>\nC\n</parameter>\n"
            "<parameter=tags>\n[true, false]\n</parameter>\n</function>\n</tool_call>",
            "<tool_call>\n<function=noop>\n</function>\n</tool_call>\n<tool_call>\n<function=get_weather>\n"
            "<parameter=city>\nOslo\n</parameter>\n<parameter=days>\n-4\n</parameter>\n</function>\n</tool_call>",
        ],
        [
            "<tool_call>\n<function=get_weather>\n<parameter=city>\nRome\n</parameter>\n</function>\n</tool_call>",
            "<tool_call>\n<function=get_weather>\n<parameter=city>\nParis\n</parameter>\n<parameter=units>\nKelvin\n</parameter>\n</function>\n</tool_call>",
        ],
    ),
    (
        "gemma4",
        [
            '<|tool_call>call:get_weather{city:<|"|>Oslo<|"|>,units:<|"|>C<|"|>}<tool_call|>',
            '<|tool_call>call:noop{}<tool_call|><|tool_call>call:get_weather{city:<|"|>Paris<|"|>,days:0}<tool_call|>',
        ],
        [
            '<|tool_call>call:get_weather{city:<|"|>Oslo<|"|>,units:<|"|>Celsius<|"|>}<tool_call|>',
            "<|tool_call>call:get_weather{days:3}<tool_call|>",
        ],
    ),
    (
        "pythonic",
        ['[get_weather(city="Paris", days=3, extra={"a": True}), noop()]', '[get_weather(city="Oslo")]'],
        ['[get_weather(city="Paris", days=3.5)]', "[noop(), ]", "noop()"],
    ),
]


@pytest.mark.parametrize(("fmt", "admitted", "refused"), ROWS)
def test_grammar_admits_valid_calls_only(fmt: str, admitted: list[str], refused: list[str]) -> None:
    grammar = xgr.Grammar.from_ebnf(call_grammar(TOOL_FORMATS[fmt].syntax, FUNCTIONS, parallel=True))
    for text in admitted:
        assert _is_grammar_accept_string(grammar, text), text
        out = TOOL_FORMATS[fmt].for_tools({"get_weather": SCHEMA}).parse(text)
        assert out.content is None and out.calls
        for call in out.calls:
            params = (
                SCHEMA if call.name == "get_weather" else {"type": "object", "additionalProperties": False}
            )
            jsonschema.validate(json.loads(call.arguments), params)
    for text in refused:
        assert not _is_grammar_accept_string(grammar, text), text


@pytest.mark.parametrize("fmt", list(TOOL_FORMATS))
def test_one_call_when_not_parallel(fmt: str) -> None:
    grammar = xgr.Grammar.from_ebnf(call_grammar(TOOL_FORMATS[fmt].syntax, FUNCTIONS, parallel=False))
    two = {row[0]: row[1][1] if row[0] != "pythonic" else row[1][0] for row in ROWS}[fmt]
    assert not _is_grammar_accept_string(grammar, two)


@pytest.mark.parametrize(
    ("schema", "named"),
    [
        ({"type": "object", "properties": {"a": {"type": "string", "pattern": "^a"}}}, "properties.a"),
        ({"type": "object", "properties": {"a": {"$ref": "#/defs/x"}}}, "'$ref'"),
        ({"type": "object", "properties": {"a": {"type": "strin"}}}, "'strin'"),
        ({"type": "object", "properties": {"a": {}}, "required": ["b"]}, "required"),
    ],
)
def test_schemas_that_cannot_be_held_are_refused_by_place(schema: dict[str, object], named: str) -> None:
    with pytest.raises(ToolGrammarError) as e:
        call_grammar(TOOL_FORMATS["hermes"].syntax, [("f", schema, "tools[3].function")], parallel=True)
    assert str(e.value).startswith("tools[3].function.parameters") and named in str(e.value)


def test_pythonic_calls_need_python_names() -> None:
    with pytest.raises(ToolGrammarError) as e:
        call_grammar(
            TOOL_FORMATS["pythonic"].syntax, [("get-time", None, "tools[0].function")], parallel=False
        )
    assert e.value.where == "tools[0].function.name"
