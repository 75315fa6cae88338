"""``tool_choice`` -> what the answer is parsed and constrained by.

``none`` (or no tools): no parsing, no constraint (the template still gets the tools, as OpenAI and
vLLM do). ``auto``: the model's text is parsed for the family's calls. ``required`` and a named
function: also a grammar (llm_service/tools/grammar.py) that admits only calls to the allowed
functions, their arguments held to their schemas; ``parallel_tool_calls: false`` admits one call.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import replace
from typing import Protocol

from llm_service.sampling_params import SamplingParams
from llm_service.structured.spec import StructuredSpec
from llm_service.tools.formats import ToolFormat, tool_format
from llm_service.tools.grammar import ToolGrammarError, call_grammar
from router.protocol.errors import bad_request
from router.protocol.tools import NamedToolChoice, ToolChoice, ToolDefinition


class ToolAsk(Protocol):
    """What a request says about tools (a chat request; a Responses request's, in chat's shapes)."""

    @property
    def tools(self) -> Sequence[ToolDefinition] | None: ...

    @property
    def tool_choice(self) -> ToolChoice | None: ...

    @property
    def parallel_tool_calls(self) -> bool | None: ...


def answer_format(req: ToolAsk, format_name: str) -> ToolFormat | None:
    """The format the answer is parsed in, or None when no calls are parsed."""
    if not req.tools or req.tool_choice == "none":
        return None
    return tool_format(format_name).for_tools({t.function.name: t.function.parameters for t in req.tools})


def with_tool_choice(params: SamplingParams, req: ToolAsk, format_name: str) -> SamplingParams:
    """``params`` constrained to calls when ``tool_choice`` asks for them (a 400 naming the field
    when it cannot be)."""
    choice = req.tool_choice
    if not req.tools or not (choice == "required" or isinstance(choice, NamedToolChoice)):
        return params
    if params.structured is not None:
        raise bad_request(
            f"tool_choice {_said(choice)} constrains the answer to tool calls; it cannot be combined "
            f"with {params.structured.field}",
            code="bad_tool_choice",
            param="tool_choice",
        )
    functions = [
        (t.function.name, t.function.parameters, f"tools[{i}].function")
        for i, t in enumerate(req.tools)
        if not isinstance(choice, NamedToolChoice) or t.function.name == choice.function.name
    ]
    syntax = tool_format(format_name).syntax
    try:
        grammar = call_grammar(syntax, functions, parallel=req.parallel_tool_calls is not False)
    except ToolGrammarError as e:
        raise bad_request(
            f"{e} (tool_choice {_said(choice)} holds calls to their schemas)",
            code="bad_tool_choice",
            param=_field(e.where),
        ) from e
    return replace(params, structured=StructuredSpec("grammar", grammar, "tools"))


def _field(where: str) -> str:
    """The request field a place in a schema sits in: ``tools[i].function.parameters`` (or ``.name``)."""
    head, found, _ = where.partition(".parameters")
    return head + found


def _said(choice: object) -> str:
    return f"{choice.function.name!r}" if isinstance(choice, NamedToolChoice) else f'"{choice}"'
