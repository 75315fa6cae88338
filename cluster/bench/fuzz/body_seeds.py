"""Seeds of the HTTP body targets (chat completions with tools, completions, responses): small valid and
near-valid request bodies (``cluster/bench/fuzz/seeds.py`` writes them all)."""

from __future__ import annotations

import base64
import json
from collections.abc import Mapping

from cluster.bench.fuzz.media_seeds import _png, _soundfile


def _body(**fields: object) -> bytes:
    return json.dumps({"model": "m", **fields}).encode()


def chat_body_seeds() -> dict[str, bytes]:
    png = base64.b64encode(_png(4, 4)).decode()
    wav = base64.b64encode(_soundfile("WAV", "PCM_16", 8000, 0.01)).decode()
    user = {"role": "user", "content": "hi"}
    media = {
        "role": "user",
        "content": [
            {"type": "text", "text": "what is this?"},
            {"type": "image_url", "image_url": {"url": f"data:image/png;base64,{png}", "detail": "low"}},
            {"type": "image_url", "uuid": "cached-1"},
            {"type": "input_audio", "input_audio": {"data": wav, "format": "wav"}},
        ],
    }
    return {
        "text.json": _body(messages=[user]),
        "sampling.json": _body(
            messages=[
                {"role": "developer", "content": "be brief"},
                user,
                {"role": "assistant", "content": None},
            ],
            max_tokens=8,
            temperature=0.7,
            top_p=0.9,
            top_k=40,
            seed=-3,
            stop=["\n\n", "END"],
            logprobs=True,
            top_logprobs=2,
            stream=True,
            stream_options={"include_usage": True},
            cache_salt="s",
        ),
        "media.json": _body(messages=[media], max_completion_tokens=4),
        "video_url.json": _body(
            messages=[
                {"role": "user", "content": [{"type": "video_url", "video_url": {"url": "https://x/v.mp4"}}]}
            ]
        ),
        "bad_base64_audio.json": _body(
            messages=[
                {
                    "role": "user",
                    "content": [{"type": "input_audio", "input_audio": {"data": "@@", "format": "mp3"}}],
                }
            ]
        ),
        "penalty.json": _body(messages=[user], presence_penalty=0.5, logit_bias={"1": 2}),
        "nested.json": b'{"model":"m","messages":[{"role":"user","content":"x"}],"user":'
        + b"[" * 64
        + b"]" * 64
        + b"}",
        "many_values.json": _body(messages=[user], stop=[","] * 600),
        "escapes.json": b'{"model":"m","messages":[{"role":"user","content":"\\ud800\\u0000\\"\\\\"}],"seed":1e400}',
        "trailing_comma.json": b'{"model":"m","messages":[{"role":"user","content":"hi"},]}',
        "json_schema.json": _body(
            messages=[user],
            response_format={
                "type": "json_schema",
                "json_schema": {
                    "name": "point",
                    "strict": True,
                    "schema": {
                        "type": "object",
                        "properties": {"x": {"type": "integer", "minimum": 0}, "tag": {"enum": ["a", "b"]}},
                        "required": ["x"],
                        "additionalProperties": False,
                    },
                },
            },
        ),
        "json_object.json": _body(messages=[user], response_format={"type": "json_object"}),
        "regex.json": _body(messages=[user], structured_outputs={"regex": "[a-z]{2,5}(-[0-9]+)?"}),
        "choice.json": _body(messages=[user], structured_outputs={"choice": ["yes", "no"]}),
        "grammar.json": _body(messages=[user], structured_outputs={"grammar": 'root ::= "a" | "b" root'}),
        "json_string.json": _body(messages=[user], structured_outputs={"json": '{"type": "string"}'}),
        **tool_seeds(user, png),
    }


