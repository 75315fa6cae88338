"""The tool-call parsers, a row per family format: the non-streamed message against hand-written
calls, and every split of the text into deltas reassembling to it (streamed == non-streamed)."""

from __future__ import annotations

import itertools
import json

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from llm_service.tools.calls import ArgumentsDelta, CallStart, ContentDelta, ParsedOutput, ToolEvent, collect
from llm_service.tools.formats import TOOL_FORMATS, ToolFormat

H1 = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "days": 3}}\n</tool_call>'
H2 = '<tool_call>\n{"name": "get_time", "arguments": {"zone": "CET"}}\n</tool_call>'
X1 = "<tool_call>\n<function=get_weather>\n<parameter=city>\nParis\n</parameter>\n<parameter=days>\n3\n</parameter>\n</function>\n</tool_call>"
X2 = "<tool_call>\n<function=get_time>\n<parameter=zone>\nCET\n</parameter>\n</function>\n</tool_call>"
G1 = '<|tool_call>call:get_weather{city:<|"|>Paris<|"|>,days:3}<tool_call|>'
G2 = '<|tool_call>call:get_time{zone:<|"|>CET<|"|>}<tool_call|>'
WEATHER = ("get_weather", {"city": "Paris", "days": 3})
TIME = ("get_time", {"zone": "CET"})

# (format, model output, expected content, expected calls as (name, arguments))
CASES = [
    ("hermes", "Hello there.", "Hello there.", []),
    ("hermes", H1, None, [WEATHER]),
    ("hermes", f"Let me check. {H1}\n{H2}", "Let me check.", [WEATHER, TIME]),
    ("hermes", f"{H1}\n{H2}\n", None, [WEATHER, TIME]),
    ("hermes", '<tool_call>{"arguments": {"zone": "CET"}, "name": "get_time"}</tool_call>', None, [TIME]),
    ("hermes", "a <tool_call>not json</tool_call> b", "a <tool_call>not json</tool_call> b", []),
    ("hermes", "x < y and <tool_ not a marker", "x < y and <tool_ not a marker", []),
    ("hermes", 'Cut: <tool_call>\n{"name": "get_time", "arguments": {"zone": "CET"}}', "Cut:", [TIME]),
    ("hermes", '<tool_call>\n{"name": "get_time", "arguments": {"zone": "CET"}}\n</tool_ca', None, [TIME]),
    ("gemma4", '<|tool_call>call:get_time{zone:<|"|>CET<|"|>}<tool_', None, [TIME]),
    ("hermes", f'{H1}\n<tool_call>\n{{"name": "get_time", "argumen', None, [WEATHER]),  # 2nd call cut
    ("gemma4", f"{G1}<|tool_call>call:get_ti", None, [WEATHER]),
    ("qwen3_xml", "Hello.", "Hello.", []),
    ("qwen3_xml", X1, None, [WEATHER]),
    ("qwen3_xml", f"Let me check.\n\n{X1}\n{X2}", "Let me check.", [WEATHER, TIME]),
    (
        "qwen3_xml",
        "<tool_call>\n<function=f>\n<parameter=code>\n7\n</parameter>\n<parameter=n>\n7\n</parameter>\n"
        '<parameter=o>\n{"a": [1]}\n</parameter>\n<parameter=s>\nnot json\n</parameter>\n</function>\n</tool_call>',
        None,
        [("f", {"code": "7", "n": 7, "o": {"a": [1]}, "s": "not json"})],  # code: a string by its schema
    ),
    (
        "qwen3_xml",
        "<tool_call>\n<function=f>\nstray\n</function>\n</tool_call>",
        "<tool_call>\n<function=f>\nstray\n</function>\n</tool_call>",
        [],
    ),
    (  # a string value over lines, quotes and a '<' in it; the answer cut inside the second call's value
        "qwen3_xml",
        '<tool_call>\n<function=get_time>\n<parameter=zone>\nC "E"\n<T\n\n</parameter>\n</function>\n</tool_call>'
        "<tool_call>\n<function=get_weather>\n<parameter=city>\nPa\n",
        None,
        [("get_time", {"zone": 'C "E"\n<T\n'}), ("get_weather", {"city": "Pa"})],
    ),
    ("gemma4", "Sure.", "Sure.", []),
    ("gemma4", '<|tool_call>call:get_weather{city:<|"|>Pa', None, [("get_weather", {"city": "Pa"})]),
    ("gemma4", G1, None, [WEATHER]),
    ("gemma4", f"Let me check.\n{G1}{G2}", "Let me check.", [WEATHER, TIME]),
    (
        "gemma4",
        '<|tool_call>call:f{a:<|"|>x, }<|"|>,b:[1,2.5,{c:true,d:null}],e:-1e3}<tool_call|>',
        None,
        [("f", {"a": "x, }", "b": [1, 2.5, {"c": True, "d": None}], "e": -1000.0})],
    ),
    ("gemma4", "<|tool_call>call:f{a:}<tool_call|>", "<|tool_call>call:f{a:}<tool_call|>", []),
    ("pythonic", "Plain [text].", "Plain [text].", []),
    ("pythonic", '[get_weather(city="Paris", days=3), get_time(zone="CET")]', None, [WEATHER, TIME]),
    ("pythonic", "  [get_time(zone='CET')]\n", None, [TIME]),
    ("pythonic", "[1, 2, 3]", "[1, 2, 3]", []),
    ("pythonic", "[f(x)]", "[f(x)]", []),
]


