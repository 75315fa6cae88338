"""``tool_choice`` ``required`` or a named function as an EBNF grammar (xgrammar's dialect): only the
family's call syntax around calls to the allowed functions, each call's arguments held to its
function's JSON schema, written in the family's value syntax (JSON, Gemma 4's, Python literals).

The schema keywords held: ``type`` (one or a list), ``properties``, ``required``,
``additionalProperties`` (calls carry the listed properties only), ``items``, ``minItems``,
``maxItems``, ``enum``, ``const``, ``anyOf``, ``oneOf``, ``minLength``, ``maxLength``; annotations
(``title``, ``description``, ``default``, ``examples``, ``format``, ...) are ignored. Any other keyword
is a ``ToolGrammarError`` naming it: a call the grammar admits would not always validate.
Properties come in the schema's order; strings, numbers and blanks are written one way only (no free
whitespace), so that a model cannot loop on blanks.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from llm_service.tools.qwen3_xml import is_string_schema

_IGNORED = {
    "title", "description", "default", "examples", "format", "$schema", "$id", "$comment",
    "deprecated", "readOnly", "writeOnly", "strict",
}  # fmt: skip
_HELD = {
    "type", "properties", "required", "additionalProperties", "items", "minItems", "maxItems",
    "enum", "const", "anyOf", "oneOf", "minLength", "maxLength",
}  # fmt: skip
_MAX_REPEAT = 4096  # a bounded string or array past this is refused (grammar size)


class ToolGrammarError(ValueError):
    """A tool's schema the grammar cannot hold; ``where`` names the place in ``tools``."""

    def __init__(self, where: str, why: str) -> None:
        super().__init__(f"{where}: {why}")
        self.where = where


@dataclass(frozen=True)
class ValueSyntax:
    """How a family writes JSON values inside a call."""

    string_quote: str  # around a string's characters
    string_char: str  # EBNF of one character of a string
    true: str
    false: str
    null: str
    key: str  # format of an object's key followed by its separator, ``{}`` for the name
    any_key: str  # EBNF of any key (objects without properties)
    member_sep: str  # between an object's members and an array's items

    def literal(self, value: object) -> str:
        """``value`` (from ``enum``/``const``) as this syntax writes it."""
        if isinstance(value, bool):
            return self.true if value else self.false
        if value is None:
            return self.null
        if isinstance(value, str):
            return self.string_quote + value + self.string_quote
        if isinstance(value, (int, float)):
            return json.dumps(value)
        if isinstance(value, list):
            return "[" + self.member_sep.join(self.literal(v) for v in value) + "]"
        if isinstance(value, dict):
            inner = self.member_sep.join(
                self.key.replace("{}", k) + self.literal(v) for k, v in value.items()
            )
            return "{" + inner + "}"
        raise TypeError(f"not a JSON value: {value!r}")


JSON_VALUES = ValueSyntax(
    '"', r'([^"\\\x00-\x1f] | "\\" ["\\/bfnrt])', "true", "false", "null", '"{}": ',
    r'"\"" ([^"\\\x00-\x1f] | "\\" ["\\/bfnrt])+ "\": "', ", ",
)  # fmt: skip
GEMMA4_VALUES = ValueSyntax(
    '<|"|>', "[^<]", "true", "false", "null", "{}:", '[A-Za-z_] [A-Za-z0-9_]*  ":"', ","
)
PYTHON_VALUES = ValueSyntax(
    '"', r'([^"\\\n] | "\\" ["\\nt])', "True", "False", "None", '"{}": ',
    r'"\"" ([^"\\\n] | "\\" ["\\nt])+ "\": "', ", ",
)  # fmt: skip


@dataclass(frozen=True)
class CallSyntax:
    """How a family writes its calls: ``call`` has ``{name}`` and ``{args}`` (an EBNF sequence)."""

    values: ValueSyntax
    call: str  # EBNF of one call
    args_open: str  # the arguments' own brackets and key format (top-level kwargs may differ)
    args_close: str
    args_key: str
    separator: str  # between calls
    list_open: str = ""  # around all the calls
    list_close: str = ""
    member_end: str = ""  # after each argument (Qwen3.5's ``</parameter>``)
    raw_strings: bool = False  # an argument typed as a string is its raw text (Qwen3.5)
    identifier_names: bool = False  # a function's name must read as a (dotted) Python name


