"""Bad input is a 4xx naming the problem, never a 500."""

from __future__ import annotations

from typing import Any

import httpx
import pytest
from openai import BadRequestError, NotFoundError, OpenAI

from tests.integration.e2e.common import (
    AUDIO,
    PORT,
    VL,
)

pytestmark = pytest.mark.usefixtures("app")  # the package's one app (conftest.py)


@pytest.mark.parametrize(
    ("model", "content", "status", "code"),
    [
        (
            VL,
            [{"type": "image_url", "image_url": {"url": "data:image/png;base64,AAAA"}}] * 3,
            400,
            "too_many_items",
        ),
        (
            VL,
            [{"type": "image_url", "image_url": {"url": "data:image/png;base64,bm90IGFuIGltYWdl"}}],
            None,
            None,
        ),
        (
            VL,
            [{"type": "input_audio", "input_audio": {"data": "AAAA", "format": "wav"}}],
            400,
            "unsupported_modality",
        ),
        (
            AUDIO,
            [{"type": "image_url", "image_url": {"url": "file:///etc/passwd"}}],
            400,
            "unsupported_modality",
        ),
        (VL, [{"type": "image_url", "image_url": {"url": "file:///etc/passwd"}}], 403, "url_not_allowed"),
    ],
)
def test_client_errors_are_4xx(model: str, content: Any, status: int | None, code: str | None) -> None:
    r = httpx.post(
        f"http://127.0.0.1:{PORT}/v1/chat/completions",
        json={"model": model, "messages": [{"role": "user", "content": content}], "max_tokens": 4},
        timeout=60,
    )
    assert 400 <= r.status_code < 500, r.text
    if status is not None:
        assert r.status_code == status and r.json()["error"]["code"] == code, r.text
    assert r.json()["error"]["message"]


def test_unknown_model_and_bad_params() -> None:
    c = OpenAI(base_url=f"http://127.0.0.1:{PORT}/v1", api_key="unused", max_retries=0)
    with pytest.raises(NotFoundError):
        c.chat.completions.create(model="nope", messages=[{"role": "user", "content": "x"}])
    with pytest.raises(BadRequestError):
        c.chat.completions.create(model=VL, messages=[{"role": "user", "content": "x"}], temperature=5)
    with pytest.raises(BadRequestError) as e:
        c.chat.completions.create(model=VL, messages=[{"role": "user", "content": "x"}], max_tokens=100000)
    body: Any = e.value.body
    assert "max_model_len" in body["message"]


@pytest.mark.parametrize(
    ("body", "needle"),
    [
        (b'{"model": "x", "messages": ' + b"[" * 5_000 + b"]" * 5_000 + b"}", "nested too deeply"),
        (b'{"model": "x", "messages": ' + b"[" * 100_000 + b"]" * 100_000 + b"}", "JSON values"),
        (b'{"model": "x", "max_tokens": ' + b"9" * 5000 + b', "messages": []}', "not valid JSON"),
    ],
    ids=["deep-nesting", "too-many-values", "5000-digit-integer"],
)
def test_hostile_json_bodies_are_400(body: bytes, needle: str) -> None:
    r = httpx.post(
        f"http://127.0.0.1:{PORT}/v1/chat/completions",
        content=body,
        headers={"Content-Type": "application/json"},
        timeout=60,
    )
    assert r.status_code == 400, r.text
    assert needle in r.json()["error"]["message"]


@pytest.mark.parametrize("with_image", [False, True], ids=["text", "image"])
def test_tools_for_a_template_without_them_are_a_400_naming_tools(with_image: bool) -> None:
    """The default tiny Qwen2-VL's template has no tool section: tools are refused by name, not dropped
    (docs/tools.md), whichever side would render the prompt."""
    c = OpenAI(base_url=f"http://127.0.0.1:{PORT}/v1", api_key="unused", max_retries=0)
    image = {"type": "image_url", "image_url": {"url": "data:image/png;base64,AAAA"}}
    content: Any = [image, {"type": "text", "text": "x"}] if with_image else "x"
    tools: Any = [{"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}]
    with pytest.raises(BadRequestError) as e:
        c.chat.completions.create(model=VL, messages=[{"role": "user", "content": content}], tools=tools)
    body: Any = e.value.body
    assert (body["param"], body["code"]) == ("tools", "tools_unsupported"), body
