"""OpenAI's tool fields on the wire: function definitions (``tools``), ``tool_choice``, and the calls an
assistant message carries in a chat's history (``tool_calls``). Models only (pydantic, no other
import): their checks across fields and the forms a chat template takes are in ``tool_use.py``."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

MAX_TOOLS = 128  # function definitions per request (OpenAI's own bound)
MAX_TOOL_CALLS = 128  # calls in one assistant message of the history
MAX_DESCRIPTION_CHARS = 8192  # a function's description
MAX_ID_CHARS = 256  # a tool call's id (and a tool message's tool_call_id)
FUNCTION_NAME_PATTERN = r"^[a-zA-Z0-9_.-]+$"  # OpenAI's ``^[a-zA-Z0-9_-]{1,64}$``, dots allowed as vLLM does


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid")


class FunctionDefinition(_Strict):
    name: str = Field(..., min_length=1, max_length=64, pattern=FUNCTION_NAME_PATTERN)
    description: str | None = Field(None, max_length=MAX_DESCRIPTION_CHARS)
    parameters: dict[str, Any] | None = None  # a JSON schema of the arguments (an object)
    strict: bool | None = None


class ToolDefinition(_Strict):
    type: Literal["function"]
    function: FunctionDefinition


class NamedFunction(_Strict):
    name: str = Field(..., min_length=1, max_length=64)


class NamedToolChoice(_Strict):
    """``{"type": "function", "function": {"name": ...}}``: the model must call that function."""

    type: Literal["function"]
    function: NamedFunction


ToolChoice = Literal["none", "auto", "required"] | NamedToolChoice


class FunctionCall(_Strict):
    name: str = Field(..., min_length=1, max_length=64)
    arguments: str  # a JSON object, as a string (checked where the history is read)


class ToolCall(_Strict):
    """One call an assistant message of the history made."""

    id: str = Field(..., min_length=1, max_length=MAX_ID_CHARS)
    type: Literal["function"] = "function"
    function: FunctionCall
