"""A request's tools against the served model's chat template (``router.http.chat.tools_for``): a
template that never reads ``tools`` is a 400 naming ``tools``, not a silent drop. Which of the tiny
families' templates read them: Qwen3-VL's released one only."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any, cast

import pytest

from cluster.tiny_model.families import TINY_RECIPES
from mmcore.chat_template import template_takes_tools
from router.http.chat import ServedModel, tools_for
from router.protocol.errors import APIError
from router.protocol.openai import ChatCompletionRequest

TOOL = {"type": "function", "function": {"name": "click", "parameters": {"type": "object"}}}


def _model(takes_tools: bool) -> ServedModel:
    orch = SimpleNamespace(template_takes_tools=takes_tools)
    return ServedModel("m", cast(Any, orch), cast(Any, None), 4096, ["image"])


def _req(**extra: Any) -> ChatCompletionRequest:
    return ChatCompletionRequest.model_validate(
        {"model": "m", "messages": [{"role": "user", "content": "hi"}], **extra}
    )


def test_tools_for_a_template_without_them_name_tools() -> None:
    with pytest.raises(APIError) as e:
        tools_for(_req(tools=[TOOL]), _model(False))
    assert (e.value.status_code, e.value.param, e.value.code) == (400, "tools", "tools_unsupported")
    assert tools_for(_req(), _model(False)) is None  # no tools: nothing to refuse
    assert tools_for(_req(tools=[TOOL], tool_choice="auto"), _model(True)) == [TOOL]


def test_checks_run_before_the_template_question() -> None:
    with pytest.raises(APIError) as e:
        tools_for(_req(tools=[TOOL, TOOL]), _model(True))
    assert e.value.param == "tools" and "repeats" in e.value.message


def test_the_tiny_templates_that_read_tools_are_the_released_ones_that_do() -> None:
    takes = {name: template_takes_tools(recipe.chat_template) for name, recipe in TINY_RECIPES.items()}
    assert takes == {name: name in ("qwen3-vl", "qwen3.5", "gemma4") for name in TINY_RECIPES}
