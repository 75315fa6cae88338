"""LLMServer does not fetch embeddings its prefix cache already covers, and fetches them after all
when the engine parks the request (the blocks were evicted before it was admitted). A real LLMServer
over the tiny Qwen2-VL engine, no Ray: an embedding ref is an awaitable that counts its awaits (as a
Ray ref is awaited to fetch it)."""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import pytest

from llm_service.config import EngineConfig
from llm_service.request_spec import LLMRequestSpec
from llm_service.serve.deployment import LLMServer
from mmcore.feature import MediaFeature
from router.journey.llm_client import LLMClient
from tests.unit.llm_service.hf_ref import GREEDY, IMG, N, build_case, hf_generate, hf_model, image
from tests.unit.router.journey.test_llm_client import FakeLLMHandle


@pytest.fixture(scope="module")
def case(tiny_vl_dir: Path) -> Any:
    hf, proc = hf_model(tiny_vl_dir)
    c = build_case(hf, proc, f"describe {IMG} please", images=[image(120, 90, 1)])
    return c, hf_generate(hf, c, N)


def _server(tiny_vl_dir: Path) -> LLMServer:
    config = EngineConfig(model=str(tiny_vl_dir), block_size=4, num_kv_blocks=256)
    return LLMServer(config, "tiny", embedding_fetch_timeout_s=5.0, channel_linger_s=0.05)


def _spec(rid: str, case: Any, ref: Any) -> LLMRequestSpec:
    m = case.mm_inputs[0]
    item = MediaFeature(0, m.modality, m.mm_hash, m.offset, m.length, grid_thw=m.grid_thw, ref=[ref])
    return LLMRequestSpec(rid, list(case.prompt), GREEDY, [item])


class Ref:
    """Stands in for a Ray ObjectRef: awaiting it is fetching it."""

    def __init__(self, value: Any) -> None:
        self.value = value
        self.fetches = 0

    def __await__(self) -> Any:
        self.fetches += 1

        async def get() -> Any:
            return self.value

        return get().__await__()


async def _answer(client: LLMClient, spec: LLMRequestSpec) -> list[int]:
    reply = await client.submit(spec)
    tokens: list[int] = []
    async for out in client.outputs(spec.request_id, reply):
        assert out.finish_reason != "error", out.error
        tokens += out.new_token_ids
        if out.finished:
            break
    return tokens


def test_a_repeat_whose_image_is_prefix_cached_is_served_without_fetching_it(case, tiny_vl_dir) -> None:
    c, want = case

    a, b = Ref(c.mm_inputs[0].embeddings), Ref(c.mm_inputs[0].embeddings)

    async def scenario() -> tuple[list[int], list[int], int]:
        server = _server(tiny_vl_dir)
        client = LLMClient(FakeLLMHandle(server), ingress_id="ing")
        first = await _answer(client, _spec("first", c, a))
        again = await _answer(client, _spec("again", c, b))
        return first, again, server.skipped_fetches

    first, again, skipped = asyncio.run(scenario())
    assert first == want and again == want
    assert (a.fetches, b.fetches, skipped) == (1, 0, 1)


def test_a_request_parked_for_want_of_embeddings_gets_them_fetched_and_answers_the_same(
    case, tiny_vl_dir
) -> None:
    """The prefix probe says "cached" but the engine finds nothing at admission (as after an
    eviction): it parks the request, the server fetches the item, the answer is unchanged."""
    c, want = case

    ref = Ref(c.mm_inputs[0].embeddings)

    async def scenario() -> tuple[list[int], int]:
        server = _server(tiny_vl_dir)
        server._cached_prefix_tokens = lambda spec: 1 << 20  # type: ignore[method-assign]
        client = LLMClient(FakeLLMHandle(server), ingress_id="ing")
        tokens = await asyncio.wait_for(_answer(client, _spec("r", c, ref)), 60)
        return tokens, server.skipped_fetches

    tokens, skipped = asyncio.run(scenario())
    assert tokens == want
    assert (skipped, ref.fetches) == (0, 1)  # not fetched at submit; fetched when the engine parked it


class LostRef(Ref):
    def __await__(self) -> Any:
        self.fetches += 1

        async def get() -> Any:
            raise TimeoutError("the object's owner is gone")

        return get().__await__()