HERMES_SYNTAX = CallSyntax(
    JSON_VALUES,
    '"<tool_call>\\n{{\\"name\\": \\"{name}\\", \\"arguments\\": " {args} "}}\\n</tool_call>"',
    "{", "}", '"{}": ', "\n",
)  # fmt: skip
GEMMA4_SYNTAX = CallSyntax(
    GEMMA4_VALUES, '"<|tool_call>call:{name}" {args} "<tool_call|>"', "{", "}", "{}:", ""
)
QWEN3_XML_SYNTAX = CallSyntax(
    JSON_VALUES,
    '"<tool_call>\\n<function={name}>\\n" {args} "</function>\\n</tool_call>"',
    "", "", "<parameter={}>\n", "\n",
    member_end="\n</parameter>\n", raw_strings=True,
)  # fmt: skip
PYTHONIC_SYNTAX = CallSyntax(
    PYTHON_VALUES, '"{name}" {args}', "(", ")", "{}=", ", ", "[", "]", identifier_names=True
)


def q(text: str) -> str:
    """An EBNF string literal."""
    return json.dumps(text, ensure_ascii=False)


class _Builder:
    def __init__(self, syntax: CallSyntax) -> None:
        self.syntax, self.v = syntax, syntax.values
        self.rules: list[str] = []
        self._any = ""

    def rule(self, body: str) -> str:
        name = f"r{len(self.rules)}"
        self.rules.append(f"{name} ::= {body}")
        return name

    def value(self, schema: Any, where: str) -> str:
        if schema is True or schema == {}:
            return self.any_value()
        if not isinstance(schema, dict):
            raise ToolGrammarError(where, "a schema must be an object")
        for k in schema:
            if k not in _HELD and k not in _IGNORED:
                raise ToolGrammarError(where, f"the schema keyword {k!r} cannot be enforced in a tool call")
        if "const" in schema:
            return q(self.v.literal(schema["const"]))
        if "enum" in schema:
            if not isinstance(schema["enum"], list) or not schema["enum"]:
                raise ToolGrammarError(where, "enum must be a non-empty list")
            return "(" + " | ".join(q(self.v.literal(e)) for e in schema["enum"]) + ")"
        for key in ("anyOf", "oneOf"):
            if key in schema:
                options = schema[key]
                if not isinstance(options, list) or not options:
                    raise ToolGrammarError(where, f"{key} must be a non-empty list")
                rest = {k: v for k, v in schema.items() if k != key and k not in _IGNORED}
                if rest:
                    raise ToolGrammarError(where, f"{key} beside {sorted(rest)} cannot be enforced")
                return (
                    "("
                    + " | ".join(self.value(o, f"{where}.{key}[{i}]") for i, o in enumerate(options))
                    + ")"
                )
        types = schema.get("type")
        if types is None:
            return self.any_value() if "properties" not in schema else self.object(schema, where)
        if isinstance(types, list):
            return "(" + " | ".join(self.typed(t, schema, where) for t in types) + ")"
        return self.typed(types, schema, where)

    def typed(self, t: object, schema: dict[str, Any], where: str) -> str:
        if t == "string":
            lo, hi = _bounds(schema, "minLength", "maxLength", where)
            return self.string(lo, hi)
        if t == "integer":
            return self.integer()
        if t == "number":
            return self.rule(f'{self.integer()} ("." [0-9]{{1,15}})?')
        if t == "boolean":
            return f"({q(self.v.true)} | {q(self.v.false)})"
        if t == "null":
            return q(self.v.null)
        if t == "array":
            return self.array(schema, where)
        if t == "object":
            return self.object(schema, where)
        raise ToolGrammarError(where, f"unknown type {t!r}")

    def string(self, lo: int = 0, hi: int | None = None) -> str:
        reps = f"{{{lo},{hi}}}" if hi is not None else ("*" if lo == 0 else f"{{{lo},}}")
        quote = q(self.v.string_quote)
        return self.rule(f"{quote} {self.v.string_char}{reps} {quote}")

    def integer(self) -> str:
        return self.rule('"-"? ("0" | [1-9] [0-9]{0,15})')

    def array(self, schema: dict[str, Any], where: str) -> str:
        item = self.value(schema.get("items", {}), f"{where}.items")
        lo, hi = _bounds(schema, "minItems", "maxItems", where)
        if hi == 0:
            return q("[]")
        sep = q(self.v.member_sep)
        if lo == 0:
            more = "*" if hi is None else f"{{0,{hi - 1}}}"
            return self.rule(f'"[" ({item} ({sep} {item}){more})? "]"')
        more = f"{{{lo - 1},}}" if hi is None else f"{{{lo - 1},{hi - 1}}}"
        return self.rule(f'"[" {item} ({sep} {item}){more} "]"')

    def object(self, schema: dict[str, Any], where: str, top: bool = False) -> str:
        open_, close = (self.syntax.args_open, self.syntax.args_close) if top else ("{", "}")
        key_fmt = self.syntax.args_key if top else self.v.key
        props = schema.get("properties")
        if props is None:
            if top:  # parameters without properties: a call with no arguments
                return q(open_ + close)
            return self.any_object()
        if not isinstance(props, dict):
            raise ToolGrammarError(where, "properties must be an object")
        required = schema.get("required", [])
        if not isinstance(required, list) or not set(required) <= set(props):
            raise ToolGrammarError(where, "required must list properties the schema defines")
        members = [
            (name in required, self.member(key_fmt.replace("{}", name), s, f"{where}.properties.{name}", top))
            for name, s in props.items()
        ]
        sep = '""' if top and self.syntax.member_end else q(self.v.member_sep)
        first = after = '""'  # first: no member yet, from i on; after: some member before
        for req, member in reversed(members):
            new_after = self.rule(f"{sep} {member} {after}" + ("" if req else f" | {after}"))
            new_first = self.rule(f"{member} {after}" + ("" if req else f" | {first}"))
            first, after = new_first, new_after
        return self.rule(f"{q(open_)} {first} {q(close)}")

    def member(self, key: str, schema: Any, where: str, top: bool) -> str:
        if not (top and self.syntax.raw_strings):
            return f"{q(key)} {self.value(schema, where)}"
        if is_string_schema(schema):  # raw text: no '<', so it cannot run into the closing tag
            self.value(schema, where)  # its keywords checked all the same
            if "enum" in schema or "const" in schema:
                options = schema.get("enum", [schema.get("const")])
                value = "(" + " | ".join(q(str(o)) for o in options) + ")"
            else:
                lo, hi = _bounds(schema, "minLength", "maxLength", where)
                value = f"[^<]{{{lo},{hi}}}" if hi is not None else ("[^<]*" if lo == 0 else f"[^<]{{{lo},}}")
        else:
            value = self.value(schema, where)
        return f"{q(key)} {value} {q(self.syntax.member_end)}"

    def any_value(self) -> str:
        if not self._any:
            self._any = "any_value"
            v = self.v
            scalars = f"{self.string()} | {self.rule(self.typed_number())} | {q(v.true)} | {q(v.false)} | {q(v.null)}"
            sep = q(v.member_sep)
            obj = f'"{{" ({v.any_key} any_value ({sep} {v.any_key} any_value)*)? "}}"'
            arr = f'"[" (any_value ({sep} any_value)*)? "]"'
            self.rules.append(f"any_value ::= {scalars} | {obj} | {arr}")
        return "any_value"

    def typed_number(self) -> str:
        return '"-"? ("0" | [1-9] [0-9]{0,15}) ("." [0-9]{1,15})?'

    def any_object(self) -> str:
        self.any_value()
        sep = q(self.v.member_sep)
        return self.rule(f'"{{" ({self.v.any_key} any_value ({sep} {self.v.any_key} any_value)*)? "}}"')


