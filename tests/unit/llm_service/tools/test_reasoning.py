"""The reasoning parsers (llm_service/tools/reasoning.py): the split of whole answers against hand-written
expectations (vLLM 0.32's ``qwen3`` and ``gemma4`` parsers on the same texts), and every split of the
text into deltas giving the same lanes, with no piece of a marker ever sent as text."""

from __future__ import annotations

import pytest

from llm_service.tools.reasoning import REASONING_FORMATS, Lane, reasoning_format

QWEN = reasoning_format("qwen3")
GEMMA = reasoning_format("gemma4")


@pytest.mark.parametrize(
    ("text", "kwargs", "want"),
    [
        # Qwen3.5's prompt opened <think>: the answer starts inside the reasoning.
        ("Let me see.\n</think>\n\nIt is 4.", None, ("Let me see.\n", "\n\nIt is 4.")),
        ("<think>\nhmm</think>ok", None, ("\nhmm", "ok")),  # an older template: the model opens it
        ("</think>just this", None, (None, "just this")),
        ("cut by max_tokens, still thinking", None, ("cut by max_tokens, still thinking", None)),
        ("think </thi", None, ("think </thi", None)),  # a partial marker at the end is text
        ("plan<tool_call>\n<function=f>", None, ("plan", "<tool_call>\n<function=f>")),  # implicit end
        ("ok</think>a <think>b</think>", None, ("ok", "a <think>b</think>")),  # one reasoning only
        # enable_thinking false: the prompt closed an empty reasoning; the answer is content.
        ("It is 4.", {"enable_thinking": False}, (None, "It is 4.")),
        ("", None, (None, None)),
    ],
)
def test_qwen3_whole(
    text: str, kwargs: dict[str, object] | None, want: tuple[str | None, str | None]
) -> None:
    assert QWEN.parse(text, kwargs) == want


@pytest.mark.parametrize(
    ("text", "want"),
    [
        ("<|channel>thought\nsteps here<channel|>The answer.", ("steps here", "The answer.")),
        ("The answer, thinking off.", (None, "The answer, thinking off.")),
        ("<|channel>thought\ncut short", ("cut short", None)),
        ("<|channel>thinking aloud<channel|>x", ("thinking aloud", "x")),  # no label: nothing dropped
        ("<|channel>thought\n<channel|>", (None, None)),
        ("<|channel>t<channel|><|tool_call>call:f{}<tool_call|>", ("t", "<|tool_call>call:f{}<tool_call|>")),
    ],
)
def test_gemma4_whole(text: str, want: tuple[str | None, str | None]) -> None:
    assert GEMMA.parse(text) == want


CASES = [
    ("qwen3", "Let me see.\n</think>\n\nIt is 4.", None),
    ("qwen3", "<think>\nhmm < </thin </think>ok <", None),
    ("qwen3", "plan <tool_ <tool_call>\n<function=f>", None),
    ("qwen3", "a<think>b</think>c", {"enable_thinking": False}),
    ("gemma4", "pre <|chan <|channel>thought\nsteps <channel <channel|>The answer.", None),
    ("gemma4", "<|channel>thoughtful<channel|>x", None),
    ("gemma4", "<|channel>thou", None),
]


@pytest.mark.parametrize(("name", "text", "kwargs"), CASES)
def test_every_split_gives_the_same_lanes(name: str, text: str, kwargs: dict[str, object] | None) -> None:
    fmt = reasoning_format(name)
    whole = fmt.parse(text, kwargs)
    for i in range(len(text) + 1):
        for j in range(i, len(text) + 1):
            s = fmt.stream(kwargs)
            sent: dict[Lane, str] = {Lane.REASONING: "", Lane.CONTENT: ""}
            for piece in (text[:i], text[i:j], text[j:]):
                for lane, t in s.feed(piece):
                    sent[lane] += t
                # what went out is never taken back: a held partial marker was not sent as text
                assert (whole[0] or "").startswith(sent[Lane.REASONING]), (i, j)
                assert (whole[1] or "").startswith(sent[Lane.CONTENT]), (i, j)
            for lane, t in s.finish():
                sent[lane] += t
            assert (sent[Lane.REASONING] or None, sent[Lane.CONTENT] or None) == whole, (i, j)


def test_char_by_char_holds_partial_markers() -> None:
    s = QWEN.stream()
    sent = [s.feed(c) for c in "ab</think>cd"]
    assert sent[2:9] == [[]] * 7  # '<' ... 'k' of '</think>' wait for the next character
    assert sent[9] == []  # the marker itself is never text
    assert sent[10] == [(Lane.CONTENT, "c")]
    assert sent[0] == [(Lane.REASONING, "a")]


def test_registry_names() -> None:
    assert set(REASONING_FORMATS) == {"qwen3", "gemma4"}
    with pytest.raises(ValueError, match="known: qwen3, gemma4"):
        reasoning_format("deepseek_r1")
