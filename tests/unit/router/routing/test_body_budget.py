"""router/routing/admission.py's body budget through router/http/chat.py: request bodies are bounded in
bytes before they are read (a ``Content-Length`` is reserved up front; without one, bytes as they
arrive), and every request gives its bytes back when it ends, however it ends."""

from __future__ import annotations

import asyncio
import json
from types import SimpleNamespace
from typing import Any

import pytest
from starlette.requests import Request

from llm_service.outputs import RequestOutput
from mmcore.feature import MODALITIES
from router.http.chat import ChatService, ServedModel
from router.protocol.errors import APIError, from_exception
from router.protocol.messages import MessageLimits
from router.routing.admission import AdmissionController, AdmissionLimits, BodyLease, Overloaded

MiB = 1 << 20
LIMITS = MessageLimits(max_messages=8, max_content_parts=8, max_media_bytes=MiB, limit_mm_per_prompt={})


class _Body:
    """An ASGI ``receive`` that sends ``chunks``, then blocks (``hold``: a client still sending) or
    ends; ``reads`` counts the chunks it was asked for."""

    def __init__(self, chunks: list[bytes], *, hold: bool = False, disconnect: bool = False) -> None:
        self.chunks = list(chunks)
        self.hold = hold
        self.disconnect = disconnect
        self.reads = 0

    async def __call__(self) -> dict[str, Any]:
        if self.chunks:
            self.reads += 1
            chunk = self.chunks.pop(0)
            return {"type": "http.request", "body": chunk, "more_body": bool(self.chunks) or self.hold}
        if self.disconnect:
            return {"type": "http.disconnect"}
        await asyncio.Event().wait()  # the client sends nothing more, and stays
        raise AssertionError("unreachable")


def _request(body: _Body, content_length: int | None) -> Request:
    headers = [] if content_length is None else [(b"content-length", str(content_length).encode())]
    scope = {"type": "http", "method": "POST", "path": "/v1/chat/completions", "headers": headers}
    return Request(scope, body)


def test_past_the_byte_budget_a_declared_body_is_refused_with_a_503_before_it_is_read() -> None:
    """The issue's case: parallel 60 MiB POSTs. Four fill the default 256 MiB budget; the fifth gets a
    503 at once, its body unread, instead of a fifth 60 MiB buffer."""

    async def run() -> None:
        service = ChatService({}, max_request_bytes=64 * MiB)  # the default admission limits
        bodies = [_Body([], hold=True) for _ in range(5)]  # clients that take their time sending
        tasks = [asyncio.ensure_future(service.chat(_request(b, 60 * MiB))) for b in bodies]
        done, pending = await asyncio.wait(tasks, timeout=10, return_when=asyncio.FIRST_COMPLETED)
        assert len(done) == 1 and len(pending) == 4
        refused = done.pop()
        api = from_exception(refused.exception())  # type: ignore[arg-type]
        assert api is not None and api.status_code == 503 and api.code == "overloaded"
        assert api.headers() == {"Retry-After": "1"}
        assert bodies[tasks.index(refused)].reads == 0  # refused before its first byte was read
        assert service.admission.body_bytes_in_flight == 4 * 60 * MiB
        for t in pending:  # the clients leave mid-body: their bytes come back
            t.cancel()
        await asyncio.gather(*pending, return_exceptions=True)
        assert service.admission.body_bytes_in_flight == 0

    asyncio.run(run())


