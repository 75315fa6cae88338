"""The Responses request (router/protocol/responses.py): input items as chat messages named by their
request path, text.format as a structured-output spec naming ``text.format``, and the fields a
stateless server refuses, each named."""

from __future__ import annotations

from typing import Any

import pytest
from pydantic import ValidationError

from router.protocol.errors import APIError
from router.protocol.messages import MessageLimits, normalize_messages
from router.protocol.openai import ImagePart, TextPart
from router.protocol.response_input import chat_messages, in_responses_terms
from router.protocol.responses import ResponsesRequest
from router.protocol.sampling import request_sampling_params
from router.protocol.tools import NamedToolChoice

LIMITS = MessageLimits(
    max_messages=8, max_content_parts=8, max_media_bytes=1 << 20, limit_mm_per_prompt={"image": 1}
)
PNG = "data:image/png;base64,iVBORw0KGgo="


def _req(**body: Any) -> ResponsesRequest:
    return ResponsesRequest.model_validate({"model": "m", "input": "hi", **body})


def test_a_string_input_with_instructions_is_a_system_then_a_user_message() -> None:
    messages, paths = chat_messages(_req(instructions="Be brief."))
    assert [(m.role, m.content) for m in messages] == [("system", "Be brief."), ("user", "hi")]
    assert paths == ["instructions", "input"]


def test_items_map_part_by_part_onto_chat_parts() -> None:
    req = _req(
        input=[
            {"role": "developer", "content": "rules"},
            {"role": "user", "content": [{"type": "input_image", "image_url": PNG, "detail": "low"}]},
            {
                "type": "message",
                "role": "assistant",
                "content": [{"type": "output_text", "text": "ok", "annotations": []}],
            },
            {"role": "user", "content": [{"type": "input_text", "text": "and?"}]},
        ]
    )
    messages, paths = chat_messages(req)
    assert paths == ["input[0]", "input[1]", "input[2]", "input[3]"]
    assert [m.role for m in messages] == ["developer", "user", "assistant", "user"]
    image = messages[1].content[0]  # type: ignore[index]
    assert isinstance(image, ImagePart) and image.image_url is not None
    assert (image.image_url.url, image.image_url.detail) == (PNG, "low")
    assert messages[2].content == [TextPart(type="text", text="ok")]
    chat = normalize_messages(messages, LIMITS, field="input", paths=paths)
    assert [m.modality for m in chat.media] == ["image"]


def test_media_outside_a_user_item_is_named_by_its_input_path() -> None:
    req = _req(input=[{"role": "assistant", "content": [{"type": "input_image", "image_url": PNG}]}])
    messages, paths = chat_messages(req)
    with pytest.raises(APIError) as e:
        normalize_messages(messages, LIMITS, field="input", paths=paths)
    assert e.value.param == "input[0].content[0]"


def test_a_file_id_is_refused_by_name() -> None:
    req = _req(input=[{"role": "user", "content": [{"type": "input_image", "file_id": "file-1"}]}])
    with pytest.raises(APIError) as e:
        chat_messages(req)
    assert e.value.status_code == 400 and e.value.param == "input[0].content[0].file_id"


@pytest.mark.parametrize(
    "body,param",
    [
        ({"previous_response_id": "resp_1"}, "previous_response_id"),
        ({"store": True}, "store"),
        ({"background": True}, "background"),
        ({"conversation": {"id": "conv_1"}}, "conversation"),
        ({"include": ["reasoning.encrypted_content"]}, "include"),
        ({"truncation": "auto"}, "truncation"),
        ({"tools": [{"type": "function", "name": "f"}, {"type": "code_interpreter"}]}, "tools[1].type"),
        ({"max_tokens": 3}, "max_tokens"),
        ({"n": 1}, "n"),
    ],
)
def test_what_a_stateless_server_cannot_do_is_refused_by_name(body: dict[str, Any], param: str) -> None:
    refused = _req(**body).refusal()
    assert refused is not None and refused[0] == param


@pytest.mark.parametrize("body", [{"store": False}, {"background": False}, {"truncation": "disabled"}, {}])
def test_their_harmless_values_pass(body: dict[str, Any]) -> None:
    assert _req(**body).refusal() is None


def test_text_format_is_a_structured_spec_naming_text_format() -> None:
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}}
    req = _req(text={"format": {"type": "json_schema", "name": "x", "schema": schema, "strict": True}})
    spec = request_sampling_params(req).structured
    assert spec is not None and (spec.kind, spec.field) == ("json", "text.format")
    obj = request_sampling_params(_req(text={"format": {"type": "json_object"}})).structured
    assert obj is not None and obj.kind == "json_object"
    assert request_sampling_params(_req(text={"format": {"type": "text"}})).structured is None
    assert request_sampling_params(_req(max_output_tokens=5)).max_tokens == 5


