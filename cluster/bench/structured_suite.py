"""Structured outputs, client side (issue 46): 20 pydantic schemas, regex, choice and ``json_object``
cases, sent with the real ``openai`` client to any OpenAI-compatible server (mmserve, vLLM), each with
one image, streamed and not streamed; every answer is validated here.

- json_schema, not streamed: ``client.beta.chat.completions.parse(response_format=Model)`` (the SDK
  sends ``to_strict_json_schema(Model)``: every property required, ``additionalProperties: false``;
  optional fields are ``X | None``). Valid when ``.parsed`` is a ``Model`` and
  ``Model.model_validate_json(content)`` passes.
- json_schema, streamed: ``client.beta.chat.completions.stream(response_format=Model)`` (the SDK's
  partial-JSON parsing runs on every chunk); the deltas are concatenated and validated the same way.
- regex / choice: vLLM's extension ``extra_body={"structured_outputs": {"regex"|"choice": ...}}``;
  valid when ``re.fullmatch`` / membership holds.
- json_object: ``response_format={"type": "json_object"}``; valid when ``json.loads`` gives a dict.

On a random-weight model only the grammar makes an answer valid. ``--control`` sends the json_schema
cases with no ``response_format`` (expected to fail: it shows the validity comes from the grammar).

    python -m cluster.bench.structured_suite --base-url http://127.0.0.1:8011/v1 --model tiny-qwen2-vl \
        --stream both --max-tokens 256

Caveats: a streamed json_schema case cut at ``max_tokens`` has no completion-token count (the SDK
raises ``LengthFinishReasonError`` at the finish chunk, before the usage chunk); a streamed case
whose partial JSON the SDK rejects (e.g. a raw control character in a string) keeps the content up
to the chunk before. vLLM 0.32 on the tiny random Qwen2-VL (peer dir), default settings: 0/20 valid
at 64, 256 and 1024 tokens (any-whitespace runaway); with ``--structured-outputs-config
'{"backend": "xgrammar", "disable_any_whitespace": true}'`` 17/20 at 256 (3 strings carry raw
U+0000-U+001F characters, invalid JSON).

Importing this module starts nothing (no Ray, no server); ``run_suite`` is the entry for tests.
"""

from __future__ import annotations

import argparse
import base64
import enum
import json
import re
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from typing import Annotated, Any, Literal

import openai
import pydantic
from pydantic import BaseModel, Field

# ---------------------------------------------------------------------------------------------------
# The 20 schemas. Every string and array is bounded (maxLength / pattern / maxItems) so that a
# grammar-constrained random model can finish an object in a few dozen tokens.

Short = Annotated[str, Field(max_length=16)]


class Flag(BaseModel):
    """1: a single boolean."""

    present: bool


class Color(BaseModel):
    """2: a Literal enum."""

    color: Literal["red", "green", "blue", "yellow"]


class Rating(BaseModel):
    """3: an integer with inclusive bounds."""

    stars: int = Field(ge=1, le=5)


class Measurement(BaseModel):
    """4: a bounded number plus a unit enum."""

    value: float = Field(ge=0, le=100)
    unit: Literal["mm", "cm", "m"]


class Caption(BaseModel):
    """5: a string with maxLength."""

    caption: str = Field(max_length=40)


class Tags(BaseModel):
    """6: an array of short strings, 1 to 3 items."""

    tags: list[Short] = Field(min_length=1, max_length=3)


class Shape(enum.Enum):
    circle = "circle"
    square = "square"
    triangle = "triangle"


class ShapeCount(BaseModel):
    """7: a Python Enum ($ref to $defs) and a count 0..20."""

    shape: Shape
    count: int = Field(ge=0, le=20)


class Titled(BaseModel):
    """8: optional fields (``X | None``, required in strict mode)."""

    title: Short
    subtitle: Short | None = None
    year: int | None = Field(default=None, ge=1900, le=2100)


class Answer(BaseModel):
    """9: ``anyOf`` of two primitives."""

    answer: Annotated[int, Field(ge=0, le=999)] | Annotated[str, Field(max_length=10)]


