"""``/v1/responses`` with the ``openai`` client (``client.responses.create``, ``.stream``, ``.parse``):
text, instructions, images by loopback URL and data URL (greedy answers equal transformers' and the
chat route's on the same messages), the stream's event sequence, ``max_output_tokens`` as an
incomplete response, ``text.format`` through the structured outputs, each refused field a 400
naming it, and a client that leaves mid-stream stopping the generation."""

from __future__ import annotations

import base64
import io
import json
import uuid
from typing import Any

import httpx
import pytest
from openai import BadRequestError, OpenAI
from PIL import Image
from pydantic import BaseModel, Field

from tests.integration.e2e.app_readings import (
    GENERATED,
    LONG,
    llm_stats,
    metric,
    nothing_held,
    tokens_generated_since,
)
from tests.integration.e2e.common import AUDIO, MAX_TOKENS, PORT, VL, data_url, hf_generate, wait_for
from tests.media import make_audio_bytes, make_image_bytes

pytestmark = pytest.mark.usefixtures("app")  # the package's one app (conftest.py)
URL = f"http://127.0.0.1:{PORT}/v1/responses"

STREAM_ORDER = [
    "response.created",
    "response.in_progress",
    "response.output_item.added",
    "response.content_part.added",
]
STREAM_END = [
    "response.output_text.done",
    "response.content_part.done",
    "response.output_item.done",
]


def _text() -> str:
    return f"{uuid.uuid4().hex[:8]} tell me about the weather"  # never seen before


def _chat_answer(client: OpenAI, messages: list[dict[str, Any]]) -> str:
    r = client.chat.completions.create(model=VL, messages=messages, max_tokens=MAX_TOKENS, temperature=0)  # type: ignore[arg-type]
    return str(r.choices[0].message.content)


def test_text_input_is_hfs_greedy_answer(client: OpenAI, app: dict[str, Any]) -> None:
    text = _text()
    r = client.responses.create(model=VL, input=text, max_output_tokens=MAX_TOKENS, temperature=0)
    assert r.object == "response" and r.id.startswith("resp_") and r.model == VL
    assert r.output_text == hf_generate(app["dirs"][VL], [{"role": "user", "content": text}])
    assert [o.type for o in r.output] == ["message"] and r.output[0].role == "assistant"
    assert r.output[0].id.startswith("msg_") and r.output[0].content[0].type == "output_text"
    assert r.usage is not None and r.usage.output_tokens <= MAX_TOKENS
    assert r.usage.total_tokens == r.usage.input_tokens + r.usage.output_tokens
    assert r.usage.input_tokens_details.cached_tokens >= 0
    assert (r.status == "incomplete") == (r.incomplete_details is not None)
    assert r.status == "completed" or r.usage.output_tokens == MAX_TOKENS
    assert r.store is False and r.previous_response_id is None


def test_instructions_and_message_items_are_the_chat_routes_answer(
    client: OpenAI, app: dict[str, Any]
) -> None:
    text = _text()
    r = client.responses.create(
        model=VL,
        instructions="Answer in one word.",
        input=[
            {"role": "user", "content": "Hello."},
            {"role": "assistant", "content": [{"type": "output_text", "text": "Hi!", "annotations": []}]},
            {"type": "message", "role": "user", "content": [{"type": "input_text", "text": text}]},
        ],
        max_output_tokens=MAX_TOKENS,
        temperature=0,
    )
    messages = [
        {"role": "system", "content": "Answer in one word."},
        {"role": "user", "content": "Hello."},
        {"role": "assistant", "content": "Hi!"},
        {"role": "user", "content": text},
    ]
    assert r.output_text == hf_generate(app["dirs"][VL], messages)
    assert r.output_text == _chat_answer(client, messages)
    assert r.instructions == "Answer in one word."