@pytest.mark.parametrize(
    "body,loc",
    [
        ({"input": [{"type": "reasoning", "summary": []}]}, ("input", "|list", 0)),
        ({"input": []}, ("input", "|list")),
        ({"text": {"format": {"type": "json_schema", "name": "x"}}}, ("text", "format")),
        (
            {"input": [{"role": "user", "content": [{"type": "input_file", "file_id": "f"}]}]},
            ("input", "|list", 0, "|message", "content", "|list", 0),
        ),
    ],
)
def test_bad_items_fail_at_the_item(body: dict[str, Any], loc: tuple[Any, ...]) -> None:
    """The first error is about the item (read_body leaves the ``|`` union tags out of the path)."""
    with pytest.raises(ValidationError) as e:
        _req(**body)
    assert e.value.errors()[0]["loc"] == loc


def test_calls_join_the_assistant_message_and_outputs_are_tool_messages() -> None:
    req = _req(
        input=[
            {"role": "user", "content": "weather?"},
            {"role": "assistant", "content": "Let me look."},
            {"type": "function_call", "call_id": "c1", "name": "f", "arguments": "{}"},
            {"type": "function_call", "call_id": "c2", "name": "g", "arguments": '{"a": 1}'},
            {
                "type": "function_call_output",
                "call_id": "c1",
                "output": [
                    {"type": "input_text", "text": "shot:"},
                    {"type": "input_image", "image_url": PNG},
                ],
            },
            {"type": "function_call_output", "call_id": "c2", "output": "done"},
        ]
    )
    messages, paths = chat_messages(req)
    assert [m.role for m in messages] == ["user", "assistant", "tool", "tool"]
    assert paths == ["input[0]", "input[1]", "input[4]", "input[5]"]
    assert messages[1].content == "Let me look."
    assert [(c.id, c.function.name) for c in messages[1].tool_calls or []] == [("c1", "f"), ("c2", "g")]
    assert [m.tool_call_id for m in messages[2:]] == ["c1", "c2"]
    chat = normalize_messages(messages, LIMITS, field="input", paths=paths)
    assert [m.modality for m in chat.media] == ["image"]  # the tool output's image is an item
    assert chat.messages[1]["tool_calls"][1]["function"]["arguments"] == {"a": 1}


def test_an_output_answering_no_call_is_named_in_responses_terms() -> None:
    req = _req(input=[{"type": "function_call_output", "call_id": "c9", "output": "x"}])
    messages, paths = chat_messages(req)
    with pytest.raises(APIError) as e:
        normalize_messages(messages, LIMITS, field="input", paths=paths)
    named = in_responses_terms(e.value)
    assert named.param == "input[0].call_id" and "input[0].call_id" in named.message


def test_an_image_in_an_output_the_template_would_drop_is_named_in_responses_terms() -> None:
    """A template that renders only the text of a tool result (Gemma 4's): the output's image is a
    400 naming ``input[i].output[j]``, the Responses request's own path."""
    req = _req(
        input=[
            {"role": "user", "content": "go"},
            {"type": "function_call", "call_id": "c1", "name": "f", "arguments": "{}"},
            {
                "type": "function_call_output",
                "call_id": "c1",
                "output": [
                    {"type": "input_text", "text": "shot:"},
                    {"type": "input_image", "image_url": PNG},
                ],
            },
        ]
    )
    messages, paths = chat_messages(req)
    with pytest.raises(APIError) as e:
        normalize_messages(messages, LIMITS, field="input", paths=paths, tool_media=frozenset())
    named = in_responses_terms(e.value)
    assert (named.status_code, named.param) == (400, "input[2].output[1]"), named.message
    chat = normalize_messages(messages, LIMITS, field="input", paths=paths, tool_media=frozenset({"image"}))
    assert [m.modality for m in chat.media] == ["image"]


def test_flat_function_tools_and_their_choice_become_chats() -> None:
    req = _req(
        tools=[{"type": "function", "name": "f", "parameters": {"type": "object"}, "strict": True}],
        tool_choice={"type": "function", "name": "f"},
        parallel_tool_calls=False,
    )
    ask = req.tool_ask()
    assert ask.tools is not None and ask.tools[0].function.name == "f" and ask.tools[0].function.strict
    assert isinstance(ask.tool_choice, NamedToolChoice) and ask.tool_choice.function.name == "f"
    assert ask.parallel_tool_calls is False
    for bad in ({"type": "web_search_preview"}, {"type": "allowed_tools", "tools": []}, "sometimes"):
        with pytest.raises(APIError) as e:
            _req(tool_choice=bad).tool_ask()
        assert e.value.param == "tool_choice"
    with pytest.raises(APIError) as e:
        _req(tools=[{"type": "function", "name": "f", "parameterz": {}}]).tool_ask()
    assert e.value.param == "tools[0].parameterz"
