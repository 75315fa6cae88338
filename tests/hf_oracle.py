"""transformers' own answer on a model directory: the oracle every served answer is checked against."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

_LOADED: dict[str, Any] = {}


def hf_generate(model_dir: Path, messages: list[dict[str, Any]], max_new_tokens: int, **media: Any) -> str:
    """Its processor, its chat template and ``generate(do_sample=False)``; the new text only."""
    import json

    import transformers
    from transformers import AutoProcessor

    key = str(model_dir)
    if key not in _LOADED:
        config = json.loads((Path(model_dir) / "config.json").read_text())
        cls = getattr(transformers, config["architectures"][0])  # the class the checkpoint names
        _LOADED[key] = (AutoProcessor.from_pretrained(model_dir), cls.from_pretrained(model_dir).eval())
    proc, model = _LOADED[key]
    text = proc.apply_chat_template(messages, add_generation_prompt=True)
    inputs = proc(text=[text], return_tensors="pt", **media)
    with torch.no_grad():
        out = model.generate(**inputs, max_new_tokens=max_new_tokens, do_sample=False)
    return str(proc.tokenizer.decode(out[0, inputs["input_ids"].shape[1] :], skip_special_tokens=True))
