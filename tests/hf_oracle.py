"""transformers' own answer on a model directory: the oracle every served answer is checked against."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

_LOADED: dict[str, Any] = {}


def load(model_dir: Path) -> tuple[Any, Any]:
    """The checkpoint's processor and model (the class its config names), loaded once."""
    import json

    import transformers
    from transformers import AutoProcessor

    key = str(model_dir)
    if key not in _LOADED:
        config = json.loads((Path(model_dir) / "config.json").read_text())
        cls = getattr(transformers, config["architectures"][0])  # the class the checkpoint names
        _LOADED[key] = (AutoProcessor.from_pretrained(model_dir), cls.from_pretrained(model_dir).eval())
    return _LOADED[key]


def hf_generate_ids(model_dir: Path, prompt_ids: list[int], max_new_tokens: int) -> list[int]:
    """``generate(do_sample=False)`` on prompt ids as they are (no template): the new ids only."""
    _, model = load(model_dir)
    ids = torch.tensor([prompt_ids])
    with torch.no_grad():
        out = model.generate(
            input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_new_tokens, do_sample=False
        )
    return [int(t) for t in out[0, len(prompt_ids) :]]


def hf_prompt_logprobs(model_dir: Path, prompt_ids: list[int]) -> list[float]:
    """The log-probability of each prompt token after the first, given the ones before it."""
    _, model = load(model_dir)
    with torch.no_grad():
        logits = model(input_ids=torch.tensor([prompt_ids])).logits[0].float()
    lp = torch.log_softmax(logits, -1)
    return [float(lp[p - 1, prompt_ids[p]]) for p in range(1, len(prompt_ids))]


def hf_generate(
    model_dir: Path,
    messages: list[dict[str, Any]],
    max_new_tokens: int,
    tools: list[dict[str, Any]] | None = None,
    chat_template: str | None = None,
    **media: Any,
) -> str:
    """Its processor, its chat template (given ``tools``; ``chat_template``: another in its place) and
    ``generate(do_sample=False)``; the new text only."""
    proc, model = load(model_dir)
    text = proc.apply_chat_template(
        messages, tools=tools, chat_template=chat_template, add_generation_prompt=True
    )
    inputs = proc(text=[text], return_tensors="pt", **media)
    with torch.no_grad():
        out = model.generate(**inputs, max_new_tokens=max_new_tokens, do_sample=False)
    return str(proc.tokenizer.decode(out[0, inputs["input_ids"].shape[1] :], skip_special_tokens=True))


def hf_unshared_tail(model_dir: Path, before: list[dict[str, Any]], after: list[dict[str, Any]]) -> int:
    """Tokens at the end of ``before``'s prompt (with its generation prompt) that ``after``'s prompt
    does not repeat, by the checkpoint's tokenizer and template: 0 where a chat's turns extend each other;
    the generation prompt's opener where the template writes a past answer without it (Qwen3.5's
    ``<think>``, Gemma 4's empty thought channel). Media parts count as their unexpanded markers."""
    proc, _ = load(model_dir)

    def ids(messages: list[dict[str, Any]]) -> list[int]:
        out = proc.tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
        return list(out["input_ids"] if hasattr(out, "keys") else out)  # a BatchEncoding or the ids

    a, b = ids(before), ids(after)
    same = next((i for i, (x, y) in enumerate(zip(a, b, strict=False)) if x != y), min(len(a), len(b)))
    return len(a) - same
