"""OpenAI chat-completions wire format: the request and the error body (the output models are in
``chat_output``); the sampling fields every generation endpoint shares (``SamplingFields``)."""

from __future__ import annotations

from typing import Annotated, Any, ClassVar, Literal, TypedDict

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from router.protocol.template_kwargs import check_template_kwargs
from router.protocol.tools import (
    MAX_ID_CHARS,
    MAX_TOOL_CALLS,
    MAX_TOOLS,
    NamedToolChoice,
    ToolCall,
    ToolChoice,
    ToolDefinition,
)

MAX_TOKENS_LIMIT = (1 << 31) - 1  # beyond any max_model_len; the real bound is the prompt's room
MAX_STOP_STRINGS = 4
MAX_STOP_CHARS = 256
MAX_N = 16  # choices per request (each one a sequence in the engine)
# OpenAI request fields that change nothing this server computes: accepted and ignored (README).
# Any other field the server does not implement is a 400 naming it ("Unrecognized request argument").
IGNORED_FIELDS = ("user", "metadata", "store", "service_tier")


class _Part(BaseModel):
    model_config = ConfigDict(extra="forbid")


class TextPart(_Part):
    type: Literal["text"]
    text: str


class ImageURL(_Part):
    url: str | None = None
    detail: Literal["auto", "low", "high"] | None = None


class ImagePart(_Part):
    type: Literal["image_url"]
    image_url: ImageURL | None = None
    uuid: str | None = Field(None, max_length=256)


class VideoURL(_Part):
    url: str | None = None


class VideoPart(_Part):
    type: Literal["video_url"]
    video_url: VideoURL | None = None
    uuid: str | None = Field(None, max_length=256)


class InputAudio(_Part):
    data: str | None = None
    format: str | None = Field(None, max_length=16)


class InputAudioPart(_Part):
    type: Literal["input_audio"]
    input_audio: InputAudio | None = None
    uuid: str | None = Field(None, max_length=256)


class AudioURL(_Part):
    url: str | None = None


class AudioURLPart(_Part):
    type: Literal["audio_url"]
    audio_url: AudioURL | None = None
    uuid: str | None = Field(None, max_length=256)


ContentPart = Annotated[
    TextPart | ImagePart | VideoPart | InputAudioPart | AudioURLPart, Field(discriminator="type")
]


class ChatMessage(_Part):
    """One message of a chat. An assistant message may carry the ``tool_calls`` it made (its content
    then may be null); a ``tool`` message answers one of them (``tool_call_id``), its content a string
    or parts, media included. router/protocol/messages.py checks how they fit together."""

    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[ContentPart] | None = None
    name: str | None = None
    tool_calls: list[ToolCall] | None = Field(None, max_length=MAX_TOOL_CALLS)
    tool_call_id: str | None = Field(None, max_length=MAX_ID_CHARS)


class StreamOptions(_Part):
    include_usage: bool = False
    continuous_usage_stats: bool = False  # vLLM's: usage on every chunk (accepted; usage comes at the end)


class JSONSchemaFormat(_Part):
    name: str = Field(..., min_length=1, max_length=64, pattern=r"^[a-zA-Z0-9_-]+$")
    description: str | None = None
    schema_: dict[str, Any] | None = Field(None, alias="schema")
    strict: bool | None = None


class ResponseFormat(_Part):
    """OpenAI's ``response_format``: free text, any JSON object, or JSON matching a schema."""

    type: Literal["text", "json_object", "json_schema"]
    json_schema: JSONSchemaFormat | None = None

    @model_validator(mode="after")
    def _schema_iff_json_schema(self) -> ResponseFormat:
        if (self.type == "json_schema") != (self.json_schema is not None):
            raise ValueError("json_schema is required with type 'json_schema' (and only then)")
        return self


