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
import json
import sys
from collections.abc import Callable, Sequence
from dataclasses import asdict
from typing import Any

import openai
from pydantic import BaseModel

from cluster.bench.structured_cases import CaseResult, build_cases, make_image_data_url, run_case
from cluster.bench.structured_schemas import SCHEMAS


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