def test_a_parked_request_whose_fetch_finds_the_object_lost_fails_with_embeddings_lost(
    case, tiny_vl_dir
) -> None:
    """The router re-encodes on EmbeddingsLost (tests/integration/test_orchestrator_lost_embeddings.py);
    here: the replica says so on the stream, and keeps nothing of the request."""
    from llm_service.embeddings import EmbeddingsLost

    c, _ = case
    ref = LostRef(None)

    async def scenario() -> tuple[BaseException | None, LLMServer]:
        server = _server(tiny_vl_dir)
        server._cached_prefix_tokens = lambda spec: 1 << 20  # type: ignore[method-assign]
        client = LLMClient(FakeLLMHandle(server), ingress_id="ing")
        err: BaseException | None = None
        try:
            await asyncio.wait_for(_answer(client, _spec("r", c, ref)), 60)
        except EmbeddingsLost as e:
            err = e
        for _ in range(500):  # the abort is applied by the engine loop, between steps
            if not server.engine.scheduler.requests:
                break
            await asyncio.sleep(0.01)
        return err, server

    err, server = asyncio.run(scenario())
    assert isinstance(err, EmbeddingsLost) and err.mm_hashes == [c.mm_inputs[0].mm_hash]
    assert ref.fetches == 1 and not server._unfetched
    eng = server.engine
    assert not eng.scheduler.requests and not eng.scheduler.parked
    assert eng.stats().num_free_blocks == eng.stats().num_total_blocks


class HangingRef(Ref):
    """An object whose fetch never ends (its node is unreachable)."""

    def __await__(self) -> Any:
        self.fetches += 1
        return asyncio.get_running_loop().create_future().__await__()


def test_a_fetch_past_embedding_fetch_timeout_s_is_embeddings_lost_at_submit(case, tiny_vl_dir) -> None:
    """Nothing cached: the item is fetched at submit, and a fetch that does not end within the
    timeout fails the submit with EmbeddingsLost (which the router re-encodes), leaving nothing."""
    from llm_service.embeddings import EmbeddingsLost

    c, _ = case
    ref = HangingRef(None)

    async def scenario() -> tuple[BaseException | None, LLMServer]:
        config = EngineConfig(model=str(tiny_vl_dir), block_size=4, num_kv_blocks=256)
        server = LLMServer(config, "tiny", embedding_fetch_timeout_s=0.2, channel_linger_s=0.05)
        client = LLMClient(FakeLLMHandle(server), ingress_id="ing")
        err: BaseException | None = None
        try:
            await asyncio.wait_for(_answer(client, _spec("r", c, ref)), 30)
        except EmbeddingsLost as e:
            err = e
        return err, server

    err, server = asyncio.run(scenario())
    assert isinstance(err, EmbeddingsLost) and err.mm_hashes == [c.mm_inputs[0].mm_hash]
    assert ref.fetches == 1 and not server.engine.scheduler.requests
    eng = server.engine
    assert eng.stats().num_free_blocks == eng.stats().num_total_blocks


def test_the_probe_reuses_the_routers_block_hashes_and_a_wrong_one_only_misses(case, tiny_vl_dir) -> None:
    """The router's hashes (what it routes by) serve the probe; hashes that are not this engine's
    blocks cannot make a false hit: the item is fetched, the answer unchanged."""
    from dataclasses import replace

    from llm_service.prefix_hash import compute_block_hashes

    c, want = case
    refs = [Ref(c.mm_inputs[0].embeddings) for _ in range(3)]

    def spec(rid: str, ref: Ref, hashes: list[bytes]) -> LLMRequestSpec:
        return replace(_spec(rid, c, ref), block_hashes=hashes)

    m = c.mm_inputs[0]
    right = compute_block_hashes(list(c.prompt), [(m.offset, m.length, m.mm_hash)], 4)
    wrong = [bytes(32)] * len(right)

    async def scenario() -> list[list[int]]:
        server = _server(tiny_vl_dir)
        client = LLMClient(FakeLLMHandle(server), ingress_id="ing")
        out = [await _answer(client, spec("first", refs[0], right))]
        out.append(await _answer(client, spec("right", refs[1], right)))
        out.append(await _answer(client, spec("wrong", refs[2], wrong)))
        return out

    answers = asyncio.run(scenario())
    assert answers == [want, want, want]
    assert [r.fetches for r in refs] == [1, 0, 1]