class StructuredOutputs(_Part):
    """vLLM's ``structured_outputs``: exactly one constraint."""

    json_: dict[str, Any] | bool | str | None = Field(None, alias="json")
    regex: str | None = None
    choice: list[str] | None = Field(None, min_length=1)
    grammar: str | None = None
    json_object: bool | None = None

    @model_validator(mode="after")
    def _exactly_one(self) -> StructuredOutputs:
        given = [k for k in ("json_", "regex", "choice", "grammar") if getattr(self, k) is not None]
        given += ["json_object"] if self.json_object else []
        if len(given) != 1:
            raise ValueError("give exactly one of json, regex, choice, grammar, json_object")
        return self


class SamplingFields(BaseModel):
    """What every generation request takes beyond its prompt: the sampling surface, structured
    outputs, stop conditions, streaming and the cache salt (``/v1/chat/completions`` and
    ``/v1/completions`` alike; router/protocol/sampling.py maps it to ``SamplingParams``)."""

    model_config = ConfigDict(extra="forbid", populate_by_name=True)
    format_field: ClassVar[str] = "response_format"  # the field ``format_request`` comes from

    model: str
    # Sampling fields are bounded here, each error naming its field (a 400 with ``param``); the
    # engine re-checks (SamplingParams.validate) and treats temperature < 1e-5 as greedy.
    max_tokens: int | None = Field(None, ge=1, le=MAX_TOKENS_LIMIT)
    temperature: float | None = Field(None, ge=0.0, le=2.0, allow_inf_nan=False)
    top_p: float | None = Field(None, gt=0.0, le=1.0, allow_inf_nan=False)
    top_k: int | None = Field(None, ge=-1, le=1 << 31)
    seed: int | None = Field(None, ge=-(1 << 63), lt=1 << 63)
    presence_penalty: float | None = Field(None, ge=-2.0, le=2.0, allow_inf_nan=False)
    frequency_penalty: float | None = Field(None, ge=-2.0, le=2.0, allow_inf_nan=False)
    # OpenAI's: token ids as strings, biases in [-100, 100], at most 300 entries
    logit_bias: dict[str, float] | None = Field(None, max_length=300)
    # vLLM's extensions
    repetition_penalty: float | None = Field(None, gt=0.0, le=2.0, allow_inf_nan=False)
    min_p: float | None = Field(None, ge=0.0, le=1.0, allow_inf_nan=False)
    min_tokens: int = Field(0, ge=0, le=MAX_TOKENS_LIMIT)
    stop_token_ids: list[int] | None = Field(None, max_length=64)
    structured_outputs: StructuredOutputs | None = None
    stop: str | list[str] | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    n: int = Field(1, ge=1, le=MAX_N)
    ignore_eos: bool = False  # extension, as in vLLM: generate exactly max_tokens
    user: str | None = Field(None, max_length=512)
    # vLLM's extension: the prefix cache shares blocks only among requests with the same salt (it
    # enters the first block's hash); with API keys the tenant always enters it too (router/auth.py).
    cache_salt: str | None = Field(None, min_length=1, max_length=1024)

    @field_validator("logit_bias")
    @classmethod
    def _bounded_bias(cls, v: dict[str, float] | None) -> dict[str, float] | None:
        for token, bias in (v or {}).items():
            if not token.isdigit() or len(token) > 9:
                raise ValueError(f"key {token!r} is not a token id (a non-negative integer as a string)")
            if not -100.0 <= bias <= 100.0:
                raise ValueError(f"bias {bias} for token {token} is outside [-100, 100]")
        return v

    @field_validator("stop_token_ids")
    @classmethod
    def _non_negative_ids(cls, v: list[int] | None) -> list[int] | None:
        if v and any(t < 0 for t in v):
            raise ValueError("token ids are non-negative")
        return v

    @field_validator("stop")
    @classmethod
    def _bounded_stop(cls, v: str | list[str] | None) -> str | list[str] | None:
        stops = [v] if isinstance(v, str) else (v or [])
        if len(stops) > MAX_STOP_STRINGS or any(not s or len(s) > MAX_STOP_CHARS for s in stops):
            raise ValueError(
                f"at most {MAX_STOP_STRINGS} non-empty strings of at most {MAX_STOP_CHARS} characters"
            )
        return v

    @model_validator(mode="after")
    def _min_tokens_fit(self) -> SamplingFields:
        asked = self.requested_max_tokens
        if asked is not None and self.min_tokens > asked:
            raise ValueError(f"min_tokens={self.min_tokens} is more than max_tokens={asked}")
        return self

    @property
    def stop_strings(self) -> list[str]:
        return [self.stop] if isinstance(self.stop, str) else list(self.stop or [])

    @property
    def requested_max_tokens(self) -> int | None:
        return self.max_tokens

    @property
    def sampled_logprobs(self) -> int | None:
        """Logprobs per sampled token: None none, 0 the token's own, k the top-k beside it."""
        return None

    @property
    def format_request(self) -> ResponseFormat | None:
        """OpenAI's ``response_format``, where the endpoint has one."""
        return None


