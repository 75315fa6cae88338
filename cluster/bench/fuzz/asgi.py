"""A Starlette ``Request`` whose body is the fuzzer's bytes, as the HTTP targets' routes receive it."""

from __future__ import annotations

from typing import Any

from starlette.requests import Request


def request(body: bytes, path: str) -> Request:
    """A POST to ``path`` with ``body`` in one message and its ``Content-Length``, then a disconnect."""
    sent = False

    async def receive() -> dict[str, Any]:
        nonlocal sent
        if sent:
            return {"type": "http.disconnect"}
        sent = True
        return {"type": "http.request", "body": body, "more_body": False}

    headers = [(b"content-length", str(len(body)).encode())]
    return Request({"type": "http", "method": "POST", "path": path, "headers": headers}, receive)
