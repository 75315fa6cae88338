"""M-RoPE positions for Qwen2-VL prompts, as transformers' ``Qwen2VLModel.get_rope_index`` builds them.

Text tokens get the same id on all three rows and count up by one. An image/video item with patch
grid ``(t, h, w)`` becomes ``t * (h/m) * (w/m)`` tokens (``m`` the spatial merge, 2) placed at
``(start + ti, start + hi, start + wi)``; the next text position is ``start + max(h, w) / m``
(transformers 5.x ignores ``t`` there). Past the prompt, token ``i`` sits at ``i + delta`` on every row
with ``delta = max position + 1 - prompt length``.
"""

from __future__ import annotations

import torch


def mrope_positions(
    num_tokens: int,
    items: list[tuple[int, int, tuple[int, int, int]]],  # (offset, length, grid_thw), sorted by offset
    spatial_merge_size: int,
) -> tuple[torch.Tensor, int]:
    """Return the prompt's positions ``[3, num_tokens]`` (long) and the decode ``delta``."""
    parts: list[torch.Tensor] = []
    cur = 0  # next text position
    idx = 0  # next prompt index
    for offset, length, (t, h, w) in items:
        if offset > idx:
            parts.append(torch.arange(cur, cur + offset - idx).expand(3, -1))
            cur += offset - idx
        gh, gw = h // spatial_merge_size, w // spatial_merge_size
        tt, hh, ww = torch.meshgrid(torch.arange(t), torch.arange(gh), torch.arange(gw), indexing="ij")
        grid = torch.stack([tt, hh, ww]).reshape(3, -1) + cur
        assert grid.shape[1] == length, "grid_thw was validated against the item's length"
        parts.append(grid)
        cur += max(h, w) // spatial_merge_size
        idx = offset + length
    if num_tokens > idx:
        parts.append(torch.arange(cur, cur + num_tokens - idx).expand(3, -1))
    pos = torch.cat(parts, dim=1) if parts else torch.zeros(3, 0, dtype=torch.long)
    delta = int(pos.max()) + 1 - num_tokens if num_tokens else 0
    return pos.long(), delta
