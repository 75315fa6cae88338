"""The hit path's tests' world, without Ray: the real cache shard in-process (counting its lookups,
failing some on demand) behind a ``.remote`` shim, and the encoder replica's ``prepare`` as the real
``RequestPreparer`` whose encode commits to the index as the encoder does."""

from __future__ import annotations

import pickle
import uuid
from dataclasses import dataclass, field
from typing import Any

from encoder_service.cache.cache_client import EncoderCacheClient
from encoder_service.cache.cache_index import CacheIndexShard
from encoder_service.preprocess.media import MediaLimits
from encoder_service.preprocess.prepare import RequestPreparer
from encoder_service.preprocess.prepared import LookedUp
from encoder_service.preprocess.processing import Preprocessor
from encoder_service.types import EmbeddingMeta, EncodeBatch, EncodedItem
from router.journey.model_handles import ModelHandles
from router.journey.orchestrator import Orchestrator
from tests.fakes import Remote


@dataclass
class FakeRef:
    id: str = field(default_factory=lambda: uuid.uuid4().hex)

    def hex(self) -> str:
        return self.id


class CountingShard(CacheIndexShard):
    def __init__(self) -> None:
        super().__init__(10_000, wait_timeout_s=1.0)
        self.fail_lookups = 0  # the next n lookups raise (a shard restarting)

    async def lookup_or_reserve_batch(self, requests: list[tuple[str, list[str]]]) -> list[dict[str, Any]]:
        if self.fail_lookups:
            self.fail_lookups -= 1
            raise ConnectionError("shard restarting")
        return await super().lookup_or_reserve_batch(requests)


class EncoderReplica:
    """The encoder replica's ``prepare``: the real RequestPreparer, encode committing to the index."""

    def __init__(self, model_dir: str, cache: EncoderCacheClient) -> None:
        self.cache = cache
        self.preparer = RequestPreparer(preprocessor(model_dir, cache), cache, self.encode)
        self.prepare_calls: list[LookedUp | None] = []
        self.received: list[Any] = []  # the messages each prepare got, as they would cross the wire
        self.encoded: list[str] = []

    async def encode(self, batch: EncodeBatch) -> list[EncodedItem]:
        out = []
        for inp in batch.inputs:
            self.encoded.append(inp.mm_hash)
            meta = EmbeddingMeta(inp.mm_hash, inp.modality, inp.num_embeds, 8, "float32", inp.grid_thw)
            out.append(EncodedItem(meta, [FakeRef()]))
        await self.cache.commit_many([(e.meta, e.ref[0], batch.request_id) for e in out])
        return out

    async def prepare(
        self, request_id: str, messages: list[dict[str, Any]], looked_up: LookedUp | None = None
    ) -> Any:
        self.prepare_calls.append(looked_up)
        messages = pickle.loads(pickle.dumps(messages))
        self.received.append(messages)
        return await self.preparer.prepare(request_id, messages, looked_up)


def preprocessor(model_dir: str, cache: EncoderCacheClient) -> Preprocessor:
    pre = Preprocessor(model_dir, MediaLimits(), {"image": 4}, 0)
    pre.aliases = cache  # type: ignore[assignment]
    return pre


@dataclass
class Setup:
    orch: Orchestrator
    shard: CountingShard
    replica: EncoderReplica


def make_setup(model_dir: str) -> Setup:
    """An Orchestrator whose hit path and encoder replica share one in-process shard."""
    shard = CountingShard()
    cache = EncoderCacheClient([Remote(shard)])
    replica = EncoderReplica(model_dir, cache)

    async def no_encode(batch: EncodeBatch) -> list[EncodedItem]:
        raise AssertionError("the hit path must not encode")

    hit_path = RequestPreparer(preprocessor(model_dir, cache), cache, no_encode)
    handles = ModelHandles(Remote(replica), None, cache, hit_path)  # type: ignore[arg-type]
    return Setup(Orchestrator(handles, tokenizer=None, block_size=4), shard, replica)
