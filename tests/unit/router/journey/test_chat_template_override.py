"""A model's ``chat_template`` override (config, ``mmserve serve --chat-template``) on both sides that
render a prompt: the ingress's tokenizer (``chat_tokenizer``, text-only chats) and an encoder replica's
processor (``Preprocessor(chat_template=)``, chats with media). With the shipped tool templates
(cluster/data/, docs/tools.md) the four families whose checkpoints have no tool section take tools:
both sides give the same ids for the same chat, each equal to HF's ``apply_chat_template(chat_template=...,
tools=...)``; without the override they still refuse tools by name."""

from __future__ import annotations

import base64
import io
import json
from pathlib import Path
from typing import Any, cast

import pytest
from pydantic import ValidationError

from cluster.config import ModelConfig
from cluster.tiny_model.released_templates import TOOL_TEMPLATES, tool_template_path
from encoder_service.preprocess.errors import ToolsUnsupported
from encoder_service.preprocess.media import MediaLimits
from encoder_service.preprocess.processing import Preprocessor
from router.journey.orchestrator import Orchestrator, chat_tokenizer
from router.protocol.messages import MessageLimits, NormalizedChat, normalize_messages
from router.protocol.openai import ChatCompletionRequest
from router.protocol.tool_use import template_tools
from tests.media import make_audio_array, make_audio_bytes, make_image_bytes
from tests.tiny_dirs import tiny_model_dir

LIMITS = MessageLimits(64, 256, 1 << 20, {"image": 4, "video": 1, "audio": 2})
TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "The weather in a city",
            "parameters": {
                "type": "object",
                "properties": {"city": {"type": "string"}},
                "required": ["city"],
            },
        },
    }
]
CALL = {"id": "c1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Oslo"}'}}
HF_CALL = {**CALL, "function": {"name": "get_weather", "arguments": {"city": "Oslo"}}}
# what each template writes for the tools and for the call in history
MARKS = {
    "qwen2-vl": ("<tools>", '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo"}}'),
    "qwen2.5-vl": ("<tools>", '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo"}}'),
    "qwen2-audio": ("<tools>", '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo"}}'),
    "gemma3": ("Tools (functions) are available.", '[get_weather(city="Oslo")]'),
}
FAMILIES = list(TOOL_TEMPLATES)


def _normalized(messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None) -> NormalizedChat:
    req = ChatCompletionRequest.model_validate({"model": "m", "messages": messages, "tools": tools})
    return normalize_messages(req.messages, LIMITS, None, template_tools(req.tools, req.tool_choice))


def _template(family: str) -> str:
    """The override as the config holds it: the shipped file's text, read and checked."""
    m = ModelConfig(name=f"tiny-{family}", tiny=family, chat_template=str(tool_template_path(family)))
    assert m.chat_template is not None
    return m.chat_template


def _media_part(family: str, seed: int) -> tuple[dict[str, Any], dict[str, Any], str, Any]:
    """(the OpenAI part, HF's part, the HF processor's keyword, the decoded media)."""
    from PIL import Image

    if family == "qwen2-audio":
        wav = base64.b64encode(make_audio_bytes(1.0, seed=seed)).decode()
        part = {"type": "input_audio", "input_audio": {"data": wav, "format": "wav"}}
        return part, {"type": "audio"}, "audio", make_audio_array(1.0, seed=seed)
    png = make_image_bytes(64, 48, seed=seed)
    url = f"data:image/png;base64,{base64.b64encode(png).decode()}"
    image = Image.open(io.BytesIO(png)).convert("RGB")
    return {"type": "image_url", "image_url": {"url": url}}, {"type": "image"}, "images", image


