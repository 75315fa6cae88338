"""Interleaved M-RoPE, the position set-up of the Qwen3 decoders (Qwen3-VL, Qwen3.5): the config
fields they share and the rotary embedding.

Interleaved M-RoPE: frequency ``i`` of the rotary dims' half takes its position from the height row
when ``i % 3 == 1 and i < 3 * mrope_section[1]``, from the width row when ``i % 3 == 2 and i < 3 *
mrope_section[2]``, else from the temporal row (transformers' ``recomposition_frequencies``), where
Qwen2-VL takes contiguous sections.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import fields
from pathlib import Path
from typing import Any

import torch

from llm_service.models.hf_config import section, to_int, to_list
from llm_service.models.qwen2 import PositionScheme, RotaryEmbedding, TextConfig


def qwen3_text_fields(
    model_dir: str | Path,
    cfg: Mapping[str, object],
    scheme: PositionScheme,
    family: str,
    default_mrope_section: tuple[int, ...] | None = None,
) -> dict[str, Any]:
    """``TextConfig``'s fields and ``attention_bias`` of a Qwen3 decoder with interleaved M-RoPE.

    Raises ``ValueError`` naming ``family`` for contiguous M-RoPE (``mrope_interleaved: false``), which
    ``InterleavedMRope`` does not compute. ``default_mrope_section``: the family's sections where
    ``rope_parameters`` names none (None: ``TextConfig``'s reading stands).
    """
    text = section(cfg, "text_config") or cfg
    rope = section(text, "rope_parameters")
    if not rope.get("mrope_interleaved", True):
        raise ValueError(f"{model_dir}: {family} with contiguous (non-interleaved) M-RoPE is not supported")
    base = TextConfig.from_hf_config(model_dir, cfg, scheme)
    out: dict[str, Any] = {f.name: getattr(base, f.name) for f in fields(TextConfig)}
    if default_mrope_section is not None:
        sections = to_list(rope.get("mrope_section") or default_mrope_section)
        out["mrope_section"] = tuple(to_int(m) for m in sections)
    out["attention_bias"] = bool(text.get("attention_bias", False))
    return out


class InterleavedMRope(RotaryEmbedding):
    def _sections(self, f: torch.Tensor) -> torch.Tensor:
        assert self.mrope_section is not None
        out = f[0].clone()
        for row in (1, 2):
            idx = slice(row, 3 * self.mrope_section[row], 3)
            out[..., idx] = f[row][..., idx]
        return out
