"""Media items as the LLM sees them: encoder embeddings and where they go in the prompt."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch


@dataclass(frozen=True)
class MultiModalInput:
    """One item's embeddings ``[num_embeds, hidden]`` placed at prompt positions
    ``[offset, offset + num_embeds)``. ``grid_thw`` is the item's patch grid before the 2x2 spatial
    merge (what the HF processor reports); image/video items of an M-RoPE model need it.
    ``second_per_grid_ts``: seconds of video one temporal patch spans (HF's per-video
    ``second_per_grid_ts``); Qwen2.5-VL places a video's temporal positions by it (absolute time)."""

    embeddings: torch.Tensor | None  # None: not fetched, its whole span was in the prefix cache
    offset: int
    mm_hash: str
    modality: str  # "image" | "video" | "audio"
    grid_thw: tuple[int, int, int] | None = None
    second_per_grid_ts: float | None = None
    num_rows: int | None = None  # the item's length when ``embeddings`` is None

    @property
    def length(self) -> int:
        if self.embeddings is None:
            return int(self.num_rows or 0)
        return int(self.embeddings.shape[0])

    @property
    def end(self) -> int:
        return self.offset + self.length
