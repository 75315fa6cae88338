"""OpenAI's legacy completions wire format (``/v1/completions``): a text prompt, no chat template.

``prompt`` is a string, a list of strings, a list of token ids or a list of such lists; each prompt of
a list is its own request, and its choices come in prompt order (``index = prompt_index * n + i``).
``echo`` puts the prompt's text before each choice's; ``logprobs`` (0-20) is the completions API's
shape, ``{tokens, token_logprobs, top_logprobs, text_offset}``, covering the prompt's tokens too when
echoed (the first prompt token has none). Text only: no media on this endpoint.
"""

from __future__ import annotations

import time
import uuid
from typing import Literal

from pydantic import BaseModel, Field, field_validator, model_validator

from router.protocol.chat_output import Usage
from router.protocol.openai import SamplingFields

MAX_PROMPTS = 128  # prompts in one request's list
MAX_CHOICES = 128  # prompts x n: each one a sequence in the engine
MAX_COMPLETION_LOGPROBS = 20  # vLLM's bound (OpenAI's is 5)

Prompt = str | list[int]  # one prompt: text, or token ids


class CompletionRequest(SamplingFields):
    prompt: str | list[str] | list[int] | list[list[int]]
    echo: bool = False
    logprobs: int | None = Field(None, ge=0, le=MAX_COMPLETION_LOGPROBS)
    # OpenAI's fill-in-the-middle text after the completion: refused by name (CompletionService)
    suffix: str | None = None

    @field_validator("prompt")
    @classmethod
    def _bounded_prompt(
        cls, v: str | list[str] | list[int] | list[list[int]]
    ) -> str | list[str] | list[int] | list[list[int]]:
        prompts = _as_list(v)
        if not prompts:
            raise ValueError("give at least one prompt")
        if len(prompts) > MAX_PROMPTS:
            raise ValueError(f"at most {MAX_PROMPTS} prompts in one request, got {len(prompts)}")
        for i, p in enumerate(prompts):
            if len(p) == 0:
                raise ValueError(f"prompt {i} is empty")
            if isinstance(p, list) and any(t < 0 for t in p):
                raise ValueError(f"prompt {i}: token ids are non-negative")
        return v

    @model_validator(mode="after")
    def _bounded_choices(self) -> CompletionRequest:
        if len(self.prompts) * self.n > MAX_CHOICES:
            raise ValueError(
                f"{len(self.prompts)} prompts x n={self.n} is more than {MAX_CHOICES} choices in one request"
            )
        return self

    @property
    def prompts(self) -> list[Prompt]:
        return _as_list(self.prompt)

    @property
    def sampled_logprobs(self) -> int | None:
        return self.logprobs


def _as_list(v: str | list[str] | list[int] | list[list[int]]) -> list[Prompt]:
    """The prompts in order: a string or a flat list of ids is one prompt."""
    if isinstance(v, str):
        return [v]
    if v and all(isinstance(t, int) for t in v):
        return [list(v)]  # type: ignore[arg-type]
    return list(v)  # type: ignore[arg-type]


def completion_id() -> str:
    return f"cmpl-{uuid.uuid4().hex}"


class CompletionLogprobs(BaseModel):
    """Per token of the text: the token, its logprob (None for a prompt's first), its top
    alternatives (token -> logprob) and where it starts in the choice's text."""

    tokens: list[str] = Field(default_factory=list)
    token_logprobs: list[float | None] = Field(default_factory=list)
    top_logprobs: list[dict[str, float] | None] = Field(default_factory=list)
    text_offset: list[int] = Field(default_factory=list)


class CompletionChoice(BaseModel):
    index: int = 0
    text: str
    logprobs: CompletionLogprobs | None = None
    finish_reason: str | None = None


class CompletionResponse(BaseModel):
    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    choices: list[CompletionChoice]
    usage: Usage


class CompletionChunk(BaseModel):
    """A streamed piece: OpenAI's completions stream uses the same ``text_completion`` object."""

    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    choices: list[CompletionChoice]
    usage: Usage | None = None
