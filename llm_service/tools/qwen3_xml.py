"""Qwen3.5's calls, as its chat template writes them (vLLM parses them with ``qwen3_coder``):

    <tool_call>
    <function=get_weather>
    <parameter=city>
    Paris
    </parameter>
    <parameter=days>
    3
    </parameter>
    </function>
    </tool_call>

A parameter's value is raw text: a string as it is when the function's schema types it as a string,
otherwise read as JSON (a string when it is not JSON). A call goes out whole when it ends.
"""

from __future__ import annotations

import json
import re
from collections.abc import Mapping
from typing import Any

from llm_service.tools.calls import ArgumentsDelta, CallStart, ToolEvent, new_call_id
from llm_service.tools.stream import MarkerStream

START, END = "<tool_call>", "</tool_call>"
_CALL = re.compile(r"\s*<function=([^>\n]+)>(.*?)</function>\s*\Z", re.DOTALL)
_PARAM = re.compile(r"<parameter=([^>\n]+)>(.*?)</parameter>", re.DOTALL)


def is_string_schema(schema: object) -> bool:
    """Whether a parameter's value is written as raw text: its schema types it as a string only."""
    if not isinstance(schema, dict):
        return False
    if schema.get("type") == "string":
        return True
    options = schema.get("enum", [schema["const"]] if "const" in schema else [])
    return (
        "type" not in schema
        and isinstance(options, list)
        and bool(options)
        and all(isinstance(o, str) for o in options)
    )


def _value(text: str, schema: object) -> object:
    text = text.removeprefix("\n").removesuffix("\n")
    if is_string_schema(schema):
        return text
    try:
        return json.loads(text)
    except ValueError:
        return text


class Qwen3XMLBody:
    def __init__(self, index: int, schemas: Mapping[str, Any]) -> None:
        self.index, self.schemas = index, schemas

    @property
    def started(self) -> bool:
        return False  # a call goes out whole

    def partial(self, body: str) -> list[ToolEvent]:
        return []

    def complete(self, body: str) -> list[ToolEvent] | None:
        m = _CALL.match(body)
        if m is None:
            return None
        name, inner = m.group(1), m.group(2)
        if _PARAM.sub("", inner).strip():
            return None  # text between the parameters
        params = (self.schemas.get(name) or {}).get("properties") or {}
        args = {k: _value(v, params.get(k)) for k, v in _PARAM.findall(inner)}
        text = json.dumps(args, ensure_ascii=False)
        return [CallStart(self.index, new_call_id(), name), ArgumentsDelta(self.index, text)]


def qwen3_xml_stream(schemas: Mapping[str, Any]) -> MarkerStream:
    """``schemas``: each function's parameters schema by name (how its values are read)."""
    return MarkerStream(START, END, lambda i: Qwen3XMLBody(i, schemas))
