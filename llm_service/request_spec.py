"""What the router hands an LLM replica for one request: prompt ids, sampling params, and each media
item's record (``mmcore.feature.MediaFeature``: where its embeddings go and where they are). Pickles
as its versioned msgpack wire form (``mmcore/wire.py``);
the embeddings' ObjectRefs travel beside the bytes, so Ray keeps counting them and passes them
unresolved (the replica fetches them itself, and reports lost ones before admitting the request).
A small item's stored value may travel beside its ref (``MediaFeature.value``): the encoder replica
that computed it forwards it inline, as Ray inlines a small task argument, and saves the LLM
replica the fetch (README, "Benchmarks")."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

from llm_service.kv_handoff import KVHandoff
from llm_service.sampling_params import SamplingParams
from mmcore.feature import MediaFeature
from mmcore.wire import Reduced, from_fields, pack, to_fields, unpack


@dataclass(frozen=True)
class LLMRequestSpec:
    request_id: str
    prompt_token_ids: list[int]
    sampling_params: SamplingParams
    mm_items: Sequence[MediaFeature] = ()
    block_hashes: Sequence[bytes] = field(default=(), compare=False)  # for the replica router only
    ingress_id: str = ""  # whose output channel carries this request's tokens
    cache_salt: str | None = None  # prefix-cache salt: enters the first block's hash only
    trace_headers: dict[str, str] | None = field(default=None, compare=False)  # a sampled request's trace
    # E/P/D: sent to a decode replica, where its prefilled KV waits (its items are never fetched there)
    handoff: KVHandoff | None = None

    def __reduce__(self) -> Reduced:
        fields = {
            **to_fields(self, _SPEC_BESIDE),
            "sampling_params": self.sampling_params.to_wire(),
            "mm_items": [m.to_wire() for m in self.mm_items],
            "handoff": None if self.handoff is None else self.handoff.to_wire(),
        }
        refs = [m.ref for m in self.mm_items]
        values = [m.value for m in self.mm_items]
        if not any(v is not None for v in values):
            return (_spec_from_bytes, (pack("LLMRequestSpec", fields), refs))
        return (_spec_from_bytes, (pack("LLMRequestSpec", fields), refs, values))


_SPEC_BESIDE = ("sampling_params", "mm_items", "handoff")  # records of their own, each with its wire form


def _spec_from_bytes(
    raw: bytes, refs: list[list[object]], values: list[object] | None = None
) -> LLMRequestSpec:
    d = unpack("LLMRequestSpec", raw)
    if len(refs) != len(d["mm_items"]) or (values is not None and len(values) != len(refs)):
        raise ValueError(f"LLMRequestSpec carries {len(d['mm_items'])} items but {len(refs)} refs")
    values = values if values is not None else [None] * len(refs)
    items = [MediaFeature.from_wire(m, r, v) for m, r, v in zip(d["mm_items"], refs, values, strict=True)]
    handoff = None if d.get("handoff") is None else KVHandoff.from_wire(d["handoff"])
    return from_fields(
        LLMRequestSpec,
        d,
        sampling_params=SamplingParams.from_wire(d["sampling_params"]),
        mm_items=items,
        handoff=handoff,
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
