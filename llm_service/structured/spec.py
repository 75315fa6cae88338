"""What a request constrains its output to: a JSON schema, any JSON object, a regex, a choice of
strings or an EBNF grammar (vLLM's ``structured_outputs`` kinds; OpenAI's ``response_format`` maps
onto ``json`` and ``json_object``). Pure: the grammar library lives in grammars.py.

``value`` is canonical (a schema re-serialised with sorted keys, a choice list as a JSON array), so
two requests asking for the same thing share one compiled grammar. ``field`` is the request field
it came from, named in every error about it.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

KINDS = ("json", "json_object", "regex", "choice", "grammar")


@dataclass(frozen=True)
class StructuredSpec:
    kind: str
    value: str = ""
    field: str = "structured_outputs"

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise ValueError(f"structured output kind must be one of {KINDS}, not {self.kind!r}")

    @classmethod
    def json_schema(cls, schema: dict[str, Any] | bool, field: str = "structured_outputs") -> StructuredSpec:
        return cls("json", canonical_json(schema), field)

    @classmethod
    def choice(cls, options: list[str], field: str = "structured_outputs") -> StructuredSpec:
        return cls("choice", json.dumps(list(options), ensure_ascii=False), field)

    @property
    def key(self) -> tuple[str, str]:
        """What the compiled grammar depends on (not ``field``)."""
        return (self.kind, self.value)

    def to_wire(self) -> list[str]:
        return [self.kind, self.value, self.field]

    @classmethod
    def from_wire(cls, w: list[str] | tuple[str, ...]) -> StructuredSpec:
        kind, value, field = w
        return cls(str(kind), str(value), str(field))


def canonical_json(value: object) -> str:
    return json.dumps(value, sort_keys=True, separators=(",", ":"), ensure_ascii=False)


# Bounds on what a request may ask to compile: past them the grammar library's compile time grows
# fast (a flat object of N optional properties compiles in ~N^2: 400 in 0.3 s, 10,000 in minutes).
MAX_SPEC_BYTES = 64 * 1024  # a schema's JSON, a regex, a grammar, a choice list
MAX_SCHEMA_DEPTH = 32  # nested containers in a schema document
MAX_SCHEMA_PROPERTIES = 1024  # property names over the whole schema
MAX_CHOICES = 256


def spec_problem(spec: StructuredSpec) -> str | None:
    """What makes ``spec`` too large or malformed to compile, or None. Pure and linear in its size:
    the edge runs it before anything is compiled."""
    if len(spec.value.encode()) > MAX_SPEC_BYTES:
        return f"is {len(spec.value.encode())} bytes; at most {MAX_SPEC_BYTES}"
    if spec.kind == "choice":
        options = json.loads(spec.value)
        if not options or len(options) > MAX_CHOICES or not all(isinstance(o, str) and o for o in options):
            return f"choice must be 1 to {MAX_CHOICES} non-empty strings"
    if spec.kind in ("regex", "grammar") and not spec.value:
        return f"{spec.kind} must not be empty"
    if spec.kind == "json":
        return _schema_problem(json.loads(spec.value))
    return None


def _schema_problem(schema: object) -> str | None:
    if not isinstance(schema, (dict, bool)):
        return "a JSON schema must be an object (or a boolean)"
    properties = 0
    stack: list[tuple[object, int]] = [(schema, 1)]
    while stack:
        node, depth = stack.pop()
        if depth > MAX_SCHEMA_DEPTH:
            return f"nests deeper than {MAX_SCHEMA_DEPTH} levels"
        if isinstance(node, dict):
            props = node.get("properties")
            if isinstance(props, dict):
                properties += len(props)
                if properties > MAX_SCHEMA_PROPERTIES:
                    return f"has more than {MAX_SCHEMA_PROPERTIES} properties in all"
            stack.extend((v, depth + 1) for v in node.values() if isinstance(v, (dict, list)))
        elif isinstance(node, list):
            stack.extend((v, depth + 1) for v in node if isinstance(v, (dict, list)))
    return None