@pytest.mark.parametrize("by", ["url", "data_url"])
def test_input_image_is_hfs_and_the_chat_routes_answer(
    client: OpenAI, app: dict[str, Any], media_server: str, by: str
) -> None:
    png = make_image_bytes(96, 64, seed=5)  # the media server's /cat.png
    url = f"{media_server}/cat.png" if by == "url" else data_url(png, "image/png")
    text = _text()
    r = client.responses.create(
        model=VL,
        input=[
            {
                "role": "user",
                "content": [
                    {"type": "input_image", "image_url": url, "detail": "auto"},
                    {"type": "input_text", "text": text},
                ],
            }
        ],
        max_output_tokens=MAX_TOKENS,
        temperature=0,
    )
    expected = hf_generate(
        app["dirs"][VL],
        [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": text}]}],
        images=[Image.open(io.BytesIO(png)).convert("RGB")],
    )
    assert r.output_text == expected
    chat = [
        {
            "role": "user",
            "content": [{"type": "image_url", "image_url": {"url": url}}, {"type": "text", "text": text}],
        }
    ]
    assert _chat_answer(client, chat) == expected
    assert r.usage is not None and r.usage.input_tokens > 16  # the image's tokens are in the prompt


def test_the_stream_is_the_sdks_event_sequence_and_ends_as_the_whole_answer(client: OpenAI) -> None:
    ask: dict[str, Any] = {"model": VL, "input": _text(), "max_output_tokens": 12, "temperature": 0}
    whole = client.responses.create(**ask)
    with client.responses.stream(**ask) as stream:
        events = list(stream)
    # The SDK's get_final_response() wants response.completed; an incomplete one ends the stream too.
    final = events[-1].response  # type: ignore[union-attr]
    kinds = [e.type for e in events]
    assert kinds[:4] == STREAM_ORDER
    assert kinds[-4:-1] == STREAM_END and kinds[-1] == f"response.{whole.status}"
    assert set(kinds[4:-4]) == {"response.output_text.delta"}
    assert [e.sequence_number for e in events] == list(range(len(events)))
    deltas = "".join(e.delta for e in events if e.type == "response.output_text.delta")  # type: ignore[union-attr]
    assert deltas == whole.output_text == final.output_text
    assert final.id == events[0].response.id  # type: ignore[union-attr]
    assert final.status == whole.status and final.usage is not None and whole.usage is not None
    assert final.usage.output_tokens == whole.usage.output_tokens
    assert final.usage.input_tokens == whole.usage.input_tokens


def test_max_output_tokens_makes_an_incomplete_response(client: OpenAI) -> None:
    ask: dict[str, Any] = {
        "model": VL,
        "input": _text(),
        "max_output_tokens": 3,
        "temperature": 0,
        "extra_body": {"ignore_eos": True},
    }
    r = client.responses.create(**ask)
    assert r.status == "incomplete" and r.incomplete_details is not None
    assert r.incomplete_details.reason == "max_output_tokens"
    assert r.usage is not None and r.usage.output_tokens == 3
    with client.responses.stream(**ask) as stream:
        events = list(stream)
    final = events[-1].response  # type: ignore[union-attr]
    assert events[-1].type == "response.incomplete" and final.status == "incomplete"
    assert final.incomplete_details is not None and final.incomplete_details.reason == "max_output_tokens"
    assert final.output_text == r.output_text


class Verdict(BaseModel):
    answer: str = Field(json_schema_extra={"enum": ["yes", "no"]})
    score: int = Field(ge=0, le=9)


@pytest.mark.parametrize("stream", [False, True])
def test_text_format_json_schema_validates(client: OpenAI, stream: bool) -> None:
    ask: dict[str, Any] = {"model": VL, "input": _text(), "max_output_tokens": 64, "temperature": 0}
    if stream:
        with client.responses.stream(text_format=Verdict, **ask) as s:
            final = s.get_final_response()
    else:
        final = client.responses.parse(text_format=Verdict, **ask)
    assert final.status == "completed", final.output_text
    verdict = Verdict.model_validate_json(final.output_text)
    assert verdict.answer in ("yes", "no") and 0 <= verdict.score <= 9
    assert final.output_parsed == verdict


def test_text_format_json_object_is_an_object(client: OpenAI) -> None:
    r = client.responses.create(
        model=VL,
        input=_text(),
        max_output_tokens=64,
        temperature=0,
        text={"format": {"type": "json_object"}},
    )
    if r.status == "completed":
        assert isinstance(json.loads(r.output_text), dict)
    else:  # cut by max_output_tokens inside the object: a prefix of one
        assert r.output_text.lstrip().startswith("{")


IMAGE = {"type": "input_image", "image_url": data_url(make_image_bytes(32, 32, seed=3), "image/png")}


@pytest.mark.parametrize(
    "body,param",
    [
        ({"previous_response_id": "resp_123"}, "previous_response_id"),
        ({"store": True}, "store"),
        ({"background": True}, "background"),
        ({"conversation": "conv_123"}, "conversation"),
        ({"tools": [{"type": "web_search"}]}, "tools[0].type"),
        ({"tools": [{"type": "file_search", "vector_store_ids": ["vs_1"]}]}, "tools[0].type"),
        ({"include": ["message.output_text.logprobs"]}, "include"),
        ({"truncation": "auto"}, "truncation"),
        ({"max_tokens": 4}, "max_tokens"),
        ({"n": 2}, "n"),
        ({"reasoning": {"effort": "low"}}, "reasoning"),
        ({"frobnicate": 1}, "frobnicate"),
        ({"max_output_tokens": 10**6}, "max_output_tokens"),
        ({"temperature": 3}, "temperature"),
        ({"text": {"format": {"type": "json_schema", "name": "x"}}}, "text.format"),
        (
            {"text": {"format": {"type": "json_schema", "name": "x", "schema": {"type": "nope"}}}},
            "text.format",
        ),
        ({"input": []}, "input"),
        ({"input": [{"type": "reasoning", "summary": []}]}, "input.0"),
        ({"input": [{"role": "tool", "content": "x"}]}, "input.0.role"),
        (
            {"input": [{"role": "user", "content": [{"type": "input_file", "file_id": "f"}]}]},
            "input.0.content.0",
        ),
        (
            {"input": [{"role": "user", "content": [{**IMAGE, "file_id": "file-1"}]}]},
            "input[0].content[0].file_id",
        ),
        (
            {"input": [{"role": "user", "content": [{"type": "input_image"}]}]},
            "input[0].content[0].image_url",
        ),
        ({"input": [{"role": "user", "content": [{**IMAGE, "detail": "max"}]}]}, "input.0.content.0.detail"),
        ({"input": [{"role": "assistant", "content": [IMAGE]}]}, "input[0].content[0]"),
    ],
)
def test_refusals_are_400s_naming_the_field(body: dict[str, Any], param: str | None) -> None:
    r = httpx.post(URL, json={"model": VL, "input": "hi", **body}, timeout=60)
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == param, r.text


def test_the_openai_client_sees_a_bad_request(client: OpenAI) -> None:
    with pytest.raises(BadRequestError) as e:
        client.responses.create(model=VL, input="hi", previous_response_id="resp_123")
    assert "previous_response_id" in str(e.value) and "stateless" in str(e.value)


def test_input_audio_on_a_model_that_hears_is_hfs_answer(client: OpenAI, app: dict[str, Any]) -> None:
    import librosa

    wav = make_audio_bytes(seconds=1.5, sr=22050, seed=7)
    audio = {"type": "input_audio", "input_audio": {"data": base64.b64encode(wav).decode(), "format": "wav"}}
    r = client.responses.create(
        model=AUDIO,
        input=[{"role": "user", "content": [audio, {"type": "input_text", "text": "What is it?"}]}],
        max_output_tokens=MAX_TOKENS,
        temperature=0,
    )
    samples, _ = librosa.load(io.BytesIO(wav), sr=16000)
    expected = hf_generate(
        app["dirs"][AUDIO],
        [{"role": "user", "content": [{"type": "audio"}, {"type": "text", "text": "What is it?"}]}],
        audio=[samples],
        sampling_rate=16000,
    )
    assert r.output_text == expected


def test_audio_on_a_model_that_does_not_hear_is_a_400(client: OpenAI) -> None:
    audio = {"type": "input_audio", "input_audio": {"data": "UklGRg==", "format": "wav"}}
    r = httpx.post(URL, json={"model": VL, "input": [{"role": "user", "content": [audio]}]}, timeout=60)
    assert r.status_code == 400 and r.json()["error"]["code"] == "unsupported_modality", r.text


def test_a_client_that_leaves_mid_stream_stops_the_generation(client: OpenAI, app: dict[str, Any]) -> None:
    before = metric(app, GENERATED, VL)
    seen = 0
    with client.responses.stream(
        model=VL,
        input=[
            {
                "role": "user",
                "content": [
                    {
                        "type": "input_image",
                        "image_url": data_url(make_image_bytes(70, 84, seed=615), "image/png"),
                    },
                    {"type": "input_text", "text": "Go on forever."},
                ],
            }
        ],
        max_output_tokens=LONG,
        temperature=0,
        extra_body={"ignore_eos": True},
    ) as stream:
        for event in stream:
            seen += event.type == "response.output_text.delta"
            if seen == 4:
                break
        mid = llm_stats()
        assert mid["num_running"] == 1  # still generating
    # leaving the block closed the HTTP connection mid-stream
    wait_for(nothing_held, 20.0, "the LLM replica to drop the abandoned stream and the reservations to go")
    generated = tokens_generated_since(client, app, before, seen)
    assert generated < LONG // 4, generated
