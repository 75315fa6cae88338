"""Records handed between the preprocessor, the encoder pool and (through the router) the LLM pool.

Plain dataclasses, no torch at import time. Every record that crosses a process boundary pickles
as its versioned msgpack wire form (``mmcore/wire.py``); ObjectRefs ride beside the bytes so Ray
keeps counting them.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from mmcore.feature import (
    MODALITIES,
    ItemFacts,
    MediaFeature,
    Modality,
    PlaceholderRange,
    facts_of,
    with_facts,
)
from mmcore.wire import (
    Buffers,
    Reduced,
    from_fields,
    pack,
    pack_tensor,
    plain,
    to_fields,
    unpack,
    unpack_tensor,
)

if TYPE_CHECKING:
    import torch

__all__ = ["MODALITIES", "Modality", "PlaceholderRange"]  # the item's own terms, from mmcore.feature


@dataclass(frozen=True)
class MediaRef:
    """One media item as the client sent it; exactly one of ``url``/``data`` unless only ``uuid`` is set."""

    modality: Modality
    url: str | None = None  # data:, http(s)://, file://
    data: bytes | None = None  # raw bytes (already base64-decoded)
    format: str | None = None  # e.g. "wav" for input_audio
    uuid: str | None = None  # client-chosen name of the content, in ``tenant``'s namespace (uuid_aliases.py)
    tenant: str | None = None  # who sent it (router/http/auth.py); None when the server has no API keys


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
    tensors: dict[str, torch.Tensor] = field(default_factory=dict)
    second_per_grid_ts: float | None = None  # a video's seconds per temporal patch (Qwen2.5-VL positions)
    frame_times: list[float] | None = None  # seconds of each temporal patch (Qwen3-VL's prompt timestamps)

    @classmethod
    def of(
        cls, mm_hash: str, modality: Modality, facts: ItemFacts, tensors: dict[str, torch.Tensor]
    ) -> EncoderInput:
        return with_facts(cls, facts, mm_hash=mm_hash, modality=modality, tensors=tensors)

    @property
    def facts(self) -> ItemFacts:
        return facts_of(self)

    def to_wire(self, buffers: Buffers) -> dict[str, object]:
        tensors = {k: pack_tensor(t, buffers) for k, t in self.tensors.items()}
        return {**to_fields(self, ("tensors",)), "tensors": tensors}

    @classmethod
    def from_wire(cls, d: Mapping[str, Any], buffers: Buffers) -> EncoderInput:  # Any: a msgpack map
        return from_fields(cls, d, tensors={k: unpack_tensor(t, buffers) for k, t in d["tensors"].items()})

    def __reduce__(self) -> Reduced:
        buffers: Buffers = []
        return (_encoder_input_from_bytes, (pack("EncoderInput", self.to_wire(buffers)), buffers))


@dataclass(frozen=True)
class PreprocessedRequest:
    """A templated prompt with its media: the expanded prompt ids and one ``MediaFeature`` per
    placeholder run, those processed here with the encoder's input as their ``data``."""

    prompt_token_ids: list[int]
    items: list[MediaFeature]
    processor_kwargs: dict[str, object] = field(default_factory=dict)

    def __reduce__(self) -> Reduced:
        buffers: Buffers = []
        fields = {
            **to_fields(self, ("items",)),
            "items": [it.to_wire() for it in self.items],
            "inputs": [_input_of(it).to_wire(buffers) if it.data is not None else None for it in self.items],
        }
        return (_preprocessed_from_bytes, (pack("PreprocessedRequest", fields), buffers))

    def to_log(self) -> dict[str, object]:
        """What a failure's log line needs to replay the request (no tensors)."""
        return {
            "num_prompt_tokens": len(self.prompt_token_ids),
            "processor_kwargs": plain(self.processor_kwargs),
            "items": [
                {
                    "index": it.index,
                    "mm_hash": it.mm_hash,
                    "modality": it.modality,
                    "offset": it.offset,
                    "length": it.length,
                    "grid_thw": it.grid_thw,
                    **(it.metadata or {}),
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
    # Where in its object the item is: an encoder step's items share one object (a list of their
    # stored forms, one put per step); None: the object is this item's alone
    part: int | None = None

    @classmethod
    def of(
        cls,
        mm_hash: str,
        modality: Modality,
        facts: ItemFacts,
        hidden_size: int,
        dtype: str,
        units: int = 1,
        part: int | None = None,
    ) -> EmbeddingMeta:
        return with_facts(
            cls,
            facts,
            mm_hash=mm_hash,
            modality=modality,
            hidden_size=hidden_size,
            dtype=dtype,
            units=units,
            part=part,
        )

    @property
    def facts(self) -> ItemFacts:
        return facts_of(self)

    @property
    def cache_charge(self) -> int:
        return self.num_embeds * self.units

    def to_msgpack(self) -> bytes:
        # the optional fields only where set (second_per_grid_ts, frame_times: videos; units: DeepStack)
        return pack("EmbeddingMeta", to_fields(self, omit_defaults=True))

    @classmethod
    def from_msgpack(cls, raw: bytes) -> EmbeddingMeta:
        return from_fields(cls, unpack("EmbeddingMeta", raw))

    def __reduce__(self) -> Reduced:
        return (EmbeddingMeta.from_msgpack, (self.to_msgpack(),))


@dataclass(frozen=True)
class EncodeBatch:
    """One request's cache misses, sent to one encoder replica."""

    request_id: str
    inputs: Sequence[EncoderInput]

    @property
    def num_embeds(self) -> int:  # read by router.routing.request_routers.LeastQueuedEmbeddingsRouter
        return sum(i.num_embeds for i in self.inputs)

    def __reduce__(self) -> Reduced:
        buffers: Buffers = []
        fields = {"request_id": self.request_id, "inputs": [i.to_wire(buffers) for i in self.inputs]}
        return (_encode_batch_from_bytes, (pack("EncodeBatch", fields), buffers))


@dataclass(frozen=True)
class EncodedItem:
    """One encoder output: its metadata, and ``[ObjectRef]`` of the ``[num_embeds, hidden]`` tensor."""

    meta: EmbeddingMeta
    ref: list[object] = field(default_factory=list)

    def __reduce__(self) -> Reduced:
        return (_encoded_item_from_bytes, (self.meta.to_msgpack(), self.ref))


# Module-level so pickle finds them by name; each checks kind and version.
def _encoder_input_from_bytes(raw: bytes, buffers: Buffers) -> EncoderInput:
    return EncoderInput.from_wire(unpack("EncoderInput", raw), buffers)


def _preprocessed_from_bytes(raw: bytes, buffers: Buffers) -> PreprocessedRequest:
    d = unpack("PreprocessedRequest", raw)
    items = [
        MediaFeature.from_wire(it, data=EncoderInput.from_wire(inp, buffers) if inp is not None else None)
        for it, inp in zip(d["items"], d["inputs"], strict=True)
    ]
    return from_fields(PreprocessedRequest, d, items=items)


def _input_of(it: MediaFeature) -> EncoderInput:
    """The encoder's input an item carries (its ``data``)."""
    if not isinstance(it.data, EncoderInput):
        raise TypeError(f"{it.modality} {it.index}: data is {type(it.data).__name__}, not an EncoderInput")
    return it.data


def _encode_batch_from_bytes(raw: bytes, buffers: Buffers) -> EncodeBatch:
    d = unpack("EncodeBatch", raw)
    return EncodeBatch(d["request_id"], [EncoderInput.from_wire(i, buffers) for i in d["inputs"]])


def _encoded_item_from_bytes(meta: bytes, ref: list[object]) -> EncodedItem:
    return EncodedItem(EmbeddingMeta.from_msgpack(meta), list(ref))
