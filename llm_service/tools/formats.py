"""The tool-call formats by name, as the family table names them (llm_service/models/families.py):
each format's incremental parser and its call syntax for ``tool_choice`` grammars."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field, replace
from typing import Any

from llm_service.tools.calls import ParsedOutput
from llm_service.tools.gemma4 import gemma4_stream
from llm_service.tools.grammar import (
    GEMMA4_SYNTAX,
    HERMES_SYNTAX,
    PYTHONIC_SYNTAX,
    QWEN3_XML_SYNTAX,
    CallSyntax,
)
from llm_service.tools.hermes import hermes_stream
from llm_service.tools.pythonic import pythonic_stream
from llm_service.tools.qwen3_xml import qwen3_xml_stream
from llm_service.tools.stream import StreamParser, parse_whole


@dataclass(frozen=True)
class ToolFormat:
    name: str
    new_stream: Callable[[Mapping[str, Any]], StreamParser]  # a parser, given the functions' schemas
    syntax: CallSyntax  # how a call is written, for the grammar of tool_choice required / named
    schemas: Mapping[str, Any] = field(default_factory=dict)  # parameters by function name
    # the format's marker texts: kept when the answer is decoded, special tokens or not (Gemma 4's are)
    markers: tuple[str, ...] = ()

    def for_tools(self, schemas: Mapping[str, Any]) -> ToolFormat:
        """This format reading the calls of these functions (a format may type values by them)."""
        return replace(self, schemas=schemas)

    def stream(self) -> StreamParser:
        """A fresh incremental parser (one per answer)."""
        return self.new_stream(self.schemas)

    def parse(self, text: str) -> ParsedOutput:
        return parse_whole(self.stream(), text)


TOOL_FORMATS: dict[str, ToolFormat] = {
    "hermes": ToolFormat(
        "hermes", lambda _: hermes_stream(), HERMES_SYNTAX, markers=("<tool_call>", "</tool_call>")
    ),
    "qwen3_xml": ToolFormat(
        "qwen3_xml", qwen3_xml_stream, QWEN3_XML_SYNTAX, markers=("<tool_call>", "</tool_call>")
    ),
    "gemma4": ToolFormat(
        "gemma4", lambda _: gemma4_stream(), GEMMA4_SYNTAX, markers=("<|tool_call>", "<tool_call|>", '<|"|>')
    ),
    "pythonic": ToolFormat("pythonic", lambda _: pythonic_stream(), PYTHONIC_SYNTAX),
}


def tool_format(name: str) -> ToolFormat:
    fmt = TOOL_FORMATS.get(name)
    if fmt is None:
        raise ValueError(f"tool-call format {name!r} is unknown; known: {', '.join(TOOL_FORMATS)}")
    return fmt
