"""OpenAI's Responses wire format (``/v1/responses``) on a stateless server: the request, its input
items, and the ``response`` object the answer and its stream events carry.

``input`` is a string (one user message) or a list of items: messages (``role`` + a string or parts:
``input_text``, ``input_image``, ``input_audio``, and ``output_text``/``refusal`` in assistant
items). ``instructions`` becomes a leading system message. Nothing is stored: a field that needs a
stored response or a hosted tool is accepted by the parser only to be refused by name
(``ResponsesRequest.refusal``), a 400 whose ``param`` names it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Annotated, Any, ClassVar, Literal

from pydantic import BaseModel, ConfigDict, Discriminator, Field, Tag, ValidationError, model_validator

from router.protocol.errors import bad_request
from router.protocol.openai import MAX_TOKENS_LIMIT, JSONSchemaFormat, ResponseFormat, SamplingFields
from router.protocol.tools import (
    FUNCTION_NAME_PATTERN,
    MAX_DESCRIPTION_CHARS,
    MAX_ID_CHARS,
    MAX_TOOLS,
    FunctionDefinition,
    NamedFunction,
    NamedToolChoice,
    ToolChoice,
    ToolDefinition,
)

# Fields SamplingFields shares with chat that the Responses API spells otherwise or has not.
NOT_RESPONSES_FIELDS = {
    "max_tokens": "use max_output_tokens",
    "n": "a response has one output",
    "stream_options": "not implemented here",
}


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid")


class InputText(_Strict):
    type: Literal["input_text"]
    text: str


class OutputText(_Strict):
    """Text of an earlier assistant turn, as the API returned it (annotations and logprobs dropped)."""

    type: Literal["output_text"]
    text: str
    annotations: list[Any] | None = None
    logprobs: list[Any] | None = None


class Refusal(_Strict):
    type: Literal["refusal"]
    refusal: str


class InputImage(_Strict):
    type: Literal["input_image"]
    image_url: str | None = None
    file_id: str | None = None  # the Files API: refused by name (nothing is stored here)
    detail: Literal["auto", "low", "high"] | None = None


class InputAudioData(_Strict):
    data: str
    format: str = Field("wav", max_length=16)


class InputAudio(_Strict):
    type: Literal["input_audio"]
    input_audio: InputAudioData


def _part_tag(v: Any) -> str:
    return f"|{v.get('type') if isinstance(v, dict) else getattr(v, 'type', None)}"


InputPart = Annotated[
    Annotated[InputText, Tag("|input_text")]
    | Annotated[OutputText, Tag("|output_text")]
    | Annotated[Refusal, Tag("|refusal")]
    | Annotated[InputImage, Tag("|input_image")]
    | Annotated[InputAudio, Tag("|input_audio")],
    Discriminator(
        _part_tag,
        custom_error_type="unsupported_part",
        custom_error_message="a content part's type is one of input_text, input_image, input_audio, "
        "output_text, refusal",
    ),
]


class MessageItem(_Strict):
    """An input message (OpenAI's ``EasyInputMessage`` and ``ResponseInputMessageItem``)."""

    type: Literal["message"] = "message"
    role: Literal["user", "system", "developer", "assistant"]
    content: Content
    id: str | None = Field(None, max_length=256)
    status: str | None = Field(None, max_length=32)


class FunctionCallItem(_Strict):
    """A call the model made in an earlier turn, sent back with the history."""

    type: Literal["function_call"]
    call_id: str = Field(..., min_length=1, max_length=MAX_ID_CHARS)
    name: str = Field(..., min_length=1, max_length=64)
    arguments: str  # a JSON object, as a string (checked where the history is read)
    id: str | None = Field(None, max_length=256)
    status: str | None = Field(None, max_length=32)


ToolOutputPart = Annotated[
    Annotated[InputText, Tag("|input_text")] | Annotated[InputImage, Tag("|input_image")],
    Discriminator(
        _part_tag,
        custom_error_type="unsupported_part",
        custom_error_message="a function_call_output part's type is input_text or input_image",
    ),
]


class FunctionCallOutputItem(_Strict):
    """What a call returned: text, or parts (images included: a screenshot after a click)."""

    type: Literal["function_call_output"]
    call_id: str = Field(..., min_length=1, max_length=MAX_ID_CHARS)
    output: Annotated[
        Annotated[str, Tag("|string")] | Annotated[list[ToolOutputPart], Tag("|list")],
        Discriminator(lambda v: "|string" if isinstance(v, str) else "|list"),
    ]
    id: str | None = Field(None, max_length=256)
    status: str | None = Field(None, max_length=32)


def _item_tag(v: Any) -> str:
    kind = v.get("type", "message") if isinstance(v, dict) else getattr(v, "type", "message")
    return f"|{kind}"


def _json_type(v: Any) -> str:
    return "|string" if isinstance(v, str) else "|list"


# Unions told apart by a tag, so that an error names the item it is about ("not a string" is no help
# for a list of items). Tags start with "|": read_body leaves them out of the path it names.
InputItem = Annotated[
    Annotated[MessageItem, Tag("|message")]
    | Annotated[FunctionCallItem, Tag("|function_call")]
    | Annotated[FunctionCallOutputItem, Tag("|function_call_output")],
    Discriminator(
        _item_tag,
        custom_error_type="unsupported_item",
        custom_error_message="an input item's type is message, function_call or function_call_output "
        "(nothing else is stored or run here)",
    ),
]
Input = Annotated[
    Annotated[str, Tag("|string")] | Annotated[list[InputItem], Field(min_length=1), Tag("|list")],
    Discriminator(_json_type),
]
Content = Annotated[
    Annotated[str, Tag("|string")] | Annotated[list[InputPart], Tag("|list")], Discriminator(_json_type)
]


class FunctionTool(_Strict):
    """A function the model may call, in the Responses API's flat shape."""

    type: Literal["function"]
    name: str = Field(..., min_length=1, max_length=64, pattern=FUNCTION_NAME_PATTERN)
    description: str | None = Field(None, max_length=MAX_DESCRIPTION_CHARS)
    parameters: dict[str, Any] | None = None
    strict: bool | None = None

    def as_chat_tool(self) -> ToolDefinition:
        fn = FunctionDefinition(
            name=self.name, description=self.description, parameters=self.parameters, strict=self.strict
        )
        return ToolDefinition(type="function", function=fn)


class TextFormat(_Strict):
    """``text.format``: free text, any JSON object, or JSON matching a schema (flat, unlike chat's)."""

    type: Literal["text", "json_object", "json_schema"]
    name: str | None = Field(None, min_length=1, max_length=64, pattern=r"^[a-zA-Z0-9_-]+$")
    description: str | None = None
    schema_: dict[str, Any] | None = Field(None, alias="schema")
    strict: bool | None = None

    @model_validator(mode="after")
    def _schema_with_json_schema(self) -> TextFormat:
        if self.type == "json_schema" and (self.name is None or self.schema_ is None):
            raise ValueError("a json_schema format needs a name and a schema")
        return self

    def as_response_format(self) -> ResponseFormat:
        if self.type != "json_schema":
            return ResponseFormat(type=self.type)
        schema = JSONSchemaFormat.model_validate(
            {
                "name": self.name,
                "schema": self.schema_,
                "strict": self.strict,
                "description": self.description,
            }
        )
        return ResponseFormat(type="json_schema", json_schema=schema)


class TextConfig(_Strict):
    format: TextFormat | None = None
    verbosity: Literal["low", "medium", "high"] | None = None


@dataclass(frozen=True)
class FunctionTools:
    """A Responses request's functions, ``tool_choice`` and ``parallel_tool_calls`` as chat has them
    (router/protocol/tool_choice.py's ``ToolAsk``)."""

    tools: list[ToolDefinition] | None
    tool_choice: ToolChoice | None
    parallel_tool_calls: bool | None


class ResponsesRequest(SamplingFields):
    """``POST /v1/responses``; the sampling extensions every endpoint takes come from SamplingFields."""

    format_field: ClassVar[str] = "text.format"

    input: Input
    instructions: str | None = None
    max_output_tokens: int | None = Field(None, ge=1, le=MAX_TOKENS_LIMIT)
    text: TextConfig | None = None
    metadata: dict[str, str] | None = Field(None, max_length=16)
    safety_identifier: str | None = Field(None, max_length=512)
    service_tier: str | None = Field(None, max_length=32)
    truncation: Literal["disabled", "auto"] | None = None
    parallel_tool_calls: bool | None = None
    # Hosted tools are refused by name (``refusal``); functions are read by ``function_tools``.
    tools: list[dict[str, Any]] | None = Field(None, max_length=MAX_TOOLS)
    tool_choice: str | dict[str, Any] | None = None
    # What needs state or hosted work, refused by name (``refusal``): parsed so the 400 can say why.
    previous_response_id: str | None = None
    store: bool | None = None
    background: bool | None = None
    conversation: str | dict[str, Any] | None = None
    include: list[str] | None = None

    @model_validator(mode="after")
    def _one_format(self) -> ResponsesRequest:
        fmt = self.text.format if self.text is not None else None
        if fmt is not None and fmt.type != "text" and self.structured_outputs is not None:
            raise ValueError("give text.format or structured_outputs, not both")
        return self

    @property
    def requested_max_tokens(self) -> int | None:
        return self.max_output_tokens

    @property
    def format_request(self) -> ResponseFormat | None:
        fmt = self.text.format if self.text is not None else None
        return fmt.as_response_format() if fmt is not None else None

    def tool_ask(self) -> FunctionTools:
        """What the request says about tools, in chat's shapes (400s naming the field)."""
        return FunctionTools(self.function_tools(), self.chat_tool_choice(), self.parallel_tool_calls)

    def function_tools(self) -> list[ToolDefinition] | None:
        """``tools`` as chat's definitions (after ``refusal``: every one a function), or None."""
        if not self.tools:
            return None
        out = []
        for i, tool in enumerate(self.tools):
            try:
                out.append(FunctionTool.model_validate(tool).as_chat_tool())
            except ValidationError as e:
                first = e.errors()[0]
                where = ".".join([f"tools[{i}]", *(str(p) for p in first["loc"])])
                raise bad_request(f"{where}: {first['msg']}", code="invalid_tools", param=where) from None
        return out

    def chat_tool_choice(self) -> ToolChoice | None:
        """``tool_choice`` in chat's form: "none", "auto", "required" or a named function."""
        choice = self.tool_choice
        if choice is None or choice in ("none", "auto", "required"):
            return choice  # type: ignore[return-value]
        if isinstance(choice, dict) and choice.get("type") == "function" and set(choice) == {"type", "name"}:
            name = choice["name"]
            if isinstance(name, str) and 0 < len(name) <= 64:
                return NamedToolChoice(type="function", function=NamedFunction(name=name))
        raise bad_request(
            'tool_choice must be "none", "auto", "required" or {"type": "function", "name": ...} '
            "(hosted tools and allowed_tools are not supported)",
            code="invalid_tools",
            param="tool_choice",
        )

    def refusal(self) -> tuple[str, str] | None:
        """The first field this stateless server cannot honour: (param, why), or None."""
        for name, why in NOT_RESPONSES_FIELDS.items():
            if name in self.model_fields_set:
                return name, f"{name} is not a Responses API field ({why})"
        stateless = "this server is stateless: it stores no responses or conversations"
        if self.previous_response_id is not None:
            return (
                "previous_response_id",
                f"previous_response_id is not supported ({stateless}); send the whole input",
            )
        if self.store:
            return "store", f"store=true is not supported ({stateless}); send store=false or leave it out"
        if self.background:
            return "background", f"background=true is not supported ({stateless})"
        if self.conversation is not None:
            return "conversation", f"conversation is not supported ({stateless})"
        if self.include:
            return "include", f"include is not supported: {self.include[0]!r} is not computed here"
        if self.truncation == "auto":
            return "truncation", "truncation='auto' is not supported: input past the context is a 400"
        for i, tool in enumerate(self.tools or []):
            kind = tool.get("type")
            if kind != "function":
                return (
                    f"tools[{i}].type",
                    f"tools of type {kind!r} are not supported (hosted tools run nowhere here)",
                )
        return None
