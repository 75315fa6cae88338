"""What the router hands an LLM replica for one request: prompt ids, sampling params, and where each
media item's embeddings are. Pickles as its versioned msgpack wire form (``llm_service/wire.py``);
the embeddings' ObjectRefs travel beside the bytes, so Ray keeps counting them and passes them
unresolved (the replica fetches them itself, and reports lost ones before admitting the request).
A small item's stored value may travel beside its ref (``EmbeddingRef.value``): the encoder replica
that computed it forwards it inline, as Ray inlines a small task argument, and saves the LLM
replica the fetch (README, "Benchmarks")."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from typing import Any

from llm_service.sampling_params import SamplingParams
from llm_service.wire import pack, unpack


@dataclass(frozen=True)
class EmbeddingRef:
    """Where one item's embeddings are (a Ray ObjectRef, boxed in a list so Ray passes it unresolved)."""

    ref: list[Any]
    offset: int
    length: int
    mm_hash: str
    modality: str
    grid_thw: tuple[int, int, int] | None = None
    second_per_grid_ts: float | None = None  # a video's seconds per temporal patch (Qwen2.5-VL positions)
    rows: tuple[int, int] | None = None  # the rows of the fetched tensor this item takes (None: all)
    # The object's stored form itself (``encoder_service.serve.deployment.stored_form``), sent along by the
    # replica that put it when it is small: taken instead of fetching ``ref``, which still travels.
    value: Any = field(default=None, compare=False, repr=False)

    @property
    def pending(self) -> bool:
        """Still being encoded: no ref yet (it arrives later, ``LLMServer.arrived``)."""
        return not self.ref and self.value is None

    def to_wire(self) -> dict[str, Any]:
        grid = list(self.grid_thw) if self.grid_thw else None
        return {
            "offset": self.offset,
            "length": self.length,
            "mm_hash": self.mm_hash,
            "modality": self.modality,
            "grid_thw": grid,
            "second_per_grid_ts": self.second_per_grid_ts,
            "rows": list(self.rows) if self.rows else None,
        }

    @classmethod
    def from_wire(cls, d: dict[str, Any], ref: list[Any]) -> EmbeddingRef:
        grid = d["grid_thw"]
        return cls(
            ref=list(ref),
            offset=int(d["offset"]),
            length=int(d["length"]),
            mm_hash=d["mm_hash"],
            modality=d["modality"],
            grid_thw=(int(grid[0]), int(grid[1]), int(grid[2])) if grid else None,
            second_per_grid_ts=d.get("second_per_grid_ts"),
            rows=(int(d["rows"][0]), int(d["rows"][1])) if d.get("rows") else None,
        )


@dataclass(frozen=True)
class LLMRequestSpec:
    request_id: str
    prompt_token_ids: list[int]
    sampling_params: SamplingParams
    mm_items: Sequence[EmbeddingRef] = ()
    block_hashes: Sequence[Any] = field(default=(), compare=False)  # for the replica router only
    ingress_id: str = ""  # whose output channel carries this request's tokens
    cache_salt: str | None = None  # prefix-cache salt: enters the first block's hash only
    trace_headers: dict[str, str] | None = field(default=None, compare=False)  # a sampled request's trace

    def __reduce__(self) -> tuple[Any, ...]:
        fields = {
            "request_id": self.request_id,
            "prompt_token_ids": list(self.prompt_token_ids),
            "sampling_params": self.sampling_params.to_wire(),
            "mm_items": [m.to_wire() for m in self.mm_items],
            "block_hashes": [bytes(h) for h in self.block_hashes],
            "ingress_id": self.ingress_id,
            "cache_salt": self.cache_salt,
        }
        if self.trace_headers:
            fields["trace_headers"] = dict(self.trace_headers)
        refs = [m.ref for m in self.mm_items]
        values = [m.value for m in self.mm_items]
        if not any(v is not None for v in values):
            return (_spec_from_bytes, (pack("LLMRequestSpec", fields), refs))
        return (_spec_from_bytes, (pack("LLMRequestSpec", fields), refs, values))


def _spec_from_bytes(raw: bytes, refs: list[list[Any]], values: list[Any] | None = None) -> LLMRequestSpec:
    d = unpack("LLMRequestSpec", raw)
    if len(refs) != len(d["mm_items"]) or (values is not None and len(values) != len(refs)):
        raise ValueError(f"LLMRequestSpec carries {len(d['mm_items'])} items but {len(refs)} refs")
    items = [EmbeddingRef.from_wire(m, r) for m, r in zip(d["mm_items"], refs, strict=True)]
    if values is not None:
        items = [replace(it, value=v) for it, v in zip(items, values, strict=True)]
    return LLMRequestSpec(
        request_id=d["request_id"],
        prompt_token_ids=[int(t) for t in d["prompt_token_ids"]],
        sampling_params=SamplingParams.from_wire(d["sampling_params"]),
        mm_items=items,
        block_hashes=list(d["block_hashes"]),
        ingress_id=str(d.get("ingress_id", "")),
        cache_salt=d.get("cache_salt"),
        trace_headers=d.get("trace_headers"),
    )


@dataclass(frozen=True)
class SubmitReply:
    """Where a submitted request's outputs will come from: this replica's output channel."""

    replica_id: str
    channel_id: str


@dataclass(frozen=True)
class ReplicaTarget:
    """A call meant for one replica (``target_replica``: read by the LLM pool's request router):
    connecting to an output channel, or aborting requests there."""

    target_replica: str
    channel_id: str = ""
    request_ids: tuple[str, ...] = ()