class Point(BaseModel):
    x: int = Field(ge=0, le=1000)
    y: int = Field(ge=0, le=1000)


class BoundingBox(BaseModel):
    """10: nested objects (two Points)."""

    top_left: Point
    bottom_right: Point


class Leaf(BaseModel):
    name: Short
    visible: bool


class Middle(BaseModel):
    leaf: Leaf
    depth: Literal[2]


class Outer(BaseModel):
    """11: three levels of nesting and a ``const``."""

    inner: Middle
    level: Literal["top"]


class Detection(BaseModel):
    label: Literal["person", "car", "dog", "cat", "tree"]
    confidence: float = Field(ge=0, le=1)


class Detections(BaseModel):
    """12: a list of objects, 0 to 3."""

    detections: list[Detection] = Field(max_length=3)


class LineItem(BaseModel):
    name: Short
    quantity: int = Field(ge=1, le=99)
    unit_price: float = Field(ge=0, le=10000)


class Receipt(BaseModel):
    """13: a receipt-like extraction: patterned date, line items, total, currency enum."""

    merchant: Annotated[str, Field(max_length=24)]
    date: str = Field(pattern=r"^\d{4}-\d{2}-\d{2}$")
    items: list[LineItem] = Field(min_length=1, max_length=3)
    total: float = Field(ge=0, le=100000)
    currency: Literal["USD", "EUR", "GBP"]


class Product(BaseModel):
    """14: strings with ``pattern``."""

    sku: str = Field(pattern=r"^[A-Z]{3}-[0-9]{4}$")
    zip_code: str = Field(pattern=r"^[0-9]{5}$")


class Circle(BaseModel):
    kind: Literal["circle"]
    radius: int = Field(ge=1, le=100)


class Rect(BaseModel):
    kind: Literal["rect"]
    width: int = Field(ge=1, le=100)
    height: int = Field(ge=1, le=100)


class Drawing(BaseModel):
    """15: ``anyOf`` of two object types (a union of models)."""

    figure: Circle | Rect


class Grid(BaseModel):
    """16: an array of arrays with exact lengths (2x2 digits)."""

    grid: list[Annotated[list[Annotated[int, Field(ge=0, le=9)]], Field(min_length=2, max_length=2)]] = Field(
        min_length=2, max_length=2
    )


class Contact(BaseModel):
    """17: a person: bounded age, optional patterned phone, optional nested Point."""

    name: Short
    age: int = Field(ge=0, le=120)
    phone: Annotated[str, Field(pattern=r"^\+?[0-9]{7,12}$")] | None = None
    location: Point | None = None


class ImageQuality(BaseModel):
    """18: several booleans and a byte-range integer."""

    blurry: bool
    dark: bool
    has_text: bool
    has_faces: bool
    brightness: int = Field(ge=0, le=255)


class Palette(BaseModel):
    """19: an array of enums, 1 to 4 items."""

    colors: list[Literal["red", "green", "blue", "black", "white"]] = Field(min_length=1, max_length=4)


class Reading(BaseModel):
    """20: negative and exclusive bounds, integer and number."""

    temperature_c: int = Field(gt=-50, lt=60)
    delta: float = Field(ge=-1, le=1)
    trend: Literal["up", "down", "flat"]


SCHEMAS: list[type[BaseModel]] = [
    Flag,
    Color,
    Rating,
    Measurement,
    Caption,
    Tags,
    ShapeCount,
    Titled,
    Answer,
    BoundingBox,
    Outer,
    Detections,
    Receipt,
    Product,
    Drawing,
    Grid,
    Contact,
    ImageQuality,
    Palette,
    Reading,
]

# (name, regex) and (name, choices): vLLM's ``structured_outputs`` extension.
REGEX_CASES: list[tuple[str, str]] = [
    ("regex:phone", r"[0-9]{3}-[0-9]{4}"),
    ("regex:yes_no", r"(yes|no)"),
    ("regex:email", r"[a-z]{3,8}@[a-z]{3,6}\.com"),
]
CHOICE_CASES: list[tuple[str, list[str]]] = [
    ("choice:animal", ["cat", "dog", "bird"]),
    ("choice:sentiment", ["positive", "negative", "neutral"]),
]
JSON_OBJECT_CASE = "json_object"

