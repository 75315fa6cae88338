"""What the preprocessor pool hands the router for one media request: prompt ids ready for the LLM and,
per item, where it sits and the ObjectRef of its embeddings (the request holds it; nothing is pinned in
the shared cache).

The wire form is derived from the dataclass fields (adding a field cannot drop it on one side);
ObjectRefs travel beside the msgpack bytes so Ray keeps counting them.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field, replace

from encoder_service.cache.encoder_cache import CacheReply
from encoder_service.types import EmbeddingMeta
from mmcore.feature import MediaFeature
from mmcore.wire import Reduced, from_fields, pack, to_fields, unpack

Found = tuple[EmbeddingMeta, object]  # a hit: the entry's metadata and its ObjectRef (passed through)
Answer = tuple[CacheReply, "Found | None"]  # the shared cache's answer for one item


@dataclass(frozen=True)
class PreparedRequest:
    prompt_token_ids: list[int]
    items: list[MediaFeature]  # one per placeholder run, those still encoding without a ref
    num_encoded: int  # items this request sent to an encoder (the rest were cache hits)
    log: dict[str, object]  # PreprocessedRequest.to_log(): what a failure's log line replays
    # each distinct item's cache-entry metadata (hits and encodes): what the ingress's near cache keeps
    metas: list[EmbeddingMeta] = field(default_factory=list)

    def __reduce__(self) -> Reduced:
        fields = {
            **to_fields(self, ("items", "metas")),
            "items": [it.to_wire() for it in self.items],
            "metas": [m.to_msgpack() for m in self.metas],
        }
        raw = pack("PreparedRequest", fields)
        refs = [it.ref for it in self.items]
        values = [it.value for it in self.items]
        if not any(v is not None for v in values):
            return (_prepared_from_bytes, (raw, refs))
        return (_prepared_from_bytes, (raw, refs, values))


def _prepared_from_bytes(
    raw: bytes, refs: list[list[object]], values: list[object] | None = None
) -> PreparedRequest:
    d = unpack("PreparedRequest", raw)
    if len(refs) != len(d["items"]) or (values is not None and len(values) != len(refs)):
        raise ValueError(f"PreparedRequest carries {len(d['items'])} items but {len(refs)} refs")
    values = values if values is not None else [None] * len(refs)
    items = [MediaFeature.from_wire(it, ref, v) for it, ref, v in zip(d["items"], refs, values, strict=True)]
    metas = [EmbeddingMeta.from_msgpack(m) for m in d.get("metas", [])]
    return from_fields(PreparedRequest, d, items=items, metas=metas)


def with_values(
    prepared: PreparedRequest, value_of: Callable[[object, int | None], object]
) -> PreparedRequest:
    """``prepared`` with each item's value where ``value_of(ref, part)`` has it (None: fetched as before)."""
    items = [
        replace(it, value=value_of(it.ref[0], it.part)) if it.ref and it.value is None else it
        for it in prepared.items
    ]
    return replace(prepared, items=items)


@dataclass(frozen=True)
class LookedUp:
    """What the ingress's hit path found for a request it could not serve from the cache alone,
    handed on to ``prepare`` so no item is hashed, named or looked up twice.

    ``hashes``: every item's mm_hash, in order. ``found``: per mm_hash the shard's answer — ``hit``
    with (meta, ObjectRef), ``compute`` (reserved under the request id, which ``prepare`` now holds
    and must commit or release), or ``wait``. Pickled by Ray as it is, so its refs stay counted.
    """

    hashes: list[str]
    found: dict[str, Answer]
