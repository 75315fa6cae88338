"""Records handed between the preprocessor, the encoder pool and (through the router) the LLM pool.

Plain dataclasses, no torch at import time: tensors ride along as values and cross processes through
Ray's object store. ``to_msgpack``/``from_msgpack`` give the versioned wire form of the metadata.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Literal

import msgpack

Modality = Literal["image", "video", "audio"]
MODALITIES: tuple[Modality, ...] = ("image", "video", "audio")
WIRE_VERSION = 1


@dataclass(frozen=True)
class PlaceholderRange:
    """Where an item's embeddings sit in the prompt: token positions ``[offset, offset + length)``."""

    offset: int
    length: int

    @property
    def end(self) -> int:
        return self.offset + self.length


@dataclass(frozen=True)
class MediaRef:
    """One media item as the client sent it; exactly one of ``url``/``data`` unless only ``uuid`` is set."""

    modality: Modality
    url: str | None = None  # data:, http(s)://, file://
    data: bytes | None = None  # raw bytes (already base64-decoded)
    format: str | None = None  # e.g. "wav" for input_audio
    uuid: str | None = None  # client-chosen id that replaces the content in the mm_hash


@dataclass
class EncoderInput:
    """What the encoder needs to embed one item.

    ``tensors`` holds the HF processor's outputs for this one item:
      image: ``pixel_values`` [num_patches, C*T*P*P], ``image_grid_thw`` [1, 3]
      video: ``pixel_values_videos`` [num_patches, C*T*P*P], ``video_grid_thw`` [1, 3]
      audio: ``input_features`` [1, mel, frames], ``feature_attention_mask`` [1, frames]
    """

    mm_hash: str
    modality: Modality
    num_embeds: int
    grid_thw: tuple[int, int, int] | None
    tensors: dict[str, Any] = field(default_factory=dict)


@dataclass(frozen=True)
class MultiModalItem:
    """One item of a preprocessed prompt. ``encoder_input`` is None when the encoder cache holds it."""

    index: int  # position among the request's media items, for error messages
    mm_hash: str
    modality: Modality
    placeholder: PlaceholderRange
    grid_thw: tuple[int, int, int] | None
    metadata: dict[str, Any]  # parsed facts for logs: width/height, frames, seconds, source kind
    encoder_input: EncoderInput | None = None

    @property
    def num_embeds(self) -> int:
        return self.placeholder.length


@dataclass(frozen=True)
class PreprocessedRequest:
    prompt_token_ids: list[int]
    items: list[MultiModalItem]
    processor_kwargs: dict[str, Any] = field(default_factory=dict)

    def to_log(self) -> dict[str, Any]:
        """What a failure's log line needs to replay the request (no tensors)."""
        return {
            "num_prompt_tokens": len(self.prompt_token_ids),
            "processor_kwargs": self.processor_kwargs,
            "items": [
                {
                    "index": it.index,
                    "mm_hash": it.mm_hash,
                    "modality": it.modality,
                    "offset": it.placeholder.offset,
                    "length": it.placeholder.length,
                    "grid_thw": it.grid_thw,
                    **it.metadata,
                }
                for it in self.items
            ],
        }


@dataclass(frozen=True)
class EmbeddingMeta:
    """Metadata of a cached encoder output (the tensor itself lives in Ray's object store)."""

    mm_hash: str
    modality: Modality
    num_embeds: int
    hidden_size: int
    dtype: str
    grid_thw: tuple[int, int, int] | None = None

    def to_msgpack(self) -> bytes:
        return msgpack.packb(
            {
                "v": WIRE_VERSION,
                "mm_hash": self.mm_hash,
                "modality": self.modality,
                "num_embeds": self.num_embeds,
                "hidden_size": self.hidden_size,
                "dtype": self.dtype,
                "grid_thw": list(self.grid_thw) if self.grid_thw else None,
            }
        )

    @classmethod
    def from_msgpack(cls, raw: bytes) -> EmbeddingMeta:
        d = msgpack.unpackb(raw)
        if d.get("v") != WIRE_VERSION:
            raise ValueError(f"unsupported EmbeddingMeta wire version {d.get('v')!r}")
        grid = d["grid_thw"]
        return cls(
            mm_hash=d["mm_hash"],
            modality=d["modality"],
            num_embeds=d["num_embeds"],
            hidden_size=d["hidden_size"],
            dtype=d["dtype"],
            grid_thw=tuple(grid) if grid else None,  # type: ignore[arg-type]
        )
