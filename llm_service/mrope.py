"""M-RoPE positions for Qwen2-VL / Qwen2.5-VL prompts, as transformers' ``get_rope_index`` builds them.

Text tokens get the same id on all three rows and count up by one. An image/video item with patch
grid ``(t, h, w)`` becomes ``t * (h/m) * (w/m)`` tokens (``m`` the spatial merge, 2) placed at
``(start + T(ti), start + hi, start + wi)``; the next text position is ``start + max(h, w) / m``
(transformers 5.x ignores ``t`` there, for both families). Past the prompt, token ``i`` sits at
``i + delta`` on every row with ``delta = last prompt position + 1 - prompt length``: transformers
5.x ``generate`` continues from the last prompt token's position, which is below the maximum when a
video's temporal positions run past the text after it (its ``rope_deltas``, ``max + 1 - length``, are
not what ``generate`` uses). A prompt ends in text (the chat template's assistant header), so the
three rows agree there; were it to end inside an item, the largest of the three is taken.

The temporal index ``T`` is where the two families differ:

- Qwen2-VL: ``T(ti) = ti``.
- Qwen2.5-VL (absolute time): for a video, ``T(ti) = long(ti * second_per_grid_t * tokens_per_second)``
  in float32, so a temporal patch's position is its time in the clip (``tokens_per_second`` positions a
  second); images keep ``T = 0``.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from llm_service.multimodal import MultiModalInput

# HF's value when a Qwen2.5-VL video comes without second_per_grid_ts (get_rope_index's default).
DEFAULT_SECOND_PER_GRID_T = 1.0


def temporal_index(t: int, interval: float | None) -> torch.Tensor:
    """``T(0..t-1)``: plain ``arange`` (Qwen2-VL), or scaled by ``interval`` then truncated, in float32."""
    steps = torch.arange(t)
    if interval is None:
        return steps
    return (steps * torch.tensor(interval, dtype=torch.float32)).long()


def time_interval(
    modality: str, second_per_grid_t: float | None, tokens_per_second: float | None
) -> float | None:
    """Qwen2.5-VL's temporal step for one item (``None``: Qwen2-VL's plain index)."""
    if tokens_per_second is None or modality != "video":
        return None
    spgt = DEFAULT_SECOND_PER_GRID_T if second_per_grid_t is None else second_per_grid_t
    # HF multiplies an int by a float32 tensor: round the seconds to float32 first, as it does.
    return float(torch.tensor(spgt, dtype=torch.float32) * tokens_per_second)


@dataclass(frozen=True)
class MRopeItem:
    """A visual item's placement: prompt ``[offset, offset + length)``, patch grid, temporal step."""

    offset: int
    length: int
    grid_thw: tuple[int, int, int]
    time_interval: float | None = None  # None: plain temporal index (Qwen2-VL, images)


def mrope_positions(
    num_tokens: int, items: Sequence[MRopeItem], spatial_merge_size: int
) -> tuple[torch.Tensor, int]:
    """Return the prompt's positions ``[3, num_tokens]`` (long) and the decode ``delta``.

    ``items`` sorted by offset.
    """
    parts: list[torch.Tensor] = []
    cur = 0  # next text position
    idx = 0  # next prompt index
    for item in items:
        t, h, w = item.grid_thw
        if item.offset > idx:
            parts.append(torch.arange(cur, cur + item.offset - idx).expand(3, -1))
            cur += item.offset - idx
        gh, gw = h // spatial_merge_size, w // spatial_merge_size
        tt, hh, ww = torch.meshgrid(
            temporal_index(t, item.time_interval), torch.arange(gh), torch.arange(gw), indexing="ij"
        )
        grid = torch.stack([tt, hh, ww]).reshape(3, -1) + cur
        assert grid.shape[1] == item.length, "grid_thw was validated against the item's length"
        parts.append(grid)
        cur += max(h, w) // spatial_merge_size
        idx = item.offset + item.length
    if num_tokens > idx:
        parts.append(torch.arange(cur, cur + num_tokens - idx).expand(3, -1))
    pos = torch.cat(parts, dim=1) if parts else torch.zeros(3, 0, dtype=torch.long)
    delta = int(pos[:, -1].max()) + 1 - num_tokens if num_tokens else 0
    return pos.long(), delta


def prompt_mrope_positions(
    num_tokens: int,
    mm_inputs: Sequence[MultiModalInput],
    spatial_merge_size: int,
    tokens_per_second: float | None = None,
) -> tuple[torch.Tensor, int]:
    """``mrope_positions`` for a request's visual items (audio items and items without a grid skipped).

    ``tokens_per_second`` set (Qwen2.5-VL) turns on absolute time positions for videos.
    """
    items = [
        MRopeItem(
            m.offset,
            m.length,
            m.grid_thw,
            time_interval(m.modality, m.second_per_grid_ts, tokens_per_second),
        )
        for m in mm_inputs
        if m.modality in ("image", "video") and m.grid_thw is not None
    ]
    return mrope_positions(num_tokens, items, spatial_merge_size)