@pytest.mark.parametrize("family", FAMILIES)
def test_both_sides_render_the_override_as_hf(family: str) -> None:
    from transformers import AutoProcessor, AutoTokenizer

    model_dir = str(tiny_model_dir(family))
    template = _template(family)
    orch = Orchestrator(cast(Any, None), chat_tokenizer(model_dir, template), block_size=4)
    pre = Preprocessor(
        model_dir, MediaLimits(), {"image": 4, "audio": 2}, 64 * 1024 * 1024, chat_template=template
    )
    assert orch.template_takes_tools
    history: list[dict[str, Any]] = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Weather in Oslo?"},
        {"role": "assistant", "content": "", "tool_calls": [CALL]},
        {"role": "tool", "tool_call_id": "c1", "content": "sunny"},
    ]
    chat = _normalized(history, TOOLS)
    ids = orch._tokenize_sync(chat)
    assert pre.preprocess_sync(chat.messages).prompt_token_ids == ids  # the two sides agree
    tok = AutoTokenizer.from_pretrained(model_dir)  # its own template: the override given per call
    hf_history = [*history[:2], {**history[2], "tool_calls": [HF_CALL]}, history[3]]
    expected = tok.apply_chat_template(
        hf_history, tools=TOOLS, chat_template=template, add_generation_prompt=True, tokenize=True
    )
    assert ids == list(expected["input_ids"] if hasattr(expected, "keys") else expected)
    text = tok.decode(ids)
    assert all(mark in text for mark in MARKS[family]), text

    # with media (the encoder's side): a user's item and, where the template renders it, a tool's
    part, hf_part, key, media = _media_part(family, seed=5)
    tool_part, hf_tool_part, _, tool_media = _media_part(family, seed=6)
    messages: list[dict[str, Any]] = [
        {"role": "user", "content": [{"type": "text", "text": "Look."}, part]},
        {"role": "assistant", "content": "", "tool_calls": [CALL]},
        {"role": "tool", "tool_call_id": "c1", "content": [{"type": "text", "text": "now"}, tool_part]},
    ]
    out = pre.preprocess_sync(_normalized(messages, TOOLS).messages)
    proc = AutoProcessor.from_pretrained(model_dir)
    hf_messages = [
        {"role": "user", "content": [{"type": "text", "text": "Look."}, hf_part]},
        {"role": "assistant", "content": "", "tool_calls": [HF_CALL]},
        {"role": "tool", "tool_call_id": "c1", "content": [{"type": "text", "text": "now"}, hf_tool_part]},
    ]
    text = proc.apply_chat_template(
        hf_messages, tools=TOOLS, chat_template=template, add_generation_prompt=True
    )
    media_kw: dict[str, Any] = {key: [media, tool_media]}
    if key == "audio":
        media_kw["sampling_rate"] = 16000
    ref = proc(text=[text], return_tensors="pt", **media_kw)
    assert out.prompt_token_ids == ref["input_ids"][0].tolist()
    assert len(out.items) == 2 and len({it.mm_hash for it in out.items}) == 2
    marker = {"qwen2-audio": "<|AUDIO|>", "gemma3": "<start_of_image>"}.get(family, "<|image_pad|>")
    assert marker in text.split("<tool_response>")[1]  # the tool's media inside its result


@pytest.mark.parametrize("family", FAMILIES)
def test_without_the_override_tools_are_refused_by_name(family: str) -> None:
    model_dir = str(tiny_model_dir(family))
    orch = Orchestrator(cast(Any, None), chat_tokenizer(model_dir), block_size=4)
    assert not orch.template_takes_tools
    pre = Preprocessor(model_dir, MediaLimits(), {"image": 4, "audio": 2}, 64 * 1024 * 1024)
    part = _media_part(family, seed=7)[0]
    chat = _normalized([{"role": "user", "content": [part]}], TOOLS)
    with pytest.raises(ToolsUnsupported):
        pre.preprocess_sync(chat.messages)


def test_the_setting_is_read_and_checked_at_startup(tmp_path: Path) -> None:
    """vLLM's semantics: an existing file's text, else the template text; a missing file or a jinja
    syntax error is a config error naming the model and the setting."""
    good = tmp_path / "t.jinja"
    good.write_text("{% for m in messages %}{{ m.content }}{% endfor %}")
    assert ModelConfig(name="a", tiny="gemma3", chat_template=str(good)).chat_template == good.read_text()
    inline = "{{ messages[0].content }}"
    assert ModelConfig(name="a", tiny="gemma3", chat_template=inline).chat_template == inline
    again = ModelConfig.model_validate(
        json.loads(ModelConfig(name="a", tiny="gemma3", chat_template=str(good)).model_dump_json())
    )
    assert again.chat_template == good.read_text()  # a replica re-validating the text keeps it
    bad = tmp_path / "bad.jinja"
    bad.write_text("{% for m in messages %}\n{{ m.content }}\n")
    for value, says in (
        (str(tmp_path / "missing.jinja"), "looks like a path, but no such file"),
        (str(bad), "jinja syntax error on line 2"),
        ("{% if %}", "(inline text): jinja syntax error on line 1"),
    ):
        with pytest.raises(ValidationError) as e:
            ModelConfig(name="tiny-gemma3", tiny="gemma3", chat_template=value)
        (err,) = e.value.errors()
        assert err["loc"] == ("chat_template",)
        assert "model 'tiny-gemma3': chat_template" in err["msg"] and says in err["msg"], err["msg"]
    with pytest.raises(ValidationError, match="unknown tool_call_parser 'json'; known: hermes"):
        ModelConfig(name="a", tiny="gemma3", tool_call_parser="json")


def test_mmserve_serve_flags_set_every_model(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """``--chat-template`` (a path or the text) and ``--tool-call-parser``, as ``vllm serve`` takes them;
    a bad template stops ``mmserve serve`` before Ray starts, with the model and the setting."""
    import argparse

    from cluster.serve_cli import _cmd_serve, add_serve_command, config_from_args

    def args(*argv: str) -> argparse.Namespace:
        parser = argparse.ArgumentParser()
        add_serve_command(parser.add_subparsers())
        return parser.parse_args(["serve", *argv])

    path = str(tool_template_path("gemma3"))
    cfg = config_from_args(args("--chat-template", path, "--tool-call-parser", "pythonic"))
    assert len(cfg.models) == 2  # the default app: both tiny models
    for m in cfg.models:
        assert m.chat_template == Path(path).read_text(encoding="utf-8") and m.tool_call_parser == "pythonic"
    assert _cmd_serve(args("--model", str(tmp_path), "--chat-template", str(tmp_path / "nope.jinja"))) == 2
    err = capsys.readouterr().err
    assert f"model '{tmp_path.name}': chat_template" in err and "no such file" in err, err
