"""Forwarding (router/forwarding.py): the replica that prepared a media request submits it to the LLM
pool itself, and the ingress adopts it. Orchestrator, LLMClient, PreparedForwarder and a real
LLMServer (fake engine, no Ray) together; the Serve handles are shims over the server's own methods
(tests/unit/router/test_llm_client.py), the preparing pool a shim that answers a fixed prompt and
forwards through a real ``PreparedForwarder`` when asked to, as ``PreparingEncoderServer`` does."""

from __future__ import annotations

import asyncio
import pickle
from dataclasses import replace
from types import SimpleNamespace
from typing import Any

import pytest

from encoder_service.prepared import PreparedItem, PreparedRequest
from encoder_service.types import MediaRef
from llm_service.errors import RequestRejected
from llm_service.request_spec import LLMRequestSpec
from llm_service.sampling_params import SamplingParams
from router.errors import APIError
from router.forwarding import ForwardRequest, PreparedForwarder, request_spec
from router.llm_client import LLMClient
from router.messages import NormalizedChat
from router.model_handles import ModelHandles
from router.orchestrator import Orchestrator
from router.prefix_affinity import deployment_key, shared_index
from router.protocol import ChatCompletionRequest
from router.sampling import request_sampling_params, requested_max_tokens, to_sampling_params
from tests.unit.llm.test_engine_loop import PROMPT
from tests.unit.router.test_llm_client import FakeLLMHandle, _settle, _world

MAX_MODEL_LEN = 64
BLOCK = 4


class ForwardingLLMHandle(FakeLLMHandle):
    """Adds ``submit_detached`` (a unary call) and a deployment id, as a Serve handle has."""

    deployment_id = SimpleNamespace(app_name="test", name=f"LLM-{id(object())}")

    def __init__(self, server: Any, refuse: BaseException | None = None) -> None:
        super().__init__(server)
        self.refuse = refuse
        self.detached: list[LLMRequestSpec] = []

    @property
    def submit_detached(self) -> Any:
        async def call(spec: LLMRequestSpec) -> Any:
            if self.refuse is not None:
                raise self.refuse
            self.detached.append(spec)
            return await self.server.submit_detached(spec)

        return SimpleNamespace(remote=call)


class PreparingPool:
    """``prepare`` as an encoder replica with a forwarder answers it: a fixed prompt, forwarded."""

    def __init__(self, forwarder: PreparedForwarder, prompt: list[int]) -> None:
        self.forwarder, self.prompt = forwarder, prompt
        self.calls: list[tuple[Any, ...]] = []

    @property
    def prepare(self) -> Any:
        async def call(aid: str, messages: Any, looked_up: Any = None, forward: Any = None) -> Any:
            self.calls.append((aid, looked_up, forward))
            pre = PreparedRequest(list(self.prompt), [], 0, {})
            if forward is None:
                return pre
            return replace(pre, forwarded_to=await self.forwarder.forward(pre, forward))

        return SimpleNamespace(remote=call)


def _chat() -> NormalizedChat:
    return NormalizedChat([{"role": "user", "content": [{"type": "image"}]}], [MediaRef("image", data=b"x")])


def _request(**kw: Any) -> ChatCompletionRequest:
    return ChatCompletionRequest.model_validate(
        {"model": "m", "messages": [{"role": "user", "content": "hi"}], "ignore_eos": True, **kw}
    )


def _forward(req: ChatCompletionRequest) -> ForwardRequest:
    return ForwardRequest("", "", request_sampling_params(req), requested_max_tokens(req))


def _setup(prompt: list[int] = PROMPT, refuse: BaseException | None = None) -> Any:
    server, _, _ = _world()
    handle = ForwardingLLMHandle(server, refuse)
    client = LLMClient(handle, ingress_id="ing-test")
    pool = PreparingPool(PreparedForwarder(handle, BLOCK, MAX_MODEL_LEN), prompt)
    handles = ModelHandles(pool, client, cache=None, forward=True)  # type: ignore[arg-type]
    orch = Orchestrator(handles, tokenizer=None, block_size=BLOCK, max_model_len=MAX_MODEL_LEN)
    return SimpleNamespace(server=server, handle=handle, client=client, pool=pool, orch=orch)


