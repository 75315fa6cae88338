"""Overlap prefill at the ingress (``Orchestrator.stream`` with ``Prepared.arrivals``): the item
stream is read by the request's forwarder task while the LLM already answers. The first output can
come before the stream's end (its last frame late on a busy host): the stream is then closed only
once the forwarder has let go of it (closing a generator another task is inside is a RuntimeError,
which reached a client as a 500 in CI)."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

from llm_service.outputs import RequestOutput
from llm_service.request_spec import LLMRequestSpec, SubmitReply
from llm_service.sampling_params import SamplingParams
from mmcore.feature import MediaFeature
from router.journey.model_handles import ModelHandles
from router.journey.orchestrator import Orchestrator, Prepared

ITEM = MediaFeature(0, "image", "h0", 1, 4, (1, 4, 4))


class AnsweringLLM:
    """Answers once the request's item has arrived."""

    def __init__(self) -> None:
        self.arrived_items = asyncio.Event()
        self.got: list[MediaFeature] = []

    async def submit(self, spec: LLMRequestSpec) -> SubmitReply:
        return SubmitReply("llm-0", "ch-0")

    async def arrived(self, request_id: str, items: list[MediaFeature], error: object = None) -> None:
        self.got += items
        self.arrived_items.set()

    async def outputs(self, request_id: str, reply: SubmitReply) -> AsyncIterator[RequestOutput]:
        await self.arrived_items.wait()
        yield RequestOutput(request_id, [7], None, True, "length", 6, 0)


class NoCache:
    async def release(self, attempt_id: str) -> None:
        pass


def test_first_output_before_the_item_stream_ends_closes_it_after_the_forwarder() -> None:
    ended = asyncio.Event()
    closed: list[bool] = []

    async def arrivals() -> AsyncIterator[list[MediaFeature]]:
        try:
            yield [ITEM.encoded(["ref"])]
            await ended.wait()  # the end frame, late: never here before the answer
        finally:
            closed.append(True)

    async def main() -> list[RequestOutput]:
        llm = AnsweringLLM()
        handles = ModelHandles(None, llm, NoCache())  # type: ignore[arg-type]
        orch = Orchestrator(handles, tokenizer=None, block_size=4)  # type: ignore[arg-type]
        prepared = Prepared([9, 0, 0, 0, 0, 5], [ITEM.encoded()], arrivals(), "r")
        outs = [o async for o in orch.stream("r", prepared, SamplingParams(max_tokens=1))]
        assert [m.mm_hash for m in llm.got] == ["h0"] and closed == [True]
        assert not orch._forwarders
        return outs

    outs = asyncio.run(main())
    assert [o.new_token_ids for o in outs] == [[7]]


class LinkLost(Exception):
    """Named as the side channel's: ``replica_gone`` matches a lost replica by the class's name."""


class GoneLLM:
    """The request's LLM replica died with the encoder replica (one node): ``arrived`` cannot reach it."""

    def __init__(self) -> None:
        self.failed: list[tuple[str, BaseException]] = []

    async def arrived(self, request_id: str, items: list[MediaFeature], error: object = None) -> None:
        raise LinkLost("could not link to 192.0.2.2:33003: nothing listens there")

    def fail(self, request_id: str, error: BaseException) -> None:
        self.failed.append((request_id, error))


def test_items_lost_with_an_unreachable_llm_replica_fail_the_request_here() -> None:
    """Node loss, seen in the chaos bench: the encoder's item stream breaks and the LLM replica that
    holds the request is gone too. The request must end with the loss here (``EmbeddingsLost``, which
    ``_started`` prepares again), not wait on a channel that never reports: before, it hung until the
    client's deadline."""
    from llm_service.embeddings import EmbeddingsLost

    async def arrivals() -> AsyncIterator[list[MediaFeature]]:
        raise LinkLost("link to the encoder replica broke")
        yield []  # an async generator

    async def main() -> list[tuple[str, BaseException]]:
        llm = GoneLLM()
        handles = ModelHandles(None, llm, NoCache())  # type: ignore[arg-type]
        orch = Orchestrator(handles, tokenizer=None, block_size=4)  # type: ignore[arg-type]
        await orch._forward("r", Prepared([9, 0, 0, 0, 0, 5], [ITEM], arrivals(), "r"))
        return llm.failed

    (failed,) = asyncio.run(main())
    assert failed[0] == "r"
    assert isinstance(failed[1], EmbeddingsLost) and failed[1].mm_hashes == ["h0"]
