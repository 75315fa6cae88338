"""The chat route with a reasoning parser on (router/http/reasoning_answer.py): an answer of
``reasoning</think>content<tool_call>...`` token by token through ``ChatService``'s streamed and
non-streamed paths. Streamed: ``delta.reasoning`` events, then ``delta.content`` and ``tool_calls``,
never a piece of ``</think>`` as text, and the same fields as the non-streamed message; a grammar with
thinking on is a 400 naming both fields."""

from __future__ import annotations

import asyncio
import json
from typing import Any

import pytest

from llm_service.outputs import RequestOutput
from llm_service.sampling_params import SamplingParams
from llm_service.structured.spec import StructuredSpec
from router.http.chat import ChatService, ServedModel
from router.http.reasoning_answer import Thinking
from router.http.sse import SSEResponse
from router.journey.detokenizer import IncrementalDetokenizer
from router.protocol.errors import APIError
from router.protocol.messages import MessageLimits, normalize_messages
from router.protocol.openai import ChatCompletionRequest
from router.protocol.tool_choice import answer_format

LIMITS = MessageLimits(64, 256, 1 << 20, {"image": 4, "video": 1, "audio": 1})
# the answer, one piece per token: the end marker itself arrives in three tokens
PIECES = ["Two", " plus", " two.\n", "</", "thi", "nk>", "\n\nFour", ".", "<tool_call>", "\n<function=add>\n"]
PIECES += ["<parameter=a>\n2\n</parameter>\n", "</function>\n</tool_call>"]
TOOLS = [{"type": "function", "function": {"name": "add", "parameters": {"type": "object"}}}]


class _Orchestrator:
    tokenizer = None

    async def settle(self, request_id: str) -> None:
        return None

    def forget(self, request_id: str) -> None:
        return None

    def decode(self, ids: Any) -> str:
        return "".join(PIECES[i] for i in ids)

    def replay(self, request_id: str) -> None:
        return None


def _run(stream: bool, kwargs: dict[str, Any] | None = None) -> Any:
    orch = _Orchestrator()
    model = ServedModel("m", orch, LIMITS, 4096, [], "qwen3_xml", "qwen3")  # type: ignore[arg-type]
    service = ChatService({"m": model}, max_request_bytes=1 << 16)
    body = {"model": "m", "stream": stream, "messages": [{"role": "user", "content": "2+2?"}], "tools": TOOLS}
    req = ChatCompletionRequest.model_validate({**body, "chat_template_kwargs": kwargs})
    chat = normalize_messages(req.messages, LIMITS, template_kwargs=kwargs)
    thinking = Thinking.of("qwen3", chat.template_kwargs)
    outs = [
        RequestOutput("r", [i], None, i == len(PIECES) - 1, "stop" if i == len(PIECES) - 1 else None, 3, 0)
        for i in range(len(PIECES))
    ]

    async def rest() -> Any:
        for out in outs[1:]:
            yield out

    async def go() -> Any:
        detok = IncrementalDetokenizer(orch.decode)
        if not stream:
            resp = await service._collect(req, model, "r", outs[0], rest(), detok, (0.0, 0.0), thinking)
            return json.loads(resp.body)["choices"][0]
        gen = service._sse(req, model, "r", outs[0], rest(), detok, (0.0, 0.0), chat, thinking)
        sent: list[bytes] = []

        async def send(m: Any) -> None:
            if m["type"] == "http.response.body":
                sent.append(m["body"])

        await SSEResponse(gen, media_type="text/event-stream").stream_response(send)
        events = [e.removeprefix("data: ") for e in b"".join(sent).decode().split("\n\n") if e]
        return [json.loads(e)["choices"][0] for e in events if e != "[DONE]"]

    assert answer_format(req, "qwen3_xml") is not None
    return asyncio.run(go())


def test_non_streamed_message_splits_reasoning_content_and_calls() -> None:
    choice = _run(stream=False)
    message = choice["message"]
    assert message["reasoning"] == "Two plus two.\n"
    assert message["content"] == "\n\nFour."
    (call,) = message["tool_calls"]
    assert call["function"] == {"name": "add", "arguments": '{"a": 2}'}
    assert choice["finish_reason"] == "tool_calls"