async def _answer(w: Any, rid: str, req: ChatCompletionRequest, stop_after: int | None = None) -> list[int]:
    """What the ingress does with a request (``ChatService._answer``), forget() on every way out."""
    try:
        prepared = await w.orch.prepare(rid, _chat(), _forward(req))
        params = to_sampling_params(req, len(prepared.prompt_token_ids), MAX_MODEL_LEN)
        tokens: list[int] = []
        stream = w.orch.stream(rid, prepared, params)
        async for out in stream:
            tokens += out.new_token_ids
            if stop_after is not None and len(tokens) >= stop_after:
                break
        await stream.aclose()
        return tokens
    finally:
        w.orch.forget(rid)


def test_a_forwarded_request_is_submitted_by_the_preparing_replica_and_read_by_the_ingress() -> None:
    async def scenario() -> tuple[Any, list[int]]:
        w = _setup()
        tokens = await _answer(w, "r1", _request(max_tokens=5))
        await _settle(w.handle)
        return w, tokens

    w, tokens = asyncio.run(scenario())
    assert len(tokens) == 5
    assert [s.request_id for s in w.handle.detached] == ["r1"]  # submitted once, by the replica
    spec = w.handle.detached[0]
    assert spec.ingress_id == "ing-test"  # on this ingress's channel
    assert w.pool.forwarder.stats() == {"forwarded_submits": 1, "declined_forwards": 0}
    assert w.handle.aborted == [] and not w.server.engine.has_unfinished_requests()
    assert w.client._expected == set() and w.client._queues == {}
    # The ingress's prefix-affinity index learned where it went (its own router did not route it).
    index = shared_index(deployment_key(w.handle.deployment_id))
    replica = w.server.replica_id
    assert index.matched_blocks(spec.block_hashes, [replica])[replica] == len(PROMPT) // BLOCK


def test_the_forwarded_params_are_the_ones_the_ingress_computes() -> None:
    """max_tokens is the rest of max_model_len unless asked: the replica fits it to the prompt it made."""

    async def scenario(req: ChatCompletionRequest) -> LLMRequestSpec:
        w = _setup()
        await _answer(w, "r", req, stop_after=1)
        await _settle(w.handle)
        return w.handle.detached[0]

    rest = SamplingParams(max_tokens=MAX_MODEL_LEN - len(PROMPT), temperature=1.0, ignore_eos=True)
    asked = SamplingParams(max_tokens=7, temperature=0.5, top_k=3, seed=11, ignore_eos=True)
    for req, expected in (
        (_request(), rest),
        (_request(max_tokens=7, temperature=0.5, top_k=3, seed=11), asked),
    ):
        spec = asyncio.run(scenario(req))
        assert (
            spec.sampling_params == expected
        )  # written out by hand: the OpenAI defaults, the rest of the window
        assert spec.sampling_params == to_sampling_params(req, len(PROMPT), MAX_MODEL_LEN)
        ours = request_spec("r", list(PROMPT), [], spec.sampling_params, BLOCK, ingress_id="ing-test")
        assert spec == ours and list(spec.block_hashes) == list(ours.block_hashes)


def test_outputs_that_arrive_before_the_reply_are_kept() -> None:
    """The replica's reply can come after the first tokens (they travel another way): none is lost."""

    async def scenario() -> tuple[Any, list[int]]:
        w = _setup()
        prepared = await w.orch.prepare("r", _chat(), _forward(_request(max_tokens=4)))
        assert prepared.forwarded_to is not None
        # Let the request run to its end on the replica before the ingress adopts it.
        while w.server.engine.has_unfinished_requests():
            await asyncio.sleep(0.01)
        params = to_sampling_params(_request(max_tokens=4), len(prepared.prompt_token_ids), MAX_MODEL_LEN)
        tokens = [t async for out in w.orch.stream("r", prepared, params) for t in out.new_token_ids]
        w.orch.forget("r")
        await _settle(w.handle)
        return w, tokens

    w, tokens = asyncio.run(scenario())
    assert len(tokens) == 4 and w.handle.aborted == []


