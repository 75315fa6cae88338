"""A request body, read within its bounds and validated into its pydantic model: 413 past
``max_request_bytes``, 400 past ``max_json_values`` or for bad JSON, and a 400 naming the field
pydantic refused (an unknown field in OpenAI's words, "Unrecognized request argument supplied")."""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import TypeVar

from fastapi import Request
from pydantic import BaseModel, ValidationError

from router.http.json_limits import check_json_values
from router.protocol.errors import APIError, bad_request

Body = TypeVar("Body", bound=BaseModel)


async def read_body(
    request: Request,
    model: type[Body],
    max_bytes: int,
    max_json_values: int,
    reserve: Callable[[int], None] | None = None,
) -> Body:
    """``reserve(n)``: the body's bytes so far (its ``Content-Length`` before any byte is read, then
    each chunk before it is kept) go into the admission's body budget, which raises a 503 past it."""
    declared = request.headers.get("content-length")
    if declared is not None and declared.isdigit() and int(declared) > max_bytes:
        raise APIError(413, f"request body exceeds {max_bytes} bytes", code="request_too_large")
    if reserve is not None and declared is not None and declared.isdigit():
        reserve(int(declared))  # before the first byte is read
    body = bytearray()
    async for chunk in request.stream():
        if len(body) + len(chunk) > max_bytes:
            raise APIError(413, f"request body exceeds {max_bytes} bytes", code="request_too_large")
        if reserve is not None:  # without a Content-Length (or past it): as the bytes arrive
            reserve(len(body) + len(chunk))
        body.extend(chunk)
    await check_json_values(body, max_json_values)  # what it parses into is bounded too
    try:
        payload = json.loads(body)
    except RecursionError as e:  # nested deeper than the parser's stack
        raise bad_request("request body is nested too deeply") from e
    except (ValueError, UnicodeDecodeError) as e:  # JSONDecodeError, an integer over 4300 digits
        raise bad_request(f"request body is not valid JSON: {e}") from e
    try:
        return model.model_validate(payload)
    except ValidationError as e:
        first = e.errors()[0]
        # a tagged union's branch (a tag that starts with "|") is no part of the field's path
        where = ".".join(str(p) for p in first["loc"] if not str(p).startswith("|"))
        if first["type"] == "extra_forbidden":  # OpenAI's words for a field it does not know
            raise bad_request(
                f"Unrecognized request argument supplied: {where} (this server does not implement it)",
                code="unrecognized_argument",
                param=where,
            ) from e
        raise bad_request(f"{where}: {first['msg']}", param=where or None) from e