def test_streamed_deltas_carry_the_same_fields_and_no_marker_text() -> None:
    choices = _run(stream=True)
    deltas = [c["delta"] for c in choices]
    reasoning = "".join(d.get("reasoning", "") for d in deltas)
    content = "".join(d.get("content") or "" for d in deltas)
    args = "".join(tc["function"].get("arguments", "") for d in deltas for tc in d.get("tool_calls", []))
    assert (reasoning, content, json.loads(args)) == ("Two plus two.\n", "\n\nFour.", {"a": 2})
    assert not any("</" in (d.get("reasoning", "") + (d.get("content") or "")) for d in deltas)
    first_content = next(i for i, d in enumerate(deltas) if d.get("content"))
    assert all("reasoning" not in d for d in deltas[first_content:])  # reasoning first, then content
    assert choices[-1]["finish_reason"] == "tool_calls"


def test_thinking_off_leaves_the_answer_in_content() -> None:
    message = _run(stream=False, kwargs={"enable_thinking": False})["message"]
    assert message["reasoning"] is None and message["content"].startswith("Two plus two.\n</think>")


@pytest.mark.parametrize(("kwargs", "refused"), [(None, True), ({"enable_thinking": False}, False)])
def test_a_grammar_while_thinking_is_refused_naming_both_fields(
    kwargs: dict[str, Any] | None, refused: bool
) -> None:
    params = SamplingParams(structured=StructuredSpec("regex", "[0-9]+", "structured_outputs"))
    thinking = Thinking.of("qwen3", kwargs or {})
    assert thinking is not None
    if not refused:
        thinking.check_grammar(params)
        return
    with pytest.raises(APIError) as e:
        thinking.check_grammar(params)
    assert e.value.param == "structured_outputs" and "chat_template_kwargs" in e.value.message
    assert e.value.status_code == 400


def test_responses_output_items_a_reasoning_item_then_message_and_call_and_reasoning_tokens() -> None:
    """/v1/responses: a ``reasoning`` item (the SDK's ``ResponseReasoningItem``) before the message and the
    call, its text streamed as ``response.reasoning_text.delta``; ``reasoning_tokens`` counts the tokens
    inside the reasoning (5: those of the cut end marker's first two pieces included, its last not)."""
    from openai.types.responses import ResponseFunctionToolCall, ResponseOutputMessage, ResponseReasoningItem

    from router.http.response_events import OutputItems
    from router.http.responses import TextOut, _ended
    from router.protocol.response_object import ResponseObject
    from router.protocol.tool_choice import answer_format

    req = ChatCompletionRequest.model_validate(
        {"model": "m", "messages": [{"role": "user", "content": "2+2?"}], "tools": TOOLS}
    )
    text = TextOut(
        IncrementalDetokenizer(_Orchestrator().decode),
        answer_format(req, "qwen3_xml"),
        Thinking.of("qwen3", {}),
    )
    items = OutputItems()
    shell = ResponseObject(id="resp_1", status="in_progress", model="m")
    events = items.started(shell)
    for i in range(len(PIECES)):
        last = i == len(PIECES) - 1
        events += items.feed(text.add(RequestOutput("r", [i], None, last, "stop" if last else None, 3, 0)))
    final, tail = items.finished(_ended(shell, text))
    events += tail
    kinds = [line.removeprefix("event: ") for line in events.splitlines() if line.startswith("event: ")]
    assert kinds[2:4] == ["response.output_item.added", "response.reasoning_text.delta"]
    assert "response.reasoning_text.done" in kinds and "response.output_text.delta" in kinds
    deltas = [
        json.loads(line.removeprefix("data: "))
        for line in events.splitlines()
        if line.startswith('data: {"type":"response.reasoning_text.delta"')
    ]
    assert "".join(d["delta"] for d in deltas) == "Two plus two.\n"
    out = final.model_dump()["output"]  # each item as the SDK's types read it
    reasoning = ResponseReasoningItem.model_validate(out[0])
    message = ResponseOutputMessage.model_validate(out[1])
    call = ResponseFunctionToolCall.model_validate(out[2])
    assert reasoning.content is not None and reasoning.summary == []
    assert reasoning.content[0].text == "Two plus two.\n" and reasoning.status == "completed"
    assert message.content[0].text == "\n\nFour."  # type: ignore[union-attr]
    assert json.loads(call.arguments) == {"a": 2} and len(out) == 3
    assert final.usage is not None and final.usage.output_tokens == len(PIECES)
    assert final.usage.output_tokens_details.reasoning_tokens == 5
