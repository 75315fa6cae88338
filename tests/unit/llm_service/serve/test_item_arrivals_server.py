"""LLMServer with a request submitted before its items are encoded (overlap prefill): the ingress's
``LLMClient.arrived`` hands it each item as its encode commits, in any order, and the answer is
transformers'; an encode that fails, an item it was not waiting for, or an object lost on the way
fails the request with that error and leaves the engine holding nothing. A real LLMServer over the
tiny Qwen2-VL engine, no Ray (a ref is an awaitable, as a Ray ObjectRef is awaited to fetch it)."""

from __future__ import annotations

import asyncio
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest

from llm_service.embeddings import EmbeddingsLost
from llm_service.request_spec import LLMRequestSpec
from llm_service.serve.deployment import LLMServer
from mmcore.feature import MediaFeature
from router.journey.llm_client import LLMClient
from tests.unit.llm_service.hf_ref import GREEDY, IMG, N, build_case, hf_generate, hf_model, image
from tests.unit.llm_service.serve.test_unfetched_embeddings import LostRef, Ref, _server
from tests.unit.router.journey.test_llm_client import FakeLLMHandle


@pytest.fixture(scope="module")
def case(tiny_vl_dir: Path) -> Any:
    hf, proc = hf_model(tiny_vl_dir)
    c = build_case(hf, proc, f"a {IMG} and b {IMG} compare", images=[image(64, 48, 2), image(90, 120, 3)])
    return c, hf_generate(hf, c, N)


def _items(case: Any) -> list[MediaFeature]:
    """The request's items with their refs (what each arrival carries)."""
    return [
        MediaFeature(
            0, m.modality, m.mm_hash, m.offset, m.length, grid_thw=m.grid_thw, ref=[Ref(m.embeddings)]
        )
        for m in sorted(case.mm_inputs, key=lambda m: m.offset)
    ]


def _pending_spec(rid: str, case: Any) -> LLMRequestSpec:
    return LLMRequestSpec(rid, list(case.prompt), GREEDY, [replace(it, ref=[]) for it in _items(case)])


async def _collect(client: LLMClient, rid: str, reply: Any) -> list[int]:
    tokens: list[int] = []
    async for out in client.outputs(rid, reply):
        assert out.finish_reason != "error", out.error
        tokens += out.new_token_ids
    return tokens


async def _until_waiting(server: LLMServer, rid: str, offset: int) -> None:
    for _ in range(500):
        req = server.engine.scheduler.requests.get(rid)
        if req is not None and req.num_computed_tokens == offset:
            return
        await asyncio.sleep(0.01)
    raise AssertionError(f"{rid} never computed up to {offset}")


async def _engine_empty(server: LLMServer) -> None:
    for _ in range(500):  # the abort is applied by the engine loop, between steps
        if not server.engine.scheduler.requests:
            break
        await asyncio.sleep(0.01)
    eng = server.engine
    assert not eng.scheduler.requests and not eng.scheduler.parked and not eng.scheduler.running
    assert eng.stats().num_free_blocks == eng.stats().num_total_blocks


def test_items_arriving_last_first_give_hf_s_answer(case: Any, tiny_vl_dir: Path) -> None:
    c, want = case

    async def scenario() -> list[int]:
        server = _server(tiny_vl_dir)
        client = LLMClient(FakeLLMHandle(server), ingress_id="ing")
        first, second = _items(c)
        reply = await client.submit(_pending_spec("r", c))
        answer = asyncio.ensure_future(_collect(client, "r", reply))
        await _until_waiting(server, "r", first.offset)  # its text is computed before any item comes
        await client.arrived("r", [second])
        await asyncio.sleep(0.05)
        assert server.engine.scheduler.requests["r"].num_computed_tokens == first.offset
        await client.arrived("r", [first])
        tokens = await asyncio.wait_for(answer, 60)
        await _engine_empty(server)
        return tokens

    assert asyncio.run(scenario()) == want


@pytest.mark.parametrize("how", ["encode failed", "unknown offset", "object lost"])
def test_a_failed_arrival_fails_the_request_and_frees_everything(
    case: Any, tiny_vl_dir: Path, how: str
) -> None:
    c, _ = case

    async def scenario() -> BaseException:
        server = _server(tiny_vl_dir)
        client = LLMClient(FakeLLMHandle(server), ingress_id="ing")
        first, second = _items(c)
        reply = await client.submit(_pending_spec("r", c))
        answer = asyncio.ensure_future(_collect(client, "r", reply))
        await client.arrived("r", [first])
        await _until_waiting(server, "r", second.offset)
        if how == "encode failed":
            await client.arrived("r", [], RuntimeError("the tower failed on image 1"))
        elif how == "unknown offset":
            await client.arrived("r", [replace(second, offset=second.offset + 1)])
        else:
            await client.arrived("r", [replace(second, ref=[LostRef(None)])])
        with pytest.raises(Exception) as e:
            await asyncio.wait_for(answer, 60)
        await _engine_empty(server)
        assert not server._arriving
        return e.value

    err = asyncio.run(scenario())
    if how == "encode failed":
        assert isinstance(err, RuntimeError) and "tower failed" in str(err)
    elif how == "unknown offset":
        assert isinstance(err, ValueError) and "no item still to come" in str(err)
    else:
        assert isinstance(err, EmbeddingsLost) and err.mm_hashes == [_items(c)[1].mm_hash]
