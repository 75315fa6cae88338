"""Chat templates as the released checkpoints ship them, byte for byte, kept as data files
(``cluster/data/*.jinja``) so that no editor or formatter can change a byte; each is checked against the
sha256 recorded here when it is read.

- Qwen3.5 (``Qwen/Qwen3.5-*``; 7,756 bytes): tools as JSON inside ``<tools>`` in the system turn, calls
  written ``<tool_call>\\n<function=NAME>\\n<parameter=K>\\nV\\n</parameter>\\n</function>\\n</tool_call>``,
  tool results as ``<tool_response>`` sections of one user turn (images and videos counted as a user's),
  and a generation prompt that opens a ``<think>`` block unless ``enable_thinking`` is false. Source:
  llama.cpp ``models/templates/Qwen3.5-4B.jinja`` (commit 98ae0a0d3, copied from the Qwen3.5-4B checkpoint).
- Gemma 4 (``google/gemma-4-*``; 16,448 bytes): declarations ``<|tool>declaration:f{...}<tool|>`` in the
  system turn, calls ``<|tool_call>call:f{k:<|"|>v<|"|>}<tool_call|>``, results ``<|tool_response>
  response:f{...}<tool_response|>``. This is Google's updated template (April 2026): it reads OpenAI's
  ``role: "tool"`` messages itself (the name from the matching ``tool_call_id``, the text of their parts;
  it renders no media there), and still reads Google's own ``tool_responses`` field. Source: llama.cpp
  ``models/templates/google-gemma-4-31B-it.jinja`` (commit 3fc65063d, "better align to the updated
  official gemma4 template").

Tool-capable templates for the families whose checkpoints ship none, served with the model's
``chat_template`` setting (docs/tools.md), as vLLM users serve them with ``--chat-template``:

- Gemma 3, pythonic calls (``[f(k=v)]``): vLLM's ``examples/tool_chat_template_gemma3_pythonic.jinja``
  (commit c6991a3bf, Apache-2.0; 5,784 bytes, CRLF line endings as committed), the one vLLM's docs give
  with ``--tool-call-parser pythonic``; tools in the first user turn, results as ``<tool_response>``.
- Qwen2-VL and Qwen2.5-VL, hermes calls: their checkpoints' templates have no tool section, and
  Qwen2.5's (text) template, which has one, renders no media. Qwen3-VL-Instruct's released template is
  that hermes section (the same wording) with Qwen-VL's vision parts, in user turns and in tool results,
  and the same vision tokens: the bytes of ``qwen3_vl_template.py`` (5,292 bytes), unchanged. It has no
  default system prompt (Qwen2-VL's adds "You are a helpful assistant.").
- Qwen2-Audio, hermes calls: **adapted** (no public template has both): the Qwen-VL one above with its
  image and video parts replaced by Qwen2-Audio's ``Audio N: <|audio_bos|><|AUDIO|><|audio_eos|>\\n``
  (in user turns and tool results), nothing else changed.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from importlib import resources
from pathlib import Path


@dataclass(frozen=True)
class ReleasedTemplate:
    file: str  # under cluster/data/
    sha256: str
    num_bytes: int


RELEASED_TEMPLATES: dict[str, ReleasedTemplate] = {
    "qwen3.5": ReleasedTemplate(
        "qwen3_5_chat_template.jinja",
        "a4aee8afcf2e0711942cf848899be66016f8d14a889ff9ede07bca099c28f715",
        7756,
    ),
    "gemma4": ReleasedTemplate(
        "gemma4_chat_template.jinja",
        "85a08664d16d8f3be4416c92427b3ac10df1024ac566cc0b4bc3bab409393f98",
        16448,
    ),
}


_QWEN_VL_TOOLS = ReleasedTemplate(
    "qwen_vl_tool_chat_template.jinja",
    "3636d0f0bd6bef02654cdffdc447b79cb2cef8ab02cc75267345946291a489e4",
    5292,
)
# tiny family -> its tool-capable template (and the parser its calls take is the family's default)
TOOL_TEMPLATES: dict[str, ReleasedTemplate] = {
    "qwen2-vl": _QWEN_VL_TOOLS,
    "qwen2.5-vl": _QWEN_VL_TOOLS,
    "gemma3": ReleasedTemplate(
        "gemma3_pythonic_tool_chat_template.jinja",
        "f13b988fbd4c082937e342acec34892a8e589690a41e95b0445fcf837e31aefa",
        5784,
    ),
    "qwen2-audio": ReleasedTemplate(  # adapted: see the module's docstring
        "qwen2_audio_tool_chat_template.jinja",
        "e4d507d52e7931bb1eadb9c15ed7f8412e69c6d976db47881362398cafd24ec7",
        4546,
    ),
}


def _checked(spec: ReleasedTemplate, what: str) -> bytes:
    data = resources.files("cluster").joinpath(f"data/{spec.file}").read_bytes()
    digest = hashlib.sha256(data).hexdigest()
    if digest != spec.sha256 or len(data) != spec.num_bytes:
        raise ValueError(f"cluster/data/{spec.file} is not the recorded {what} template (sha256 {digest})")
    return data


def released_template(family: str) -> str:
    """``family``'s released chat template; a ``ValueError`` if its file is not the recorded bytes."""
    return _checked(RELEASED_TEMPLATES[family], family).decode("utf-8")


def tool_template_path(family: str) -> Path:
    """The shipped tool-capable template for ``family`` (a tiny family's name), checked, as a path for
    a model's ``chat_template`` setting."""
    spec = TOOL_TEMPLATES[family]
    _checked(spec, f"{family} tool")
    return Path(str(resources.files("cluster").joinpath(f"data/{spec.file}")))