def test_a_client_that_leaves_a_forwarded_request_aborts_it_on_its_replica() -> None:
    async def scenario() -> Any:
        w = _setup()
        await _answer(w, "early", _request(max_tokens=MAX_MODEL_LEN - len(PROMPT)), stop_after=1)
        await _settle(w.handle)
        return w

    w = asyncio.run(scenario())
    assert set(w.handle.aborted) == {"early"}  # by name: no call of the ingress's was open to cancel
    assert not w.server.engine.has_unfinished_requests()
    assert w.server.engine.generated["early"] < MAX_MODEL_LEN - len(PROMPT)
    assert w.client._queues == {}


def test_a_forwarded_request_the_ingress_never_adopts_is_aborted() -> None:
    """The ingress fails between ``prepare`` and ``stream`` (a 400 of its own, a deadline): forget()
    aborts what the replica submitted, and frees its KV blocks."""

    async def scenario() -> Any:
        w = _setup()
        req = _request(max_tokens=MAX_MODEL_LEN - len(PROMPT))
        prepared = await w.orch.prepare("lost", _chat(), _forward(req))
        assert prepared.forwarded_to is not None
        w.orch.forget("lost")
        await _settle(w.handle)
        return w

    w = asyncio.run(scenario())
    assert w.handle.aborted == ["lost"]
    assert not w.server.engine.has_unfinished_requests()
    kv = w.server.engine.kv
    assert kv.num_free_blocks == kv.num_total_blocks
    assert w.client._queues == {} and w.client._expected == set()


def test_what_cannot_be_forwarded_is_submitted_by_the_ingress_with_the_same_answer() -> None:
    """A prompt past max_model_len: the replica does not submit, and the ingress answers the 400."""

    async def too_long() -> None:
        w = _setup(prompt=list(range(MAX_MODEL_LEN)))
        with pytest.raises(APIError) as err:
            await _answer(w, "long", _request())
        assert err.value.code == "prompt_too_long"
        assert w.handle.detached == [] and w.pool.forwarder.declined == 1
        assert w.client._queues == {} and w.client._expected == set()

    asyncio.run(too_long())

    async def refused() -> Any:  # the LLM pool refuses the forwarded submit: the ingress submits
        w = _setup(refuse=RequestRejected("queue_full", "the waiting queue is full"))
        tokens = await _answer(w, "r", _request(max_tokens=3))
        await _settle(w.handle)
        return w, tokens

    w, tokens = asyncio.run(refused())
    assert len(tokens) == 3 and w.pool.forwarder.declined == 1 and w.handle.detached == []
    assert not w.server.engine.has_unfinished_requests()


def test_a_retried_prepare_does_not_forward() -> None:
    """Only the first call forwards: a replica that died after submitting must not have a twin."""

    async def scenario() -> Any:
        w = _setup()
        pool = w.pool
        real = pool.prepare.remote

        async def dies_once(aid: str, messages: Any, *args: Any) -> Any:
            if not pool.calls:
                pool.calls.append((aid, None, None))
                raise ActorDiedError("the replica died")
            return await real(aid, messages, *args)

        w.orch.h.preprocess = SimpleNamespace(prepare=SimpleNamespace(remote=dies_once))
        w.orch.h.cache = SimpleNamespace(release=_noop)
        tokens = await _answer(w, "r", _request(max_tokens=2))
        await _settle(w.handle)
        return w, tokens

    w, tokens = asyncio.run(scenario())
    assert len(tokens) == 2
    assert [c[2] for c in w.pool.calls][1:] == [None]  # the retry carried no ForwardRequest
    assert w.handle.detached == []


class ActorDiedError(RuntimeError):
    """Named as Ray's: router.errors.replica_gone matches by name."""


async def _noop(*_: Any) -> None:
    return None


def test_wire_forms_round_trip() -> None:
    fwd = ForwardRequest("r", "ing", SamplingParams(max_tokens=3, temperature=0.2, seed=5), 3, "salt")
    assert pickle.loads(pickle.dumps(fwd)) == fwd
    item = PreparedItem("h", "image", 2, 4, (1, 4, 4), ref=["REF"])
    pre = PreparedRequest([1, 2, 3], [item], 1, {"x": 1}, forwarded_to=("replica", "chan"))
    back = pickle.loads(pickle.dumps(pre))
    assert back == pre and back.forwarded_to == ("replica", "chan") and back.items[0].ref == ["REF"]
    assert pickle.loads(pickle.dumps(replace(pre, forwarded_to=None))).forwarded_to is None