PROMPT = "Look at the image and answer with JSON only."


@dataclass
class CaseResult:
    case: str
    kind: str  # json_schema | regex | choice | json_object | control
    stream: bool
    ok: bool
    why: str = ""
    finish_reason: str | None = None
    completion_tokens: int | None = None
    whitespace: int = 0  # whitespace chars outside JSON strings (all whitespace for regex / choice)
    newlines: int = 0
    seconds: float = 0.0
    content: str = field(default="", repr=False)


def make_image_data_url(width: int = 96, height: int = 64) -> str:
    """A small deterministic PNG (the peer README's gradient) as a ``data:`` URL."""
    import io

    from PIL import Image

    img = Image.new("RGB", (width, height))
    px = img.load()
    assert px is not None
    for y in range(height):
        for x in range(width):
            px[x, y] = ((x * 7) % 256, (y * 11) % 256, ((x + y) * 5) % 256)
    buf = io.BytesIO()
    img.save(buf, format="PNG")
    return "data:image/png;base64," + base64.b64encode(buf.getvalue()).decode()


def json_whitespace(text: str) -> int:
    """Whitespace characters outside JSON string literals (the grammar's inter-token whitespace)."""
    n, in_str, esc = 0, False, False
    for ch in text:
        if in_str:
            if esc:
                esc = False
            elif ch == "\\":
                esc = True
            elif ch == '"':
                in_str = False
        elif ch == '"':
            in_str = True
        elif ch in " \t\n\r":
            n += 1
    return n


def _messages(image_data_url: str, text: str) -> list[Any]:
    return [
        {
            "role": "user",
            "content": [
                {"type": "image_url", "image_url": {"url": image_data_url}},
                {"type": "text", "text": text},
            ],
        }
    ]


def _prompt(model: type[BaseModel]) -> str:
    return f"{PROMPT} Fill this: {model.__name__} ({model.__doc__ or ''})".strip()


def _why(exc: BaseException) -> str:
    return f"{type(exc).__name__}: {str(exc).splitlines()[0][:160] if str(exc) else ''}"


def _check_model(model: type[BaseModel], content: str, parsed: object | None) -> str:
    """'' when valid, else why not."""
    try:
        model.model_validate_json(content)
    except pydantic.ValidationError as exc:
        err = exc.errors()[0]
        return f"invalid: {err['type']} at {err['loc']}: {err['msg'][:120]}"
    if parsed is not None and not isinstance(parsed, model):
        return f"parsed is {type(parsed).__name__}, not {model.__name__}"
    return ""


def _schema_case(
    client: openai.OpenAI, name: str, model: type[BaseModel], stream: bool, common: dict[str, Any]
) -> CaseResult:
    res = CaseResult(case=name, kind="json_schema", stream=stream, ok=False)
    messages = _messages(common.pop("image_data_url"), _prompt(model))
    if not stream:
        raw = client.beta.chat.completions.with_raw_response.parse(
            messages=messages, response_format=model, **common
        )
        body = raw.http_response.json()
        choice = body["choices"][0]
        res.content = choice["message"].get("content") or ""
        res.finish_reason = choice.get("finish_reason")
        res.completion_tokens = (body.get("usage") or {}).get("completion_tokens")
        try:
            parsed = raw.parse().choices[0].message.parsed
        except pydantic.ValidationError:
            res.why = _check_model(model, res.content, None) or "the SDK's parse failed"
            return res
        except Exception as exc:  # LengthFinishReasonError, ...
            res.why = _why(exc)
            return res
        if parsed is None:
            res.why = "parsed is None"
            return res
        res.why = _check_model(model, res.content, parsed)
        res.ok = not res.why
        return res
    parts: list[str] = []
    final_parsed: object | None = None
    try:
        with client.beta.chat.completions.stream(
            messages=messages, response_format=model, stream_options={"include_usage": True}, **common
        ) as s:
            for event in s:
                if event.type != "chunk":
                    continue
                chunk = event.chunk
                if chunk.usage is not None:
                    res.completion_tokens = chunk.usage.completion_tokens
                for c in chunk.choices:
                    if c.delta.content:
                        parts.append(c.delta.content)
                    if c.finish_reason:
                        res.finish_reason = c.finish_reason
            final_parsed = s.get_final_completion().choices[0].message.parsed
    except openai.LengthFinishReasonError as exc:
        res.finish_reason = "length"
        res.content = exc.completion.choices[0].message.content or "".join(parts)
        res.why = _why(exc)
        return res
    except Exception as exc:  # partial-JSON parse errors mid-stream, HTTP errors
        res.content = "".join(parts)
        res.why = _why(exc)
        return res
    res.content = "".join(parts)
    if final_parsed is None:
        res.why = "parsed is None"
        return res
    res.why = _check_model(model, res.content, final_parsed)
    res.ok = not res.why
    return res