def test_a_body_without_content_length_is_counted_as_it_arrives_and_refused_past_the_budget() -> None:
    async def run() -> None:
        admission = AdmissionController(AdmissionLimits(max_body_bytes_in_flight=MiB))
        service = ChatService({}, max_request_bytes=64 * MiB, admission=admission)
        first = asyncio.ensure_future(service.chat(_request(_Body([b"x" * (MiB // 2)], hold=True), None)))
        await asyncio.sleep(0)
        while admission.body_bytes_in_flight == 0:
            await asyncio.sleep(0.01)
        assert admission.body_bytes_in_flight == MiB // 2  # what arrived, not a declared length
        chunked = _Body([b"y" * (MiB // 4)] * 4, hold=True)  # 1 MiB in all: past what is left
        with pytest.raises(Overloaded):
            await service.chat(_request(chunked, None))
        assert chunked.reads == 3  # refused with the chunk that went past the budget, not at the end
        assert admission.body_bytes_in_flight == MiB // 2  # the refused one's bytes came back
        first.cancel()
        await asyncio.gather(first, return_exceptions=True)
        assert admission.body_bytes_in_flight == 0

    asyncio.run(run())


def test_a_body_larger_than_the_whole_budget_is_let_in_alone() -> None:
    ctl = AdmissionController(AdmissionLimits(max_body_bytes_in_flight=MiB))
    big, small = BodyLease(), BodyLease()
    ctl.reserve_body(big, 3 * MiB)  # nothing else in flight: a valid request is never refused forever
    with pytest.raises(Overloaded):
        ctl.reserve_body(small, 1)
    assert small.reserved == 0
    ticket = ctl.admit(1, body=big)
    ctl.release(ticket)
    ctl.release(ticket)  # twice is once
    assert ctl.body_bytes_in_flight == 0 and ctl.in_flight == 0
    ctl.close()
    with pytest.raises(Overloaded) as e:  # draining: refused before the body is read too
        ctl.reserve_body(BodyLease(), 10)
    assert e.value.code == "shutting_down"


class _Orchestrator:
    """Prepares anything into a 3-token prompt and answers one finished token (or fails to prepare)."""

    tool_result_modalities = MODALITIES  # the chat route reads it (media allowed in tool results)
    template_variables: frozenset[str] = frozenset()  # the chat route checks chat_template_kwargs against it

    def __init__(self, fail: bool = False) -> None:
        self.fail = fail

    async def prepare(self, request_id: str, chat: Any, overlap: bool = True) -> Any:
        if self.fail:
            raise RuntimeError("the encoder pool broke")
        return SimpleNamespace(prompt_token_ids=[1, 2, 3])

    async def stream(self, request_id: str, prepared: Any, params: Any, salt: Any) -> Any:
        yield RequestOutput(request_id, [0], None, True, "stop", 3, 0)

    async def settle(self, request_id: str) -> None:
        return None

    def forget(self, request_id: str) -> None:
        return None

    def decode(self, ids: Any) -> str:
        return "a" * len(ids)

    def replay(self, request_id: str) -> None:
        return None


def _chat_body(model: str = "tiny", stream: bool = False) -> bytes:
    return json.dumps(
        {"model": model, "stream": stream, "messages": [{"role": "user", "content": "hi"}]}
    ).encode()


@pytest.mark.parametrize(
    ("case", "body", "fail"),
    [
        ("answered", _chat_body(), False),
        ("streamed", _chat_body(stream=True), False),
        ("not JSON", b"{nope", False),
        ("unknown model", _chat_body("other"), False),
        ("past max_request_bytes", b"z" * (2 * MiB), False),
        ("failed while prepared", _chat_body(), True),
    ],
)
def test_every_request_gives_its_body_bytes_back_when_it_ends(case: str, body: bytes, fail: bool) -> None:
    async def run() -> None:
        admission = AdmissionController(AdmissionLimits(max_body_bytes_in_flight=4 * MiB))
        model = ServedModel("tiny", _Orchestrator(fail), LIMITS, 4096, [])  # type: ignore[arg-type]
        service = ChatService({"tiny": model}, max_request_bytes=MiB, admission=admission)
        try:
            response = await service.chat(_request(_Body([body], disconnect=True), len(body)))
        except (APIError, RuntimeError):
            assert case not in ("answered", "streamed")
        else:
            assert case in ("answered", "streamed")
            if case == "streamed":  # held while the body streams, back when it ends
                assert admission.body_bytes_in_flight == len(body)
                async for _ in response.body_iterator:  # type: ignore[attr-defined]
                    pass
        assert admission.body_bytes_in_flight == 0 and admission.in_flight == 0

    asyncio.run(run())
