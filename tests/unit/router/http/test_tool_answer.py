"""The answer's text for tool parsing (router/http/tool_answer.py): a format whose markers are special
tokens (Gemma 4's released tokenizer) keeps them in the text, every other special token dropped; a
tokenizer whose markers are plain text keeps the ingress's ordinary decode."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from transformers import AutoTokenizer

from llm_service.tools.formats import TOOL_FORMATS
from router.http.tool_answer import answer_decoder
from tests.tiny_dirs import tiny_model_dir


@dataclass
class _Orch:
    tokenizer: Any

    def decode(self, token_ids: Sequence[int]) -> str:
        return str(self.tokenizer.decode(list(token_ids), skip_special_tokens=True))


def test_special_markers_stay_in_the_text_and_parse() -> None:
    tok = AutoTokenizer.from_pretrained(tiny_model_dir("gemma4"))
    plain = _Orch(tok)
    assert answer_decoder(plain, TOOL_FORMATS["gemma4"]) == plain.decode  # markers are plain text here
    tok.add_special_tokens({"additional_special_tokens": ["<|tool_call>", "<tool_call|>", '<|"|>']})
    orch = _Orch(tok)
    text = 'Sure.<|tool_call>call:get_time{zone:<|"|>CET<|"|>}<tool_call|>'
    ids = [*tok.encode(text, add_special_tokens=False), tok.eos_token_id]
    assert "<|tool_call>" not in orch.decode(ids)  # the ordinary decode loses the call
    decode = answer_decoder(orch, TOOL_FORMATS["gemma4"])
    assert decode(ids) == text  # the markers kept, the end-of-turn token dropped
    out = TOOL_FORMATS["gemma4"].parse(decode(ids))
    assert out.content == "Sure." and [(c.name, c.arguments) for c in out.calls] == [
        ("get_time", '{"zone": "CET"}')
    ]
    assert answer_decoder(orch, None) == orch.decode  # no tools: the ordinary decode
