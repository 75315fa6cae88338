"""A request's tools, checked across fields and put in the form chat templates take.

``template_tools`` checks the definitions (each name once, each ``parameters`` a JSON schema of an
object, within the structured-output bounds) and ``tool_choice`` (a named function must be one of
them; ``required`` needs some) and returns them as transformers' ``apply_chat_template(tools=...)``
takes them: ``{"type": "function", "function": {"name", "description", "parameters"}}``, as the
client sent them (unset fields left out). ``template_tool_calls`` is an assistant message's
``tool_calls`` with their arguments parsed (HF templates expect a mapping). Every error is a 400
naming the field.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from typing import Any

from llm_service.structured.spec import StructuredSpec, spec_problem
from router.protocol.errors import APIError, bad_request
from router.protocol.tools import NamedToolChoice, ToolCall, ToolChoice, ToolDefinition

JSON_TYPES = frozenset({"object", "array", "string", "number", "integer", "boolean", "null"})
# Keys whose value is a schema, a list of schemas, or a mapping of names to schemas.
_SCHEMA_KEYS = ("items", "additionalProperties", "not", "contains", "propertyNames", "if", "then", "else")
_SCHEMA_LIST_KEYS = ("anyOf", "oneOf", "allOf", "prefixItems")
_SCHEMA_MAP_KEYS = ("properties", "patternProperties", "$defs", "definitions")


def template_tools(
    tools: Sequence[ToolDefinition] | None, tool_choice: ToolChoice | None
) -> list[dict[str, Any]] | None:
    """The request's tools as the chat template takes them, checked; None when it gives none."""
    names: dict[str, int] = {}
    for i, tool in enumerate(tools or ()):
        fn = tool.function
        if fn.name in names:
            raise _bad(f"tools[{i}].function.name {fn.name!r} repeats tools[{names[fn.name]}]", "tools")
        names[fn.name] = i
        if fn.parameters is not None and (problem := parameters_problem(fn.parameters)) is not None:
            where = f"tools[{i}].function.parameters"
            raise _bad(f"{where}: {problem}", where)
    _check_choice(tool_choice, names)
    if not tools:
        return None
    return [tool.model_dump(mode="json", exclude_none=True) for tool in tools]


def _check_choice(choice: ToolChoice | None, names: dict[str, int]) -> None:
    if isinstance(choice, NamedToolChoice):
        if choice.function.name not in names:
            known = ", ".join(repr(n) for n in names) or "none"
            raise _bad(
                f"tool_choice names function {choice.function.name!r}, which tools does not define "
                f"(defined: {known})",
                "tool_choice",
            )
    elif choice == "required" and not names:
        raise _bad('tool_choice "required" needs at least one function in tools', "tool_choice")


def parameters_problem(schema: dict[str, Any]) -> str | None:
    """What makes ``schema`` unfit as a function's parameters, or None: it must describe an object,
    be a well-formed JSON schema where it matters to a template and a grammar (``type`` names JSON
    types, ``properties`` maps names to schemas, ``required`` lists names), and stay within the
    structured-output bounds (size, depth, property count)."""
    if schema.get("type", "object") != "object":
        return f'must be a JSON schema of type "object", not {schema.get("type")!r}'
    bounded = spec_problem(StructuredSpec.json_schema(schema, "tools"))
    if bounded is not None:
        return bounded
    stack: list[tuple[object, str]] = [(schema, "")]
    while stack:
        node, path = stack.pop()
        if isinstance(node, bool):
            continue
        if not isinstance(node, dict):
            return f"{path or 'the schema'} is not a schema (an object or a boolean)"
        if (problem := _node_problem(node, path)) is not None:
            return problem
        stack.extend(_children(node, path))
    return None


def _node_problem(node: dict[str, Any], path: str) -> str | None:
    at = path or "the schema"
    kind = node.get("type")
    kinds = kind if isinstance(kind, list) else [kind] if kind is not None else []
    if not all(isinstance(k, str) and k in JSON_TYPES for k in kinds) or kind == []:
        return f"{at}: type {kind!r} is not a JSON type ({', '.join(sorted(JSON_TYPES))})"
    required = node.get("required")
    if required is not None and not (
        isinstance(required, list) and all(isinstance(r, str) for r in required)
    ):
        return f"{at}: required must be a list of property names"
    if "enum" in node and not isinstance(node["enum"], list):
        return f"{at}: enum must be a list"
    for key in _SCHEMA_MAP_KEYS:
        if key in node and not isinstance(node[key], dict):
            return f"{at}: {key} must map names to schemas"
    for key in _SCHEMA_LIST_KEYS:
        if key in node and not isinstance(node[key], list):
            return f"{at}: {key} must be a list of schemas"
    return None


def _children(node: dict[str, Any], path: str) -> list[tuple[object, str]]:
    out: list[tuple[object, str]] = []
    for key in _SCHEMA_KEYS:
        if key in node and not (key == "items" and isinstance(node[key], list)):
            out.append((node[key], f"{path}.{key}" if path else key))
    for key in _SCHEMA_LIST_KEYS:
        out.extend(
            (s, f"{path}.{key}[{i}]" if path else f"{key}[{i}]") for i, s in enumerate(node.get(key, ()))
        )
    for key in _SCHEMA_MAP_KEYS:
        for name, s in node.get(key, {}).items():
            out.append((s, f"{path}.{key}.{name}" if path else f"{key}.{name}"))
    return out


def template_tool_calls(calls: Sequence[ToolCall], where: str) -> list[dict[str, Any]]:
    """An assistant message's ``tool_calls`` as HF templates read them: ``arguments`` parsed into a
    mapping (a 400 naming ``{where}[j].function.arguments`` when it is not a JSON object)."""
    out = []
    for j, call in enumerate(calls):
        at = f"{where}[{j}].function.arguments"
        try:
            arguments = json.loads(call.function.arguments)
        except (ValueError, RecursionError) as e:
            raise _bad(f"{at} is not valid JSON: {e}", at) from e
        if not isinstance(arguments, dict):
            raise _bad(f"{at} must be a JSON object, not {type(arguments).__name__}", at)
        out.append(
            {
                "id": call.id,
                "type": "function",
                "function": {"name": call.function.name, "arguments": arguments},
            }
        )
    return out


def _bad(message: str, param: str) -> APIError:
    return bad_request(message, code="invalid_tools", param=param)
