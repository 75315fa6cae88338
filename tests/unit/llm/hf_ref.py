"""Build HF reference inputs and outputs for the engine-vs-transformers tests.

The embeddings handed to the engine are the very rows HF's own model feeds its language model
(captured with a pre-hook on ``model.language_model``), so only the engine is under test.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from llm_service.multimodal import MultiModalInput


@dataclass
class RefCase:
    prompt: list[int]
    mm_inputs: list[MultiModalInput]
    hf_inputs: dict[str, Any]


def capture_lm_inputs(hf: Any, inputs: dict[str, Any]) -> torch.Tensor:
    """Run one HF forward and return the ``inputs_embeds`` [T, hidden] given to its language model."""
    seen: list[torch.Tensor] = []

    def hook(_mod, _args, kwargs):  # type: ignore[no-untyped-def]
        seen.append(kwargs["inputs_embeds"].detach().clone())

    handle = hf.model.language_model.register_forward_pre_hook(hook, with_kwargs=True)
    try:
        with torch.no_grad():
            hf(**inputs)
    finally:
        handle.remove()
    return seen[0][0]


def runs(ids: list[int], token_id: int) -> list[tuple[int, int]]:
    """(offset, length) of each maximal run of ``token_id``."""
    out, i = [], 0
    while i < len(ids):
        if ids[i] == token_id:
            j = i
            while j < len(ids) and ids[j] == token_id:
                j += 1
            out.append((i, j - i))
            i = j
        else:
            i += 1
    return out


def build_case(
    hf: Any, processor: Any, text: str, mm_hashes: list[str] | None = None, **media: Any
) -> RefCase:
    inputs = dict(processor(text=[text], return_tensors="pt", **media))
    ids = inputs["input_ids"][0].tolist()
    cfg = hf.config
    spans: list[tuple[int, int, str, tuple[int, int, int] | None]] = []
    if getattr(cfg, "image_token_id", None) is not None:
        grids = {
            "image": [tuple(g.tolist()) for g in inputs.get("image_grid_thw", [])],
            "video": [tuple(g.tolist()) for g in inputs.get("video_grid_thw", [])],
        }
        for modality, tok in (("image", cfg.image_token_id), ("video", cfg.video_token_id)):
            for (off, n), grid in zip(runs(ids, tok), grids[modality], strict=True):
                spans.append((off, n, modality, grid))
    else:
        spans = [(off, n, "audio", None) for off, n in runs(ids, cfg.audio_token_id)]
    spans.sort()
    embeds = capture_lm_inputs(hf, inputs) if spans else None
    mm_inputs = []
    for i, (off, n, modality, grid) in enumerate(spans):
        assert embeds is not None
        mm_hash = mm_hashes[i] if mm_hashes else f"{modality}-{i}"
        mm_inputs.append(MultiModalInput(embeds[off : off + n].clone(), off, mm_hash, modality, grid))
    return RefCase(ids, mm_inputs, inputs)


def hf_generate(hf: Any, case: RefCase, n: int) -> list[int]:
    with torch.no_grad():
        out = hf.generate(**case.hf_inputs, max_new_tokens=n, do_sample=False)
    return out[0, len(case.prompt) :].tolist()