def _bounds(schema: dict[str, Any], lo_key: str, hi_key: str, where: str) -> tuple[int, int | None]:
    lo, hi = schema.get(lo_key, 0), schema.get(hi_key)
    if not isinstance(lo, int) or lo < 0 or (hi is not None and (not isinstance(hi, int) or hi < lo)):
        raise ToolGrammarError(where, f"{lo_key}/{hi_key} must be integers, the first not above the second")
    if lo > _MAX_REPEAT or (hi is not None and hi > _MAX_REPEAT):
        raise ToolGrammarError(where, f"{lo_key}/{hi_key} above {_MAX_REPEAT} cannot be enforced")
    return lo, hi


def call_grammar(syntax: CallSyntax, functions: list[tuple[str, Any, str]], *, parallel: bool) -> str:
    """The grammar of one call (``parallel``: one or more) to one of ``functions``, each given as
    (name, parameters schema, where it sits in the request: ``tools[2].function``)."""
    b = _Builder(syntax)
    calls = []
    for name, params, where in functions:
        if syntax.identifier_names and not all(part.isidentifier() for part in name.split(".")):
            raise ToolGrammarError(
                f"{where}.name", f"{name!r} cannot be called in this model's Python-style calls"
            )
        args = b.object(params if params is not None else {}, f"{where}.parameters", top=True)
        calls.append(syntax.call.format(name=name.replace("\\", "\\\\").replace('"', '\\"'), args=args))
    one = b.rule(" | ".join(f"({c})" for c in calls))
    sep = f" {q(syntax.separator)}" if syntax.separator else ""
    many = f" ({sep} {one})*" if parallel else ""
    head = f"{q(syntax.list_open)} " if syntax.list_open else ""
    tail = f" {q(syntax.list_close)}" if syntax.list_close else ""
    return "\n".join([f"root ::= {head}{one}{many}{tail}", *b.rules])
