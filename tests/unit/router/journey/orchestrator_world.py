"""An orchestrator's world without Ray: the real cache client and shard and the real
``RequestPreparer`` run in-process behind a ``.remote`` shim; the encoder fake commits its outputs to
the index as the real one does; the LLM fake runs the real ``resolve_embeddings`` in ``submit``.

Where a lost embedding must fail as Ray fails (an owner that died, a pickled ``EmbeddingsLost``
inside a ``RayTaskError``), the test passes Ray's errors in ``LostErrors``
(``tests/integration/test_orchestrator_lost_embeddings.py``): this module imports no Ray.
"""

from __future__ import annotations

import pickle
import uuid
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from typing import Any

from encoder_service.cache.cache_client import EncoderCacheClient
from encoder_service.cache.cache_index import CacheIndexShard
from encoder_service.preprocess.hashing import compute_mm_hash
from encoder_service.preprocess.prepare import RequestPreparer
from encoder_service.types import (
    EmbeddingMeta,
    EncodeBatch,
    EncodedItem,
    EncoderInput,
    MediaRef,
    PreprocessedRequest,
)
from llm_service.embeddings import EmbeddingsLost, resolve_embeddings
from llm_service.outputs import RequestOutput
from llm_service.request_spec import LLMRequestSpec, SubmitReply
from llm_service.sampling_params import SamplingParams
from mmcore.feature import MediaFeature
from router.journey.model_handles import ModelHandles
from router.journey.orchestrator import Orchestrator
from router.protocol.messages import NormalizedChat
from tests.fakes import Remote

N = 4  # embeddings per image
H1, H2 = (compute_mm_hash("m", "image", data=bytes([i])) for i in (1, 2))


@dataclass(frozen=True)
class LostErrors:
    """What the LLM fake raises where Ray would: a fetch from a dead owner, and ``submit``'s error
    around an ``EmbeddingsLost`` (the handle's, pickled and wrapped)."""

    owner_died: Callable[[str], Exception]
    submit_failed: Callable[[Exception], Exception]


@dataclass
class FakeRef:
    owner: str
    id: str = field(default_factory=lambda: uuid.uuid4().hex)

    def hex(self) -> str:
        return self.id


@dataclass
class World:
    """Encoder replicas are names; killing one makes every ref it owns lost."""

    owner: str = "enc-1"
    dead: set[str] = field(default_factory=set)
    die_after_encode: bool = False
    encoded: list[str] = field(default_factory=list)
    admitted: list[LLMRequestSpec] = field(default_factory=list)


class FakePreprocess:
    """The Preprocessor's contract: hash, ask ``lookup`` which items are cached, process the rest."""

    async def preprocess(
        self, messages: list[dict[str, Any]], lookup: Any = None, *, hashes: Any = None, process: bool = True
    ) -> PreprocessedRequest:
        hashes = [p["hash"] for p in messages[0]["content"]]
        found = await lookup(hashes) if lookup is not None else {}
        items = [
            MediaFeature(
                i,
                "image",
                h,
                1 + i * N,
                N,
                (1, 4, 4),
                data=None if h in found else EncoderInput(h, "image", N, (1, 4, 4)),
            )
            for i, h in enumerate(hashes)
        ]
        return PreprocessedRequest([9] * (1 + N * len(hashes)) + [5], items)


class FakeEncoder:
    """Encodes (a name stands for the tensor) and commits to the index, as EncoderServer does."""

    def __init__(self, world: World, cache: EncoderCacheClient) -> None:
        self.w = world
        self.cache = cache

    async def encode(self, batch: EncodeBatch) -> list[EncodedItem]:
        out = []
        for inp in batch.inputs:
            self.w.encoded.append(inp.mm_hash)
            meta = EmbeddingMeta(inp.mm_hash, "image", inp.num_embeds, 8, "float32", inp.grid_thw)
            out.append(EncodedItem(meta, [FakeRef(self.w.owner)]))
        for e in out:
            await self.cache.commit(e.meta.mm_hash, e.meta, e.ref[0], batch.request_id)
        if self.w.die_after_encode:
            self.w.dead.add(self.w.owner)
        return out


class FakeLLM:
    """The LLMClient surface: ``submit`` fetches the embeddings (real ``resolve_embeddings``).
    ``late``: it does not (their span is prefix-cached, as LLMServer sees it); the first output
    fetches them instead, as a parked request's replica does, and a loss arrives on the stream."""

    def __init__(self, world: World, late: bool = False, errors: LostErrors | None = None) -> None:
        self.w = world
        self.late = late
        self.errors = errors
        self.submits = 0

    async def _fetch_all(self, spec: LLMRequestSpec) -> None:
        async def fetch(ref: FakeRef) -> str:
            if ref.owner in self.w.dead:
                assert self.errors is not None, "a dead owner needs Ray's errors: pass LostErrors"
                raise self.errors.owner_died(ref.hex())
            return ref.owner

        await resolve_embeddings(spec.mm_items, fetch)

    async def submit(self, spec: LLMRequestSpec) -> SubmitReply:
        self.submits += 1
        try:
            if not self.late:
                await self._fetch_all(spec)
        except EmbeddingsLost as e:  # what the router's handle raises: pickled, wrapped
            assert self.errors is not None, "a lost embedding needs Ray's errors: pass LostErrors"
            raise self.errors.submit_failed(pickle.loads(pickle.dumps(e))) from None
        self.w.admitted.append(spec)
        return SubmitReply("llm-0", "ch-0")

    async def outputs(self, request_id: str, reply: SubmitReply) -> AsyncIterator[RequestOutput]:
        spec = [s for s in self.w.admitted if s.request_id == request_id][-1]
        if self.late:
            try:
                await self._fetch_all(spec)
            except EmbeddingsLost as e:  # what a channel batch's error is: pickled
                raise pickle.loads(pickle.dumps(e)) from None
        yield RequestOutput(request_id, [7], None, True, "length", len(spec.prompt_token_ids), 0)


def _build(
    world: World,
    cache: EncoderCacheClient | None = None,
    encoder: Any = None,
    late: bool = False,
    errors: LostErrors | None = None,
) -> tuple[Orchestrator, EncoderCacheClient]:
    cache = cache or EncoderCacheClient([Remote(CacheIndexShard(100, wait_timeout_s=1.0))])
    encoder = encoder or FakeEncoder(world, cache)
    preparer = RequestPreparer(FakePreprocess(), cache, encoder.encode)
    handles = ModelHandles(Remote(preparer), FakeLLM(world, late, errors), cache)  # type: ignore[arg-type]
    return Orchestrator(handles, tokenizer=None, block_size=4), cache


def _chat(*hashes: str) -> NormalizedChat:
    content = [{"type": "image", "hash": h} for h in hashes]
    return NormalizedChat(
        [{"role": "user", "content": content}], [MediaRef("image", data=b"x")] * len(hashes)
    )


async def _prepare(orch: Orchestrator, rid: str, *hashes: str) -> Any:
    prepared = await orch.prepare(rid, _chat(*hashes))
    return orch.stream(rid, prepared, SamplingParams(max_tokens=1))


async def _finish(stream: Any) -> list[RequestOutput]:
    outs = [out async for out in stream]
    return outs
