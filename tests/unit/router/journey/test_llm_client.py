"""LLMClient against a real LLMServer (fake engine, no Ray): a request that runs to its last output is
never aborted on its replica, even when its caller stops reading at that output (as the ingress's SSE
loop does); one whose caller leaves earlier is aborted there. The Serve handle is a shim whose
streaming calls are the server's own async generators, and which counts cancels and ``abort`` calls."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace
from typing import Any

from llm_service.config import EngineConfig
from llm_service.request_spec import LLMRequestSpec, ReplicaTarget
from llm_service.sampling_params import SamplingParams
from llm_service.serve.deployment import LLMServer
from router.journey.llm_client import LLMClient
from tests.unit.llm_service.test_engine_loop import PROMPT, FakeEngine


class _Call:
    """A streaming Serve call: iterate it, or cancel it (the replica's generator is closed)."""

    def __init__(self, handle: FakeLLMHandle, agen: Any) -> None:
        self._handle, self._agen = handle, agen

    def __aiter__(self) -> _Call:
        return self

    async def __anext__(self) -> Any:
        return await self._agen.__anext__()

    def cancel(self) -> None:
        self._handle.cancels += 1
        self._handle.tasks.append(asyncio.ensure_future(self._agen.aclose()))


class FakeLLMHandle:
    def __init__(self, server: LLMServer) -> None:
        self.server = server
        self.aborted: list[str] = []
        self.cancels = 0
        self.tasks: list[asyncio.Future[Any]] = []

    def options(self, **_: Any) -> FakeLLMHandle:
        return self

    @property
    def submit(self) -> Any:
        return SimpleNamespace(remote=lambda spec: _Call(self, self.server.submit(spec)))

    @property
    def channel(self) -> Any:
        return SimpleNamespace(remote=lambda target: _Call(self, self.server.channel(target)))

    @property
    def arrived(self) -> Any:
        return SimpleNamespace(remote=self.server.arrived)

    @property
    def abort(self) -> Any:
        async def abort(target: ReplicaTarget) -> None:
            self.aborted.extend(target.request_ids)
            await self.server.abort(target)

        return SimpleNamespace(remote=abort)


def _spec(rid: str, max_tokens: int) -> LLMRequestSpec:
    return LLMRequestSpec(rid, list(PROMPT), SamplingParams(max_tokens=max_tokens, ignore_eos=True))


async def _settle(handle: FakeLLMHandle) -> None:
    for _ in range(50):  # background drains and aborts run on this loop
        await asyncio.sleep(0.01)
    await asyncio.gather(*handle.tasks, return_exceptions=True)


def _world() -> tuple[LLMServer, FakeLLMHandle, LLMClient]:
    server = LLMServer(
        EngineConfig(model="fake"), "fake", engine_cls=lambda cfg: FakeEngine(), channel_linger_s=0.05
    )
    handle = FakeLLMHandle(server)
    return server, handle, LLMClient(handle, ingress_id="ing-test")


def test_a_caller_that_stops_at_the_last_output_does_not_abort_the_request() -> None:
    async def scenario() -> tuple[list[int], FakeLLMHandle, LLMServer]:
        server, handle, client = _world()
        counts = []
        for i in range(4):
            spec = _spec(f"r{i}", 3)
            reply = await client.submit(spec)
            n = 0
            async for out in client.outputs(spec.request_id, reply):
                n += len(out.new_token_ids)
                if out.finished:
                    break  # what the ingress's SSE loop does: the generator is closed at this output
            counts.append(n)
        await _settle(handle)
        return counts, handle, server

    counts, handle, server = asyncio.run(scenario())
    assert counts == [3, 3, 3, 3]
    assert handle.aborted == [] and handle.cancels == 0  # finished: no abort, no cancelled submit call
    assert not server.engine.has_unfinished_requests()


def test_a_caller_that_leaves_before_the_last_output_aborts_it_on_the_replica() -> None:
    async def scenario() -> tuple[FakeLLMHandle, LLMServer]:
        server, handle, client = _world()
        spec = _spec("early", 10_000)
        reply = await client.submit(spec)
        async for _ in client.outputs(spec.request_id, reply):
            break
        await _settle(handle)
        return handle, server

    handle, server = asyncio.run(scenario())
    # aborted (a second abort may follow, from an output that was already on its way: harmless)
    assert set(handle.aborted) == {"early"} and handle.cancels == 1
    assert not server.engine.has_unfinished_requests()
    assert server.engine.generated["early"] < 10_000


def test_replica_stats_asks_each_replica_it_reads_from_and_reports_one_that_fails() -> None:
    """``/stats?pools=true`` reads each LLM replica's counters through ``replica_stats``: the call names
    its replica (``ReplicaTarget``); a replica that does not answer reports its error, not a 500."""

    async def scenario() -> tuple[dict[str, Any], dict[str, Any], LLMServer]:
        server, handle, client = _world()
        asked: list[str] = []

        def stats(target: ReplicaTarget) -> Any:
            asked.append(target.target_replica)

            async def answer() -> dict[str, Any]:
                return server.stats(target)

            return answer()

        handle.stats = SimpleNamespace(remote=stats)  # type: ignore[attr-defined]
        spec = _spec("s1", 2)
        reply = await client.submit(spec)
        async for out in client.outputs(spec.request_id, reply):
            if out.finished:
                break
        ok = await client.replica_stats()
        assert asked == [server.replica_id]

        async def never() -> dict[str, Any]:
            await asyncio.sleep(60)
            return {}

        handle.stats = SimpleNamespace(remote=lambda target: never())  # type: ignore[attr-defined]
        stuck = await client.replica_stats(timeout_s=0.05)

        async def another() -> dict[str, Any]:  # the replica is gone: Serve's router sent it elsewhere
            return {**server.stats(None), "replica_id": "someone-else"}

        handle.stats = SimpleNamespace(remote=lambda target: another())  # type: ignore[attr-defined]
        gone = await client.replica_stats()
        await _settle(handle)
        return ok, stuck, gone, server

    ok, stuck, gone, server = asyncio.run(scenario())
    rid = server.replica_id
    assert ok[rid]["replica_id"] == rid and ok[rid]["num_total_blocks"] == 128
    assert list(stuck) == [rid] and "TimeoutError" in stuck[rid]["error"]
    assert gone == {rid: {"error": "replica gone (the call reached someone-else)"}}