def _raw_case(
    client: openai.OpenAI,
    case: Case,
    stream: bool,
    common: dict[str, Any],
    response_format: Any = None,
    extra: dict[str, Any] | None = None,
) -> CaseResult:
    """regex / choice / json_object / control: ``chat.completions.create``, checked by ``case.check``."""
    name, kind, text = case.name, case.kind, case.text
    res = CaseResult(case=name, kind=kind, stream=stream, ok=False)
    kwargs: dict[str, Any] = dict(common)
    messages = _messages(kwargs.pop("image_data_url"), text)
    if response_format is not None:
        kwargs["response_format"] = response_format
    if extra:
        kwargs["extra_body"] = {**(kwargs.get("extra_body") or {}), **extra}
    if not stream:
        out = client.chat.completions.create(messages=messages, stream=False, **kwargs)
        res.content = out.choices[0].message.content or ""
        res.finish_reason = out.choices[0].finish_reason
        res.completion_tokens = out.usage.completion_tokens if out.usage else None
    else:
        parts: list[str] = []
        chunks = client.chat.completions.create(
            messages=messages, stream=True, stream_options={"include_usage": True}, **kwargs
        )
        for chunk in chunks:
            if chunk.usage is not None:
                res.completion_tokens = chunk.usage.completion_tokens
            for c in chunk.choices:
                if c.delta.content:
                    parts.append(c.delta.content)
                if c.finish_reason:
                    res.finish_reason = c.finish_reason
        res.content = "".join(parts)
    res.why = case.check(res.content)
    res.ok = not res.why
    return res


def _check_json_object(content: str) -> str:
    try:
        value = json.loads(content)
    except ValueError as exc:
        return f"not JSON: {exc}"
    return "" if isinstance(value, dict) else f"JSON {type(value).__name__}, not an object"


@dataclass(frozen=True)
class Case:
    """One request: ``kind`` json_schema (``model``), regex / choice (``extra``), json_object or control."""

    name: str
    kind: str
    text: str
    model: type[BaseModel] | None = None
    regex: str | None = None
    choices: tuple[str, ...] = ()

    def check(self, content: str) -> str:
        """'' when ``content`` is valid for this case, else why not."""
        if self.kind == "regex":
            assert self.regex is not None
            return "" if re.fullmatch(self.regex, content) else f"no fullmatch of {self.regex!r}"
        if self.kind == "choice":
            return "" if content in self.choices else f"{content[:40]!r} not in {list(self.choices)}"
        if self.kind == "json_object":
            return _check_json_object(content)
        assert self.model is not None
        return _check_model(self.model, content, None)


