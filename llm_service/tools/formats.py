"""The tool-call formats by name, as the family table names them (llm_service/models/families.py):
each format's incremental parser and its call syntax for ``tool_choice`` grammars."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from llm_service.tools.calls import ParsedOutput
from llm_service.tools.gemma4 import gemma4_stream
from llm_service.tools.grammar import GEMMA4_SYNTAX, HERMES_SYNTAX, PYTHONIC_SYNTAX, CallSyntax
from llm_service.tools.hermes import hermes_stream
from llm_service.tools.pythonic import pythonic_stream
from llm_service.tools.stream import StreamParser, parse_whole


@dataclass(frozen=True)
class ToolFormat:
    name: str
    stream: Callable[[], StreamParser]  # a fresh incremental parser per answer
    syntax: CallSyntax  # how a call is written, for the grammar of tool_choice required / named

    def parse(self, text: str) -> ParsedOutput:
        return parse_whole(self.stream(), text)


TOOL_FORMATS: dict[str, ToolFormat] = {
    "hermes": ToolFormat("hermes", hermes_stream, HERMES_SYNTAX),
    "gemma4": ToolFormat("gemma4", gemma4_stream, GEMMA4_SYNTAX),
    "pythonic": ToolFormat("pythonic", pythonic_stream, PYTHONIC_SYNTAX),
}


def tool_format(name: str) -> ToolFormat:
    fmt = TOOL_FORMATS.get(name)
    if fmt is None:
        raise ValueError(f"tool-call format {name!r} is unknown; known: {', '.join(TOOL_FORMATS)}")
    return fmt
