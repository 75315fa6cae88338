"""A response's output items and stream events (router/http/response_events.py), read back by the
``openai`` SDK's own stream accumulator: text, calls after text, two calls, an incomplete answer;
the events numbered in order, and the streamed answer equal to the one built without events."""

from __future__ import annotations

import json
from typing import Any

import pytest
from openai import omit
from openai._models import construct_type
from openai.lib.streaming.responses._responses import ResponseStreamState
from openai.types.responses import ResponseStreamEvent

from llm_service.tools.calls import ArgumentsDelta, CallStart, ContentDelta, ToolEvent
from router.http.response_events import OutputItems
from router.protocol.errors import APIError
from router.protocol.response_object import ResponseObject

TEXT = [ContentDelta("Hello"), ContentDelta(", world")]
CALL_AFTER_TEXT = [
    ContentDelta("Let me look."),
    CallStart(0, "call_a", "get_weather"),
    ArgumentsDelta(0, '{"city": '),
    ArgumentsDelta(0, '"Paris"}'),
]
TWO_CALLS = [
    CallStart(0, "call_a", "f"),
    ArgumentsDelta(0, "{}"),
    CallStart(1, "call_b", "g"),
    ArgumentsDelta(1, '{"x": 1}'),
]


def _events(body: str) -> list[dict[str, Any]]:
    out = []
    for block in body.strip().split("\n\n"):
        kind, data = block.split("\n")
        event = json.loads(data.removeprefix("data: "))
        assert kind == f"event: {event['type']}"
        out.append(event)
    return out


def _stream(
    events: list[ToolEvent], status: str = "completed"
) -> tuple[list[dict[str, Any]], ResponseObject]:
    shell = ResponseObject(id="resp_1", status="in_progress", model="m")
    items = OutputItems()
    body = items.started(shell) + "".join(items.feed([e]) for e in events)
    final, tail = items.finished(shell.model_copy(update={"status": status}))
    return _events(body + tail), final


def _fields(item: Any) -> tuple[Any, ...]:
    """What an output item says, the SDK's object or ours alike."""
    if item.type == "message":
        return (item.type, item.id, item.status, [(p.type, p.text) for p in item.content])
    return (item.type, item.id, item.status, item.call_id, item.name, item.arguments)


def _sdk_final(events: list[dict[str, Any]]) -> Any:
    """What the SDK's ``client.responses.stream`` accumulates from the events."""
    state: ResponseStreamState[Any] = ResponseStreamState(input_tools=omit, text_format=omit)
    for raw in events:
        state.handle_event(construct_type(type_=ResponseStreamEvent, value=raw))  # type: ignore[arg-type]
    return state._completed_response


@pytest.mark.parametrize(
    "events", [TEXT, CALL_AFTER_TEXT, TWO_CALLS, []], ids=["text", "call", "two", "empty"]
)
def test_the_sdk_accumulates_the_same_answer(events: list[ToolEvent]) -> None:
    rendered, final = _stream(events)
    assert [e["sequence_number"] for e in rendered] == list(range(len(rendered)))
    assert rendered[0]["type"] == "response.created" and rendered[-1]["type"] == "response.completed"
    sdk = _sdk_final(rendered)
    assert sdk is not None
    assert [_fields(o) for o in sdk.output] == [_fields(o) for o in final.output]
    quiet = OutputItems(render=False)
    assert quiet.feed(events) == ""
    built, _ = quiet.finished(ResponseObject(id="resp_1", status="completed", model="m"))
    assert [_fields(o)[3:] for o in built.output] == [_fields(o)[3:] for o in final.output]


def test_text_then_a_call_are_two_items_in_order() -> None:
    rendered, final = _stream(CALL_AFTER_TEXT)
    message, call = final.output
    assert message.type == "message" and message.content[0].text == "Let me look."  # type: ignore[union-attr]
    assert call.type == "function_call" and (call.call_id, call.name) == ("call_a", "get_weather")  # type: ignore[union-attr]
    assert call.arguments == '{"city": "Paris"}' and call.status == "completed"  # type: ignore[union-attr]
    kinds = [e["type"] for e in rendered]
    assert kinds.index("response.output_text.done") < kinds.index("response.function_call_arguments.delta")
    done = [e for e in rendered if e["type"] == "response.function_call_arguments.done"]
    assert [(d["output_index"], d["arguments"]) for d in done] == [(1, '{"city": "Paris"}')]
    deltas = [e["delta"] for e in rendered if e["type"] == "response.function_call_arguments.delta"]
    assert "".join(deltas) == call.arguments  # type: ignore[union-attr]


def test_an_empty_answer_is_one_empty_message() -> None:
    _, final = _stream([])
    assert [o.type for o in final.output] == ["message"] and final.output[0].content[0].text == ""  # type: ignore[union-attr]


def test_an_incomplete_answer_ends_with_response_incomplete() -> None:
    rendered, final = _stream(TEXT, status="incomplete")
    assert rendered[-1]["type"] == "response.incomplete" and final.output[0].status == "incomplete"
    assert _sdk_final(rendered) is None  # the SDK's get_final_response() wants response.completed


def test_a_failure_is_an_error_event_then_response_failed() -> None:
    shell = ResponseObject(id="resp_1", status="in_progress", model="m")
    items = OutputItems()
    body = (
        items.started(shell)
        + items.feed(TEXT)
        + items.failed(shell, APIError(503, "gone", code="overloaded"))
    )
    kinds = [e["type"] for e in _events(body)]
    assert kinds[-2:] == ["error", "response.failed"]


def test_a_finished_response_validates_as_the_sdks_response() -> None:
    """The whole object as the SDK's own pydantic model reads it, strictly (``Response.model_validate``:
    every field the SDK requires, usage's details included), not only its lenient stream builder."""
    from openai.types.responses import Response

    from router.protocol.response_object import InputTokensDetails, ResponseUsage

    _, final = _stream(CALL_AFTER_TEXT)
    usage = ResponseUsage(
        input_tokens=12,
        input_tokens_details=InputTokensDetails(cached_tokens=8),
        output_tokens=5,
        total_tokens=17,
    )
    body = json.loads(final.model_copy(update={"usage": usage}).model_dump_json())
    sdk = Response.model_validate(body)
    assert sdk.usage is not None and sdk.usage.input_tokens_details.cached_tokens == 8
    assert [i.type for i in sdk.output] == ["message", "function_call"]
