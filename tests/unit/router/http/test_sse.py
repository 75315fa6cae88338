"""Server-sent events of a streamed completion (router/http/sse.py): the rendered JSON equals the pydantic
models' for the same fields, and the event ending in [DONE] closes the body in its own write."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator
from typing import Any

import pytest

from router.http.sse import DONE, ChunkRenderer, SSEResponse
from router.protocol.chat_output import ChatCompletionChunk, Delta, StreamChoice
from router.protocol.messages import MessageLimits

LIMITS = MessageLimits(max_messages=4, max_content_parts=4, max_media_bytes=1 << 10, limit_mm_per_prompt={})
TEXTS = ["", "a", 'quote " and \\ backslash', "line\nbreak\ttab\x01", "héllo — 你好 🙂", "\u2028"]


def _parsed(event: str) -> Any:
    assert event.startswith("data: ") and event.endswith("\n\n") and event.count("\n\n") == 1
    return json.loads(event.removeprefix("data: "))


def _pydantic(request_id: str, model: str, created: int, delta: Delta, finish: str | None) -> Any:
    chunk = ChatCompletionChunk(
        id=request_id,
        model=model,
        created=created,
        choices=[StreamChoice(delta=delta, finish_reason=finish)],
    )
    return _parsed(f"data: {chunk.model_dump_json(exclude_none=True)}\n\n")


@pytest.mark.parametrize("text", TEXTS)
@pytest.mark.parametrize("finish", [None, "stop", "length"])
def test_a_rendered_event_parses_to_what_the_pydantic_chunk_gives(text: str, finish: str | None) -> None:
    r = ChunkRenderer('chatcmpl-"x"', 'm/ü"1', created=1234)
    got = _parsed(r.delta(text, finish))
    assert got == _pydantic('chatcmpl-"x"', 'm/ü"1', 1234, Delta(content=text), finish)


def test_the_role_event_is_the_pydantic_role_chunk() -> None:
    r = ChunkRenderer("chatcmpl-1", "tiny", created=7)
    assert _parsed(r.role()) == _pydantic("chatcmpl-1", "tiny", 7, Delta(role="assistant", content=""), None)


class _Recorder:
    def __init__(self) -> None:
        self.messages: list[dict[str, Any]] = []

    async def __call__(self, message: dict[str, Any]) -> None:
        self.messages.append(message)


async def _events(items: list[str], ran: list[str]) -> AsyncIterator[str]:
    try:
        for item in items:
            yield item
        ran.append("ran to its end")
    finally:
        ran.append("closed")


def _run(items: list[str]) -> tuple[list[dict[str, Any]], list[str]]:
    ran: list[str] = []
    send = _Recorder()
    asyncio.run(SSEResponse(_events(items, ran), media_type="text/event-stream").stream_response(send))
    return send.messages, ran


def test_the_done_event_ends_the_body_in_the_same_send_and_the_body_still_runs_to_its_end() -> None:
    r = ChunkRenderer("chatcmpl-1", "tiny", created=7)
    first, last = r.role() + r.delta("Hi"), r.delta("!", "stop") + DONE
    messages, ran = _run([first, last])
    assert messages[0]["type"] == "http.response.start"
    bodies = [(m["body"], m["more_body"]) for m in messages[1:]]
    assert bodies == [(first.encode(), True), (last.encode(), False)]  # no empty chunk after [DONE]
    assert ran == ["ran to its end", "closed"]


def test_a_body_without_done_still_ends_with_an_empty_chunk() -> None:
    messages, _ = _run(["data: {}\n\n"])
    assert [(m["body"], m["more_body"]) for m in messages[1:]] == [(b"data: {}\n\n", True), (b"", False)]


# ---- the ingress's stream: events per write, end to end through SSEResponse ----------------------------


class _Orchestrator:
    """What ``ChatService._sse`` asks of an orchestrator: settle, forget, decode."""

    def __init__(self) -> None:
        self.forgotten: list[str] = []

    async def settle(self, request_id: str) -> None:
        return None

    def forget(self, request_id: str) -> None:
        self.forgotten.append(request_id)

    def decode(self, ids: Any) -> str:
        return "".join(chr(ord("a") + i) for i in ids)

    def replay(self, request_id: str) -> None:
        return None


def _stream_bodies(outputs: list[Any], fail_after: int | None = None) -> tuple[list[tuple[bytes, bool]], Any]:
    from llm_service.outputs import RequestOutput
    from router.http.chat import ChatService, ServedModel
    from router.journey.detokenizer import IncrementalDetokenizer
    from router.protocol.messages import normalize_messages
    from router.protocol.openai import ChatCompletionRequest

    orch = _Orchestrator()
    model = ServedModel("tiny", orch, None, 4096, ["image"])  # type: ignore[arg-type]
    service = ChatService({"tiny": model}, max_request_bytes=1 << 16)
    req = ChatCompletionRequest.model_validate(
        {"model": "tiny", "stream": True, "messages": [{"role": "user", "content": "hi"}]}
    )
    outs = [
        RequestOutput("r1", [t], None, i == len(outputs) - 1, fin, 3, 0) for i, (t, fin) in enumerate(outputs)
    ]

    async def rest() -> Any:
        for i, out in enumerate(outs[1:], start=1):
            if fail_after is not None and i > fail_after:
                raise RuntimeError("the replica broke")
            yield out

    async def run() -> list[tuple[bytes, bool]]:
        detok = IncrementalDetokenizer(orch.decode)
        chat = normalize_messages(req.messages, LIMITS, tenant=None)
        gen = service._sse(req, model, "r1", outs[0], rest(), detok, 0.0, chat)  # type: ignore[arg-type]
        send = _Recorder()
        await SSEResponse(gen, media_type="text/event-stream").stream_response(send)
        return [(m["body"], m["more_body"]) for m in send.messages[1:]]

    return asyncio.run(run()), orch


def _split(body: bytes) -> list[str]:
    return [e for e in body.decode().split("\n\n") if e]


def test_a_16_token_answer_is_16_body_writes_role_with_the_first_and_done_with_the_last() -> None:
    bodies, orch = _stream_bodies([(i % 26, None) for i in range(15)] + [(15, "length")])
    assert len(bodies) == 16 and [more for _, more in bodies] == [True] * 15 + [False]
    first, last = _split(bodies[0][0]), _split(bodies[-1][0])
    assert [json.loads(e.removeprefix("data: "))["choices"][0]["delta"] for e in first] == [
        {"role": "assistant", "content": ""},
        {"content": "a"},
    ]
    assert last[-1] == "data: [DONE]"
    final = json.loads(last[0].removeprefix("data: "))["choices"][0]
    assert final == {"index": 0, "delta": {"content": "p"}, "finish_reason": "length"}
    text = "".join(
        json.loads(e.removeprefix("data: "))["choices"][0]["delta"]["content"]
        for body, _ in bodies
        for e in _split(body)
        if e != "data: [DONE]"
    )
    assert text == "abcdefghijklmnop" and orch.forgotten == ["r1"]


def test_an_error_mid_stream_is_its_last_event_before_done_in_the_bodys_last_write() -> None:
    bodies, orch = _stream_bodies([(0, None), (1, None), (2, None), (3, "stop")], fail_after=1)
    assert [more for _, more in bodies] == [True, True, False]
    error, done = _split(bodies[-1][0])
    assert json.loads(error.removeprefix("data: "))["error"]["code"] == "internal_error"
    assert done == "data: [DONE]" and orch.forgotten == ["r1"]
