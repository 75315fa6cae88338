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
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from importlib import resources


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


def released_template(family: str) -> str:
    """``family``'s released chat template; a ``ValueError`` if its file is not the recorded bytes."""
    spec = RELEASED_TEMPLATES[family]
    data = resources.files("cluster").joinpath(f"data/{spec.file}").read_bytes()
    digest = hashlib.sha256(data).hexdigest()
    if digest != spec.sha256 or len(data) != spec.num_bytes:
        raise ValueError(f"cluster/data/{spec.file} is not the released {family} template (sha256 {digest})")
    return data.decode("utf-8")