def build_cases(
    schemas: Sequence[type[BaseModel]] | None = None, *, extras: bool = True, control: bool = False
) -> list[Case]:
    """The suite in order: the schemas, then regex, choice, json_object (``extras``), then controls."""
    models = list(schemas if schemas is not None else SCHEMAS)
    cases = [Case(m.__name__, "json_schema", _prompt(m), model=m) for m in models]
    if extras:
        cases += [
            Case(n, "regex", f"Answer matching the regular expression {rx}", regex=rx)
            for n, rx in REGEX_CASES
        ]
        cases += [
            Case(n, "choice", f"Answer with one of: {', '.join(ch)}", choices=tuple(ch))
            for n, ch in CHOICE_CASES
        ]
        cases.append(Case(JSON_OBJECT_CASE, "json_object", "Describe the image as a JSON object."))
    if control:
        cases += [Case(f"control:{m.__name__}", "control", _prompt(m), model=m) for m in models]
    return cases


def run_case(client: openai.OpenAI, case: Case, *, stream: bool, common: dict[str, Any]) -> CaseResult:
    """Send one case; ``common`` has model, max_tokens, temperature, image_data_url, maybe extra_body.
    A request that errors (HTTP 4xx/5xx, timeout) is a failed result with the error as ``why``."""
    t0 = time.perf_counter()
    kw = dict(common)
    try:
        if case.kind == "json_schema":
            assert case.model is not None
            res = _schema_case(client, case.name, case.model, stream, kw)
        elif case.kind == "regex":
            res = _raw_case(client, case, stream, kw, extra={"structured_outputs": {"regex": case.regex}})
        elif case.kind == "choice":
            res = _raw_case(
                client, case, stream, kw, extra={"structured_outputs": {"choice": list(case.choices)}}
            )
        elif case.kind == "json_object":
            res = _raw_case(client, case, stream, kw, response_format={"type": "json_object"})
        else:
            res = _raw_case(client, case, stream, kw)
    except Exception as exc:  # the server refused it (4xx), failed (5xx) or timed out
        res = CaseResult(case=case.name, kind=case.kind, stream=stream, ok=False, why=_why(exc))
    res.seconds = time.perf_counter() - t0
    if case.kind in ("json_schema", "json_object", "control"):
        res.whitespace = json_whitespace(res.content)
    else:
        res.whitespace = sum(ch.isspace() for ch in res.content)
    res.newlines = res.content.count("\n")
    return res


def run_suite(
    base_url: str,
    model: str,
    *,
    stream: bool,
    image_data_url: str | None = None,
    max_tokens: int = 256,
    timeout: float = 120.0,
    temperature: float = 0.0,
    api_key: str = "EMPTY",
    schemas: Sequence[type[BaseModel]] | None = None,
    extras: bool = True,
    control: bool = False,
    extra_body: dict[str, Any] | None = None,
    on_result: Callable[[CaseResult], None] | None = None,
) -> list[CaseResult]:
    """Send every case once (``stream`` picks streamed or not), one after the other, and validate each.

    ``schemas`` defaults to ``SCHEMAS``; ``extras`` adds the regex, choice and json_object cases;
    ``control`` adds the schema prompts with no ``response_format`` (expected invalid on a random
    model); ``extra_body`` goes on every request (e.g. vLLM's ``{"structured_outputs": {...}}``
    options). ``image_data_url`` defaults to ``make_image_data_url()``.
    """
    client = openai.OpenAI(base_url=base_url, api_key=api_key, timeout=timeout, max_retries=0)
    common: dict[str, Any] = {
        "model": model,
        "max_tokens": max_tokens,
        "temperature": temperature,
        "image_data_url": image_data_url or make_image_data_url(),
    }
    if extra_body:
        common["extra_body"] = dict(extra_body)
    results: list[CaseResult] = []
    for case in build_cases(schemas, extras=extras, control=control):
        res = run_case(client, case, stream=stream, common=common)
        results.append(res)
        if on_result is not None:
            on_result(res)
    return results


# ---------------------------------------------------------------------------------------------------
# CLI


