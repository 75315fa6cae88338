"""Media items as the engine sees them: each item's record and its embeddings."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from mmcore.feature import MediaFeature, Modality

if TYPE_CHECKING:
    import torch


@dataclass(frozen=True)
class MultiModalInput:
    """The engine's view of one item: its record (``MediaFeature``: prompt positions
    ``[offset, offset + length)``, ``grid_thw`` before the 2x2 spatial merge for an M-RoPE model, a
    video's ``second_per_grid_ts`` for Qwen2.5-VL's absolute-time positions) and its embeddings
    ``[length, hidden]``, None when not fetched (its whole span is in the prefix cache)."""

    feature: MediaFeature
    embeddings: torch.Tensor | None

    @classmethod
    def of(
        cls,
        embeddings: torch.Tensor,
        offset: int,
        mm_hash: str,
        modality: Modality,
        grid_thw: tuple[int, int, int] | None = None,
        second_per_grid_ts: float | None = None,
    ) -> MultiModalInput:
        """An item given by its embeddings (offline callers and tests): the length is their rows."""
        feature = MediaFeature(
            0, modality, mm_hash, offset, int(embeddings.shape[0]), grid_thw, second_per_grid_ts
        )
        return cls(feature, embeddings)

    @property
    def offset(self) -> int:
        return self.feature.offset

    @property
    def length(self) -> int:
        return self.feature.length

    @property
    def end(self) -> int:
        return self.feature.end

    @property
    def mm_hash(self) -> str:
        return self.feature.mm_hash

    @property
    def modality(self) -> str:
        return self.feature.modality

    @property
    def grid_thw(self) -> tuple[int, int, int] | None:
        return self.feature.grid_thw

    @property
    def second_per_grid_ts(self) -> float | None:
        return self.feature.second_per_grid_ts