def tool_seeds(user: Mapping[str, object], png: str) -> dict[str, bytes]:
    """Tools in the prompt (docs/tools.md): the agent loop's step with a screenshot in the tool's answer,
    and a named ``tool_choice`` over a nested schema."""
    tools = [
        {
            "type": "function",
            "function": {
                "name": "click",
                "description": "click",
                "parameters": {
                    "type": "object",
                    "properties": {
                        "at": {"type": "array", "items": {"type": "integer"}},
                        "mode": {"enum": ["l", "r"]},
                    },
                    "required": ["at"],
                    "anyOf": [{"required": ["mode"]}, True],
                },
                "strict": True,
            },
        },
        {"type": "function", "function": {"name": "screenshot"}},
    ]
    call = {"id": "c1", "type": "function", "function": {"name": "click", "arguments": '{"at": [1, 2]}'}}
    shot = {"type": "image_url", "image_url": {"url": f"data:image/png;base64,{png}"}}
    loop = [
        {"role": "user", "content": [{"type": "text", "text": "go"}, shot]},
        {"role": "assistant", "content": None, "tool_calls": [call]},
        {"role": "tool", "tool_call_id": "c1", "content": [{"type": "text", "text": "now"}, shot]},
    ]
    return {
        "tools_agent_loop.json": _body(
            messages=loop, tools=tools, tool_choice="auto", parallel_tool_calls=False
        ),
        "tools_named_choice.json": _body(
            messages=[user], tools=tools, tool_choice={"type": "function", "function": {"name": "click"}}
        ),
    }


def completions_body_seeds() -> dict[str, bytes]:
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}
    return {
        "string.json": _body(prompt="Once upon a time", max_tokens=8),
        "strings.json": _body(prompt=["a", "bb", "ccc"], max_tokens=4, n=2),
        "ids.json": _body(prompt=[1, 2, 3, 1023], max_tokens=4),
        "id_lists.json": _body(prompt=[[1, 2], [3, 4, 5]], echo=True, logprobs=2),
        "echo_logprobs.json": _body(prompt="x", echo=True, logprobs=5, max_tokens=1),
        "sampling.json": _body(
            prompt="p",
            temperature=0.7,
            top_p=0.9,
            top_k=5,
            min_p=0.1,
            presence_penalty=0.5,
            frequency_penalty=-0.5,
            repetition_penalty=1.2,
            logit_bias={"5": 10, "7": -100},
            seed=3,
            stop=["\n", "."],
            stream=True,
            stream_options={"include_usage": True},
            min_tokens=2,
            stop_token_ids=[4],
        ),
        "json_schema.json": _body(
            prompt="json:",
            response_format={"type": "json_schema", "json_schema": {"name": "r", "schema": schema}},
        ),
        "regex.json": _body(prompt="r", structured_outputs={"regex": "[a-z]{1,4}"}),
        "suffix.json": _body(prompt="a", suffix="b"),
        "unknown_field.json": _body(prompt="a", best_of=2),
        "bad_ids.json": _body(prompt=[-1, 99999]),
        "cache_salt.json": _body(prompt="a", cache_salt="s1", user="u"),
    }


def responses_body_seeds() -> dict[str, bytes]:
    png = "data:image/png;base64," + base64.b64encode(_png(4, 4)).decode()
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}
    tool = {
        "type": "function",
        "name": "click",
        "parameters": {"type": "object", "properties": {"x": {"type": "integer"}}},
    }
    return {
        "text.json": _body(input="Describe a cat.", max_output_tokens=16),
        "instructions.json": _body(input="hi", instructions="Answer briefly.", temperature=0.5, top_p=0.9),
        "items.json": _body(
            input=[
                {
                    "role": "user",
                    "content": [
                        {"type": "input_text", "text": "What is this?"},
                        {"type": "input_image", "image_url": png},
                    ],
                },
                {"role": "assistant", "content": [{"type": "output_text", "text": "A square."}]},
                {"role": "user", "content": "And now?"},
            ]
        ),
        "json_schema.json": _body(
            input="json",
            text={"format": {"type": "json_schema", "name": "r", "schema": schema, "strict": True}},
        ),
        "json_object.json": _body(input="json", text={"format": {"type": "json_object"}}),
        "tools.json": _body(
            input="click it", tools=[tool], tool_choice="required", parallel_tool_calls=False
        ),
        "function_output.json": _body(
            input=[
                {"role": "user", "content": "click"},
                {"type": "function_call", "call_id": "c1", "name": "click", "arguments": '{"x": 1}'},
                {
                    "type": "function_call_output",
                    "call_id": "c1",
                    "output": [{"type": "input_image", "image_url": png}],
                },
            ],
            tools=[tool],
        ),
        "stream.json": _body(input="hi", stream=True, metadata={"k": "v"}, user="u"),
        "previous_response_id.json": _body(input="hi", previous_response_id="resp_1"),
        "file_id.json": _body(input=[{"role": "user", "content": [{"type": "input_image", "file_id": "f"}]}]),
        "hosted_tool.json": _body(input="hi", tools=[{"type": "web_search"}]),
        "unknown_field.json": _body(input="hi", best_of=2),
    }