def _fmt_table(rows: dict[str, dict[bool, CaseResult]], modes: list[bool]) -> str:
    head = ["case"]
    for s in modes:
        tag = "stream" if s else "plain"
        head += [f"{tag} valid", f"{tag} finish", f"{tag} tok", f"{tag} ws", f"{tag} nl"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for name, by_mode in rows.items():
        cells = [name]
        for s in modes:
            r = by_mode.get(s)
            if r is None:
                cells += ["", "", "", "", ""]
                continue
            cells += [
                "yes" if r.ok else "NO",
                str(r.finish_reason),
                "" if r.completion_tokens is None else str(r.completion_tokens),
                str(r.whitespace),
                str(r.newlines),
            ]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def _totals(results: list[CaseResult], modes: list[bool]) -> str:
    out = []
    for s in modes:
        tag = "streamed" if s else "not streamed"
        for kind in ("json_schema", "regex", "choice", "json_object", "control"):
            rs = [r for r in results if r.stream == s and r.kind == kind]
            if rs:
                out.append(
                    f"{tag} {kind}: {sum(r.ok for r in rs)}/{len(rs)} valid, "
                    f"finish {dict(sorted(_count(r.finish_reason for r in rs).items()))}, "
                    f"whitespace outside strings total {sum(r.whitespace for r in rs)} "
                    f"(max {max(r.whitespace for r in rs)}), newlines {sum(r.newlines for r in rs)}"
                )
    return "\n".join(out)


def _count(values: Any) -> dict[str, int]:
    c: dict[str, int] = {}
    for v in values:
        c[str(v)] = c.get(str(v), 0) + 1
    return c


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    p.add_argument("--base-url", required=True, help="e.g. http://127.0.0.1:8011/v1")
    p.add_argument("--model", required=True)
    p.add_argument("--stream", choices=["no", "yes", "both"], default="both")
    p.add_argument("--max-tokens", type=int, default=256)
    p.add_argument("--timeout", type=float, default=120.0)
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--api-key", default="EMPTY")
    p.add_argument(
        "--only", default="", help="comma-separated case names (schema class names, regex:..., ...)"
    )
    p.add_argument("--no-extras", action="store_true", help="only the 20 schemas")
    p.add_argument("--control", action="store_true", help="also the schemas with no response_format")
    p.add_argument("--extra-body", default="", help="JSON merged into every request body")
    p.add_argument("--json", default="", help="write all results (with contents) here")
    p.add_argument("--show", action="store_true", help="print each content as it comes")
    args = p.parse_args(argv)
    modes = {"no": [False], "yes": [True], "both": [False, True]}[args.stream]
    only = {s.strip() for s in args.only.split(",") if s.strip()}
    schemas = [m for m in SCHEMAS if not only or m.__name__ in only]
    image = make_image_data_url()
    extra_body = json.loads(args.extra_body) if args.extra_body else None

    def show(r: CaseResult) -> None:
        if args.show:
            mark = "ok " if r.ok else "BAD"
            print(
                f"{mark} {'S' if r.stream else 'P'} {r.case}: {r.finish_reason} {r.content!r} {r.why}",
                flush=True,
            )

    results: list[CaseResult] = []
    for s in modes:
        got = run_suite(
            args.base_url,
            args.model,
            stream=s,
            image_data_url=image,
            max_tokens=args.max_tokens,
            timeout=args.timeout,
            temperature=args.temperature,
            api_key=args.api_key,
            schemas=schemas,
            extras=not args.no_extras,
            control=args.control,
            extra_body=extra_body,
            on_result=show,
        )
        results += [r for r in got if not only or r.case in only or r.kind in ("json_schema", "control")]
    rows: dict[str, dict[bool, CaseResult]] = {}
    for r in results:
        rows.setdefault(r.case, {})[r.stream] = r
    print(
        f"base_url={args.base_url} model={args.model} max_tokens={args.max_tokens} temperature={args.temperature}"
    )
    print(_fmt_table(rows, modes))
    print()
    print(_totals(results, modes))
    bad = [r for r in results if not r.ok and r.kind != "control"]
    for r in bad:
        print(f"  failed {'streamed' if r.stream else 'plain'} {r.case}: {r.why} | {r.content[:120]!r}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump([asdict(r) for r in results], f, indent=1)
    return 0 if not bad else 1


if __name__ == "__main__":
    sys.exit(main())
