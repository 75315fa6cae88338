"""What the preprocessor pool hands the router for one media request: prompt ids ready for the LLM and,
per item, where it sits and the ObjectRef of its embeddings (the request holds it; nothing is pinned in
the shared cache).

The wire form is derived from the dataclass fields (adding a field cannot drop it on one side);
ObjectRefs travel beside the msgpack bytes so Ray keeps counting them.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field, fields, replace
from typing import Any

from encoder_service.types import EmbeddingMeta, Modality
from mmcore.wire import grid_from_wire, pack, plain, rows_from_wire, unpack


@dataclass(frozen=True)
class PreparedItem:
    mm_hash: str
    modality: Modality
    offset: int
    length: int
    grid_thw: tuple[int, int, int] | None = None
    ref: list[Any] = field(default_factory=list, compare=False)  # [ObjectRef], not in the msgpack
    second_per_grid_ts: float | None = None  # a video's seconds per temporal patch (Qwen2.5-VL positions)
    rows: tuple[int, int] | None = None  # the rows of the embeddings this run takes (None: all)
    # The object's stored form itself, from the encoder replica that put it, when small
    # (encoder_service/encode/recent_values.py): the LLM replica takes it instead of fetching ``ref``.
    value: Any = field(default=None, compare=False, repr=False)


@dataclass(frozen=True)
class PreparedRequest:
    prompt_token_ids: list[int]
    items: list[PreparedItem]
    num_encoded: int  # items this request sent to an encoder (the rest were cache hits)
    log: dict[str, Any]  # PreprocessedRequest.to_log(): what a failure's log line replays
    # each distinct item's cache-entry metadata (hits and encodes): what the ingress's near cache keeps
    metas: list[EmbeddingMeta] = field(default_factory=list)

    def __reduce__(self) -> tuple[Any, ...]:
        beside = ("ref", "value")  # not in the msgpack: pickled by Ray (refs counted, arrays out of band)
        items = [
            {f.name: getattr(it, f.name) for f in fields(it) if f.name not in beside} for it in self.items
        ]
        record = {f.name: getattr(self, f.name) for f in fields(self) if f.name not in ("items", "metas")}
        metas = [m.to_msgpack() for m in self.metas]
        raw = pack("PreparedRequest", {**plain({**record, "items": items}), "metas": metas})
        refs = [it.ref for it in self.items]
        values = [it.value for it in self.items]
        if not any(v is not None for v in values):
            return (_prepared_from_bytes, (raw, refs))
        return (_prepared_from_bytes, (raw, refs, values))


def _prepared_from_bytes(
    raw: bytes, refs: list[list[Any]], values: list[Any] | None = None
) -> PreparedRequest:
    d = unpack("PreparedRequest", raw)
    if len(refs) != len(d["items"]) or (values is not None and len(values) != len(refs)):
        raise ValueError(f"PreparedRequest carries {len(d['items'])} items but {len(refs)} refs")
    values = values if values is not None else [None] * len(refs)
    items = [
        PreparedItem(
            **{
                **it,
                "grid_thw": grid_from_wire(it["grid_thw"]),
                "rows": rows_from_wire(it.get("rows")),
                "ref": list(ref),
                "value": value,
            }
        )
        for it, ref, value in zip(d["items"], refs, values, strict=True)
    ]
    record = {f.name: d[f.name] for f in fields(PreparedRequest) if f.name not in ("items", "metas")}
    metas = [EmbeddingMeta.from_msgpack(m) for m in d.get("metas", [])]
    return PreparedRequest(**{**record, "items": items, "metas": metas})


def with_values(prepared: PreparedRequest, value_of: Callable[[Any], Any]) -> PreparedRequest:
    """``prepared`` with each item's value where ``value_of(ref)`` has it (None: fetched as before)."""
    items = [
        replace(it, value=value_of(it.ref[0])) if it.ref and it.value is None else it for it in prepared.items
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
    found: dict[str, tuple[str, Any]]
