"""One structured-output request and its check (``structured_suite.py`` runs them): a ``Case`` sent with
the real ``openai`` client (json_schema through the SDK's ``parse`` / ``stream``, the rest through
``chat.completions.create``), validated here into a ``CaseResult``; ``build_cases`` is the suite in order."""

from __future__ import annotations

import base64
import json
import re
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import openai
import pydantic
from pydantic import BaseModel

from cluster.bench.structured_schemas import CHOICE_CASES, JSON_OBJECT_CASE, REGEX_CASES, SCHEMAS

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
        return _judged(res, model, parsed)
    parts: list[str] = []
    final_parsed: object | None = None
    try:
        with client.beta.chat.completions.stream(
            messages=messages, response_format=model, stream_options={"include_usage": True}, **common
        ) as s:
            for event in s:
                if event.type != "chunk":
                    continue
                _take_chunk(event.chunk, res, parts)
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
    return _judged(res, model, final_parsed)


def _judged(res: CaseResult, model: type[BaseModel], parsed: object | None) -> CaseResult:
    """``res`` valid when the SDK parsed a ``model`` and the content validates as one."""
    res.why = "parsed is None" if parsed is None else _check_model(model, res.content, parsed)
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
            _take_chunk(chunk, res, parts)
        res.content = "".join(parts)
    res.why = case.check(res.content)
    res.ok = not res.why
    return res


def _take_chunk(chunk: Any, res: CaseResult, parts: list[str]) -> None:
    """One streamed chunk into ``res``: its usage, its content delta (onto ``parts``), its finish reason."""
    if chunk.usage is not None:
        res.completion_tokens = chunk.usage.completion_tokens
    for c in chunk.choices:
        if c.delta.content:
            parts.append(c.delta.content)
        if c.finish_reason:
            res.finish_reason = c.finish_reason


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
