"""Records handed between the preprocessor, the encoder pool and (through the router) the LLM pool.

Plain dataclasses, no torch at import time. Every record that crosses a process boundary pickles
as its versioned msgpack wire form (``encoder_service/wire.py``); ObjectRefs ride beside the bytes
so Ray keeps counting them.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

from mmcore.wire import (
    grid_from_wire,
    grid_to_wire,
    pack,
    pack_tensor,
    plain,
    rows_from_wire,
    unpack,
    unpack_tensor,
)

Modality = Literal["image", "video", "audio"]
MODALITIES: tuple[Modality, ...] = ("image", "video", "audio")


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
    uuid: str | None = None  # client-chosen name of the content, in ``tenant``'s namespace (uuid_aliases.py)
    tenant: str | None = None  # who sent it (router/auth.py); None when the server has no API keys


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
    second_per_grid_ts: float | None = None  # a video's seconds per temporal patch (Qwen2.5-VL positions)
    frame_times: list[float] | None = None  # seconds of each temporal patch (Qwen3-VL's prompt timestamps)

    def to_wire(self, buffers: list[Any]) -> dict[str, Any]:
        return {
            "mm_hash": self.mm_hash,
            "modality": self.modality,
            "num_embeds": self.num_embeds,
            "grid_thw": grid_to_wire(self.grid_thw),
            "tensors": {k: pack_tensor(t, buffers) for k, t in self.tensors.items()},
            "second_per_grid_ts": self.second_per_grid_ts,
            "frame_times": self.frame_times,
        }

    @classmethod
    def from_wire(cls, d: dict[str, Any], buffers: list[Any]) -> EncoderInput:
        return cls(
            mm_hash=d["mm_hash"],
            modality=d["modality"],
            num_embeds=int(d["num_embeds"]),
            grid_thw=grid_from_wire(d["grid_thw"]),
            tensors={k: unpack_tensor(t, buffers) for k, t in d["tensors"].items()},
            second_per_grid_ts=d.get("second_per_grid_ts"),
            frame_times=d.get("frame_times"),
        )

    def __reduce__(self) -> tuple[Any, ...]:
        buffers: list[Any] = []
        return (_encoder_input_from_bytes, (pack("EncoderInput", self.to_wire(buffers)), buffers))


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
    second_per_grid_ts: float | None = None  # what the LLM's positions need beyond the grid (video)
    # One run of an item whose placeholder is several runs (a Qwen3-VL video: one run per temporal
    # patch, timestamps between them): the rows of the item's embeddings this run takes.
    rows: tuple[int, int] | None = None

    @property
    def num_embeds(self) -> int:
        return self.placeholder.length

    def to_wire(self, buffers: list[Any]) -> dict[str, Any]:
        return {
            "index": self.index,
            "mm_hash": self.mm_hash,
            "modality": self.modality,
            "offset": self.placeholder.offset,
            "length": self.placeholder.length,
            "grid_thw": grid_to_wire(self.grid_thw),
            "metadata": plain(self.metadata),
            "encoder_input": self.encoder_input.to_wire(buffers) if self.encoder_input else None,
            "second_per_grid_ts": self.second_per_grid_ts,
            "rows": list(self.rows) if self.rows else None,
        }

    @classmethod
    def from_wire(cls, d: dict[str, Any], buffers: list[Any]) -> MultiModalItem:
        enc = d["encoder_input"]
        return cls(
            index=int(d["index"]),
            mm_hash=d["mm_hash"],
            modality=d["modality"],
            placeholder=PlaceholderRange(int(d["offset"]), int(d["length"])),
            grid_thw=grid_from_wire(d["grid_thw"]),
            metadata=dict(d["metadata"]),
            encoder_input=EncoderInput.from_wire(enc, buffers) if enc is not None else None,
            second_per_grid_ts=d.get("second_per_grid_ts"),
            rows=rows_from_wire(d.get("rows")),
        )


@dataclass(frozen=True)
class PreprocessedRequest:
    prompt_token_ids: list[int]
    items: list[MultiModalItem]
    processor_kwargs: dict[str, Any] = field(default_factory=dict)

    def __reduce__(self) -> tuple[Any, ...]:
        buffers: list[Any] = []
        fields = {
            "prompt_token_ids": list(self.prompt_token_ids),
            "items": [it.to_wire(buffers) for it in self.items],
            "processor_kwargs": plain(self.processor_kwargs),
        }
        return (_preprocessed_from_bytes, (pack("PreprocessedRequest", fields), buffers))

    def to_log(self) -> dict[str, Any]:
        """What a failure's log line needs to replay the request (no tensors)."""
        return {
            "num_prompt_tokens": len(self.prompt_token_ids),
            "processor_kwargs": plain(self.processor_kwargs),
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
    second_per_grid_ts: float | None = None  # cache hits carry it to the LLM's positions
    frame_times: list[float] | None = None  # cache hits carry a Qwen3-VL video's prompt timestamps
    units: int = 1  # LLM-width rows per row (1 + DeepStack levels): the cache charges num_embeds x units

    @property
    def cache_charge(self) -> int:
        return self.num_embeds * self.units

    def to_msgpack(self) -> bytes:
        fields: dict[str, Any] = {
            "mm_hash": self.mm_hash,
            "modality": self.modality,
            "num_embeds": self.num_embeds,
            "hidden_size": self.hidden_size,
            "dtype": self.dtype,
            "grid_thw": grid_to_wire(self.grid_thw),
        }
        if self.second_per_grid_ts is not None:  # optional: absent on images, audio, Qwen2-VL
            fields["second_per_grid_ts"] = self.second_per_grid_ts
        if self.frame_times is not None:  # optional: Qwen3-VL videos only
            fields["frame_times"] = list(self.frame_times)
        if self.units != 1:  # optional: Qwen3-VL (DeepStack rows) only
            fields["units"] = self.units
        return pack("EmbeddingMeta", fields)

    @classmethod
    def from_msgpack(cls, raw: bytes) -> EmbeddingMeta:
        d = unpack("EmbeddingMeta", raw)
        return cls(
            mm_hash=d["mm_hash"],
            modality=d["modality"],
            num_embeds=int(d["num_embeds"]),
            hidden_size=int(d["hidden_size"]),
            dtype=d["dtype"],
            grid_thw=grid_from_wire(d["grid_thw"]),
            second_per_grid_ts=d.get("second_per_grid_ts"),
            frame_times=d.get("frame_times"),
            units=int(d.get("units", 1)),
        )

    def __reduce__(self) -> tuple[Any, ...]:
        return (EmbeddingMeta.from_msgpack, (self.to_msgpack(),))


@dataclass(frozen=True)
class EncodeBatch:
    """One request's cache misses, sent to one encoder replica."""

    request_id: str
    inputs: Sequence[EncoderInput]

    @property
    def num_embeds(self) -> int:  # read by router.request_routers.LeastQueuedEmbeddingsRouter
        return sum(i.num_embeds for i in self.inputs)

    def __reduce__(self) -> tuple[Any, ...]:
        buffers: list[Any] = []
        fields = {"request_id": self.request_id, "inputs": [i.to_wire(buffers) for i in self.inputs]}
        return (_encode_batch_from_bytes, (pack("EncodeBatch", fields), buffers))


@dataclass(frozen=True)
class EncodedItem:
    """One encoder output: its metadata, and ``[ObjectRef]`` of the ``[num_embeds, hidden]`` tensor."""

    meta: EmbeddingMeta
    ref: list[Any] = field(default_factory=list)

    def __reduce__(self) -> tuple[Any, ...]:
        return (_encoded_item_from_bytes, (self.meta.to_msgpack(), self.ref))


# Module-level so pickle finds them by name; each checks kind and version.
def _encoder_input_from_bytes(raw: bytes, buffers: list[Any]) -> EncoderInput:
    return EncoderInput.from_wire(unpack("EncoderInput", raw), buffers)


def _preprocessed_from_bytes(raw: bytes, buffers: list[Any]) -> PreprocessedRequest:
    d = unpack("PreprocessedRequest", raw)
    return PreprocessedRequest(
        prompt_token_ids=[int(t) for t in d["prompt_token_ids"]],
        items=[MultiModalItem.from_wire(it, buffers) for it in d["items"]],
        processor_kwargs=dict(d["processor_kwargs"]),
    )


def _encode_batch_from_bytes(raw: bytes, buffers: list[Any]) -> EncodeBatch:
    d = unpack("EncodeBatch", raw)
    return EncodeBatch(d["request_id"], [EncoderInput.from_wire(i, buffers) for i in d["inputs"]])


def _encoded_item_from_bytes(meta: bytes, ref: list[Any]) -> EncodedItem:
    return EncodedItem(EmbeddingMeta.from_msgpack(meta), list(ref))
