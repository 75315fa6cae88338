"""The LLM replica's output channel over a direct link (no Ray): a real LLMServer (fake engine whose
tokens count up per request) served by a real LinkServer on loopback ZeroMQ, read by a real
LLMClient through PoolLinks. Concurrent requests get every token in order over the link, and Serve's
channel call is not made (it is for a request submitted through Serve); an ingress that leaves its channel, or whose connection vanishes, gets its
requests aborted on the replica and their KV blocks freed."""

from __future__ import annotations

import asyncio
import contextlib
from typing import Any

from cluster.replica_links import DirectLLM
from llm_service.config import EngineConfig
from llm_service.outputs import RequestOutput
from llm_service.request_spec import LLMRequestSpec, ReplicaTarget
from llm_service.sampling_params import SamplingParams
from llm_service.serve.deployment import LLMServer
from mmcore.link.direct_link import DirectLink, LinkClient, LinkKeys, LinkServer
from mmcore.link.pool_links import Address, PoolLinks
from router.journey.llm_client import LLMClient
from tests.unit.llm_service.test_engine_loop import PROMPT, FakeEngine
from tests.unit.router.journey.test_llm_client import FakeLLMHandle

KEYS = LinkKeys.generate()


class CountingEngine(FakeEngine):
    """Request ``r``'s k-th token is ``100 + k``: an output out of order or missing shows."""

    def step(self) -> list[RequestOutput]:
        sched = self.scheduler.schedule()
        sampled = {c.request.request_id: (7, None) for c in sched.chunks if c.samples}
        outputs = []
        for req in self.scheduler.update(sched, sampled):
            token = 100 + self.generated[req.request_id]
            self.generated[req.request_id] += 1
            reason = req.status.value if req.is_finished else None
            outputs.append(RequestOutput(req.request_id, [token], None, req.is_finished, reason, 10, 0))
        return outputs


class Replica(LLMServer, DirectLLM):
    pass


class ServeHandle(FakeLLMHandle):
    """Serve's handle, counting the streaming ``channel`` calls made through it."""

    channel_calls = 0

    @property
    def channel(self) -> Any:
        self.channel_calls += 1
        return super().channel


class OneReplica:
    """The pool's router: one replica, at ``address``."""

    def __init__(self, uid: str, address: Address) -> None:
        self.uid, self.address = uid, address

    def choose_linked(self, args: tuple[Any, ...]) -> tuple[str, Address] | None:
        return self.uid, self.address

    def linked_routed(self, request_id: str, replica_uid: str, args: tuple[Any, ...]) -> None:
        pass

    def linked_done(self, request_id: str) -> None:
        pass

    def live_uids(self) -> set[str]:
        return {self.uid}


async def _replica() -> tuple[Replica, LinkServer, Address]:
    server = Replica(
        EngineConfig(model="fake"), "fake", engine_cls=lambda cfg: CountingEngine(), channel_linger_s=0.05
    )
    handlers = {name: getattr(server, attr) for name, attr in Replica.DIRECT_METHODS.items()}
    link_server = LinkServer(handlers, KEYS)
    return server, link_server, await link_server.address("127.0.0.1")


def _spec(rid: str, max_tokens: int) -> LLMRequestSpec:
    return LLMRequestSpec(rid, list(PROMPT), SamplingParams(max_tokens=max_tokens, ignore_eos=True))


async def _until_idle(server: Replica) -> None:
    for _ in range(500):
        kv = server.engine.kv
        if not server.engine.has_unfinished_requests() and kv.num_free_blocks == kv.num_total_blocks:
            return
        await asyncio.sleep(0.01)
    raise AssertionError("requests still running or KV blocks still held")


def test_concurrent_requests_stream_every_token_in_order_over_the_link() -> None:
    async def scenario() -> None:
        server, link_server, address = await _replica()

        def connect(a: Address) -> DirectLink:
            async def locate() -> Address:
                return a

            return DirectLink(locate, KEYS)

        router: OneReplica | None = OneReplica(server.replica_id, address)
        links = PoolLinks(lambda: router, connect)
        handle = ServeHandle(server)
        client = LLMClient(handle, ingress_id="ing-link", links=links)

        async def run(i: int) -> list[int]:
            tokens = []
            async for out in client.stream(_spec(f"r{i}", 5 + 3 * i)):
                tokens += out.new_token_ids
            return tokens

        got = await asyncio.gather(*(run(i) for i in range(6)))
        assert got == [list(range(100, 105 + 3 * i)) for i in range(6)]
        assert handle.channel_calls == 0 and client.linked_channels >= 1
        assert server.linked_channel_batches > 0 and link_server.items == server.linked_channel_batches
        router = None  # no link known (Serve's fallback): submitted and read through Serve, the link open
        assert await run(9) == list(range(100, 132))
        assert handle.channel_calls == 1 and link_server.items == server.linked_channel_batches
        await _until_idle(server)
        await client.close()
        links.close()
        await link_server.close()

    asyncio.run(scenario())


def test_an_ingress_that_leaves_or_vanishes_gets_its_requests_aborted_and_blocks_freed() -> None:
    async def scenario() -> None:
        server, link_server, (host, port) = await _replica()
        for leave in ("cancel", "vanish"):
            ingress = await LinkClient.connect(host, port, KEYS)
            replies = [await ingress.call("submit", _spec(f"{leave}-{i}", 100_000)) for i in range(3)]
            assert len({r.channel_id for r in replies}) == 1  # one channel per ingress
            target = ReplicaTarget(server.replica_id, channel_id=replies[0].channel_id)
            batches = ingress.stream("channel", target)
            seen: set[str] = set()
            while len(seen) < 3:  # every request is generating
                seen |= {o.request_id for o in (await anext(batches)).outputs}
            assert server.engine.kv.num_free_blocks < server.engine.kv.num_total_blocks
            if leave == "cancel":  # the reader closes its stream: a cancel frame
                await batches.aclose()
                ingress.close()
            else:  # the ingress process dies: its connection drops without a word
                ingress.close()
                with contextlib.suppress(Exception):
                    await batches.aclose()
            await _until_idle(server)
            assert all(server.engine.generated[f"{leave}-{i}"] < 100_000 for i in range(3))
        assert len(server.channels) == 0
        await link_server.close()

    asyncio.run(scenario())