# the functions' schemas the formats that type values by them read (Qwen3.5's)
SCHEMAS = {
    "f": {"type": "object", "properties": {"code": {"type": "string"}, "n": {"type": "integer"}}},
    "get_weather": {
        "type": "object",
        "properties": {"city": {"type": "string"}, "days": {"type": "integer"}},
    },
    "get_time": {"type": "object", "properties": {"zone": {"enum": ["CET", "UTC"]}}},
}


def _fmt(name: str) -> ToolFormat:
    return TOOL_FORMATS[name].for_tools(SCHEMAS)


def _calls(out: ParsedOutput) -> list[tuple[str, object]]:
    return [(c.name, json.loads(c.arguments)) for c in out.calls]


@pytest.mark.parametrize(("fmt", "text", "content", "calls"), CASES)
def test_parse(fmt: str, text: str, content: str | None, calls: list[tuple[str, object]]) -> None:
    out = _fmt(fmt).parse(text)
    assert out.content == content
    assert _calls(out) == calls
    assert all(c.id.startswith("call_") and len(c.id) == 29 for c in out.calls)
    assert len({c.id for c in out.calls}) == len(out.calls)


def _streamed(fmt: str, text: str, cuts: list[int]) -> list[ToolEvent]:
    stream = _fmt(fmt).stream()
    events: list[ToolEvent] = []
    bounds = [0, *sorted(set(cuts)), len(text)]
    for a, b in itertools.pairwise(bounds):
        events += stream.feed(text[a:b])
    return events + stream.finish()


def _shape(out: ParsedOutput) -> tuple[str | None, list[tuple[str, str]]]:
    return out.content, [(c.name, c.arguments) for c in out.calls]


@pytest.mark.parametrize(("fmt", "text"), [(c[0], c[1]) for c in CASES])
def test_every_single_split_reassembles(fmt: str, text: str) -> None:
    whole = _shape(_fmt(fmt).parse(text))
    for cut in range(len(text) + 1):
        assert _shape(collect(_streamed(fmt, text, [cut]))) == whole, cut


@settings(max_examples=300, deadline=None)
@given(st.sampled_from([(c[0], c[1]) for c in CASES]), st.data())
def test_any_chunking_reassembles(case: tuple[str, str], data: st.DataObject) -> None:
    fmt, text = case
    cuts = data.draw(st.lists(st.integers(0, len(text)), max_size=len(text)))
    events = _streamed(fmt, text, cuts)
    assert _shape(collect(events)) == _shape(_fmt(fmt).parse(text))
    _check_delta_shape(events, text)


def _check_delta_shape(events: list[ToolEvent], text: str) -> None:
    """A call starts once, in index order, before its arguments; no event is empty. (That no partial
    marker goes out as content follows from the reassembly: the whole parse's content has none.)"""
    started: set[int] = set()
    for e in events:
        if isinstance(e, CallStart):
            assert e.index == len(started)
            started.add(e.index)
        elif isinstance(e, ArgumentsDelta):
            assert e.index in started and e.text
        else:
            assert isinstance(e, ContentDelta) and e.text


def test_hermes_arguments_stream_in_pieces() -> None:
    stream = TOOL_FORMATS["hermes"].stream()
    events: list[ToolEvent] = []
    for ch in "Hi " + H1:
        events += stream.feed(ch)
    events += stream.finish()
    head = [e for e in events if isinstance(e, ContentDelta)]
    assert "".join(e.text for e in head) == "Hi"
    start = events[len(head)]
    assert isinstance(start, CallStart) and start.name == "get_weather"
    pieces = [e.text for e in events if isinstance(e, ArgumentsDelta)]
    assert len(pieces) > 5 and json.loads("".join(pieces)) == WEATHER[1]


@pytest.mark.parametrize(("fmt", "text"), [("qwen3_xml", X1), ("gemma4", G1)])
def test_arguments_stream_as_they_arrive(fmt: str, text: str) -> None:
    """Qwen3.5's and Gemma 4's calls stream as JSON built as the model writes them: the call's start
    before its first value is whole, a string value in character pieces, never a piece after the
    text that settles it."""
    stream = _fmt(fmt).stream()
    events: list[ToolEvent] = []
    seen: list[int] = []  # how many events each character settled
    for ch in text:
        new = stream.feed(ch)
        events += new
        seen.append(len(new))
    events += stream.finish()
    pieces = [e.text for e in events if isinstance(e, ArgumentsDelta)]
    assert isinstance(events[0], CallStart) and events[0].name == "get_weather"
    assert pieces[:3] == ["{", '"city": "', "P"] and "".join(pieces) == '{"city": "Paris", "days": 3}'
    upto = sum(seen[: text.index("Paris") + 1])  # the events out once "P" was fed
    assert [e.text for e in events[:upto] if isinstance(e, ArgumentsDelta)][-1] == "P"


def test_no_partial_marker_goes_out_as_content() -> None:
    stream = TOOL_FORMATS["hermes"].stream()
    assert stream.feed("Hi <tool_") == [ContentDelta("Hi")]  # the blank and '<tool_' wait
    assert [type(e) for e in stream.feed('call>{"name": "f", "arguments": {')] == [CallStart, ArgumentsDelta]
