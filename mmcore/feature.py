"""One media item's record from the preprocessed prompt to the model runner (vLLM's
``MultiModalFeatureSpec``): what it is (modality, content hash), where its embeddings go in the prompt,
the facts the LLM's positions need, and, once encoded, where its embeddings are. Each stage passes the
same record on and adds what it learns with ``dataclasses.replace``; none copies it into one of its own.

An item is one record per placeholder run: most items are one run; a Qwen3-VL video is one run per
temporal patch (timestamps between them), the runs sharing the mm_hash, each taking its ``rows`` of
the item's embeddings.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field, fields, replace
from typing import ClassVar, Literal, TypeVar

from mmcore.wire import from_fields, to_fields

R = TypeVar("R")
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
class ItemFacts:
    """What an item's embeddings are, known once it is processed or found in the cache: how many rows,
    the patch grid before the spatial merge, and what a video's positions and prompt need. The
    preprocessor's item holds one; the encoder's input (``EncoderInput``) and the cache entry
    (``EmbeddingMeta``) declare these fields and give and take them whole (``facts``, ``of``), so
    a new fact is a field here and on those records, copied by no code."""

    num_embeds: int
    grid_thw: tuple[int, int, int] | None = None
    second_per_grid_ts: float | None = None  # a video's seconds per temporal patch (Qwen2.5-VL)
    frame_times: list[float] | None = None  # seconds of each temporal patch (Qwen3-VL's timestamps)


def facts_of(record: object) -> ItemFacts:
    """The ``ItemFacts`` fields of a record that declares them."""
    return ItemFacts(**{f.name: getattr(record, f.name) for f in fields(ItemFacts)})


def with_facts(cls: type[R], facts: ItemFacts, **other: object) -> R:
    """A record of ``cls`` (which declares the ``ItemFacts`` fields) with ``facts`` and ``other``."""
    return cls(**{f.name: getattr(facts, f.name) for f in fields(ItemFacts)}, **other)


@dataclass(frozen=True)
class MediaFeature:
    index: int  # the item's position among the request's media items (errors name it)
    modality: Modality
    mm_hash: str  # content hash: the encoder cache's key, and part of the prefix-cache block hashes
    offset: int  # the run's first prompt position
    length: int  # its number of embeddings (prompt positions)
    grid_thw: tuple[int, int, int] | None = None  # patch grid before the spatial merge (M-RoPE)
    second_per_grid_ts: float | None = None  # a video's seconds per temporal patch (Qwen2.5-VL positions)
    rows: tuple[int, int] | None = None  # the rows of the item's embeddings this run takes (None: all)
    part: int | None = None  # the item's place in the object ``ref`` names (``EmbeddingMeta.part``)
    metadata: dict[str, object] | None = None  # facts for logs (size, frames, source): preprocessor only
    # What the encoder takes for it (``encoder_service.types.EncoderInput``), on the first run of an
    # item the preprocessor processed; dropped once it is encoded or cached. Never in the msgpack.
    data: object = field(default=None, compare=False, repr=False)
    # Where the embeddings are once encoded: ``[ObjectRef]`` (empty while still encoding), and the
    # stored form itself when small (the encoder replica that put it sends it along; the LLM replica
    # takes it instead of fetching). Both travel beside the record's msgpack, so Ray counts the ref.
    ref: list[object] = field(default_factory=list, compare=False)
    value: object = field(default=None, compare=False, repr=False)

    BESIDE: ClassVar[tuple[str, ...]] = ("ref", "value", "data")  # travel beside the msgpack

    @property
    def placeholder(self) -> PlaceholderRange:
        return PlaceholderRange(self.offset, self.length)

    @property
    def end(self) -> int:
        return self.offset + self.length

    @property
    def pending(self) -> bool:
        """Still being encoded: no ref and no value yet (they arrive later)."""
        return not self.ref and self.value is None

    def to_wire(self) -> dict[str, object]:
        return to_fields(self, self.BESIDE, omit_defaults=True)

    @classmethod
    def from_wire(
        cls,
        d: Mapping[str, object],
        ref: list[object] | None = None,
        value: object = None,
        data: object = None,
    ) -> MediaFeature:
        return from_fields(cls, d, ref=list(ref or []), value=value, data=data)

    def encoded(self, ref: list[object] | None = None, part: int | None = None) -> MediaFeature:
        """The record as it goes on once its embeddings exist (or are still to come, ``ref`` None):
        where they are (``part``: its place in a step's shared object), and nothing the
        preprocessor alone needed."""
        return replace(self, ref=list(ref or []), part=part, data=None, metadata=None)