class ChatCompletionRequest(SamplingFields):
    messages: list[ChatMessage] = Field(..., min_length=1)
    max_completion_tokens: int | None = Field(None, ge=1, le=MAX_TOKENS_LIMIT)
    response_format: ResponseFormat | None = None
    logprobs: bool = False
    top_logprobs: int | None = Field(None, ge=0, le=20)
    metadata: dict[str, str] | None = Field(None, max_length=16)
    store: bool | None = None
    service_tier: str | None = Field(None, max_length=32)
    # Tools in the prompt (docs/tools.md); router/protocol/tool_use.py checks them across fields.
    tools: list[ToolDefinition] | None = Field(None, min_length=1, max_length=MAX_TOOLS)
    tool_choice: ToolChoice | None = None
    parallel_tool_calls: bool | None = None
    # vLLM's extension: variables for the chat template (router/protocol/template_kwargs.py)
    chat_template_kwargs: dict[str, Any] | None = None

    @field_validator("chat_template_kwargs")
    @classmethod
    def _template_kwargs(cls, v: dict[str, Any] | None) -> dict[str, Any] | None:
        return None if v is None else check_template_kwargs(v)

    @field_validator("tool_choice", mode="before")
    @classmethod
    def _tool_choice_form(cls, v: object) -> object:
        """One error naming ``tool_choice`` whatever is wrong (not one per member of the union)."""
        if v is None or v in ("none", "auto", "required"):
            return v
        if isinstance(v, dict):
            try:
                return NamedToolChoice.model_validate(v)
            except ValidationError as e:
                first = e.errors()[0]
                where = ".".join(str(p) for p in first["loc"])
                raise ValueError(f"{where}: {first['msg']}" if where else first["msg"]) from None
        raise ValueError(
            'must be "none", "auto", "required" or {"type": "function", "function": {"name": ...}}'
        )

    @model_validator(mode="after")
    def _check(self) -> ChatCompletionRequest:
        if self.top_logprobs and not self.logprobs:
            raise ValueError("top_logprobs requires logprobs=true")
        if (
            self.response_format is not None
            and self.response_format.type != "text"
            and self.structured_outputs
        ):
            raise ValueError("give response_format or structured_outputs, not both")
        return self

    @property
    def requested_max_tokens(self) -> int | None:
        return self.max_completion_tokens or self.max_tokens

    @property
    def sampled_logprobs(self) -> int | None:
        return (self.top_logprobs or 0) if self.logprobs else None

    @property
    def format_request(self) -> ResponseFormat | None:
        return self.response_format


class ErrorDetail(TypedDict):
    message: str
    type: str
    param: str | None
    code: str


class ErrorBody(TypedDict):
    """An error response's JSON, in OpenAI's shape."""

    error: ErrorDetail


def error_body(message: str, *, type_: str, code: str, param: str | None = None) -> ErrorBody:
    return {"error": {"message": message, "type": type_, "param": param, "code": code}}
