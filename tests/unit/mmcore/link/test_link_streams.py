"""Streams on a direct link (mmcore/link/server.py, client.py) on real loopback ZeroMQ sockets:
many items per call in order, interleaved streams, an error after items, the reader leaving or its
connection vanishing (the generator is closed on the server), a reader that does not read (the
generator is not resumed: bounded), the server going away (``LinkLost`` mid-stream)."""

from __future__ import annotations

import asyncio
import contextlib
import pickle
from collections.abc import AsyncIterator
from typing import Any

import msgpack
import pytest
import zmq
import zmq.asyncio

from mmcore.link.direct_link import BadFrame, DirectLink, LinkClient, LinkKeys, LinkLost, LinkServer
from mmcore.link.frames import MORE, OK

KEYS = LinkKeys.generate()


class Boom(ValueError):
    pass


class Counting:
    """Handlers whose generators record how far they got and whether they were closed."""

    def __init__(self) -> None:
        self.made: dict[str, int] = {}
        self.closed: set[str] = set()
        self.tick = asyncio.Event()

    async def count(
        self, name: str, n: int, fail_at: int | None = None, pad: int = 0
    ) -> AsyncIterator[tuple[Any, ...]]:
        self.made[name] = 0
        try:
            for i in range(n):
                if i == fail_at:
                    raise Boom(f"{name} broke at {i}")
                self.made[name] = i + 1
                yield (name, i, bytes(pad)) if pad else (name, i)
                await asyncio.sleep(0)  # let the other streams interleave
        finally:
            self.closed.add(name)

    async def endless(self, name: str) -> AsyncIterator[int]:
        self.made[name] = 0
        try:
            while True:
                self.made[name] += 1
                yield self.made[name]
                await asyncio.sleep(0.001)
        finally:
            self.closed.add(name)


def _server(h: Counting, **options: Any) -> LinkServer:
    async def plain() -> str:
        return "plain"

    return LinkServer({"count": h.count, "endless": h.endless, "plain": plain}, KEYS, **options)


async def _until(cond: Any, what: str) -> None:
    for _ in range(500):
        if cond():
            return
        await asyncio.sleep(0.01)
    raise AssertionError(f"never: {what}")


def test_concurrent_streams_arrive_whole_and_in_order_and_an_error_ends_its_own() -> None:
    async def run() -> None:
        h = Counting()
        server = _server(h)
        host, port = await server.address("127.0.0.1")
        client = await LinkClient.connect(host, port, KEYS)

        async def take(name: str, n: int) -> list[tuple[str, int]]:
            return [item async for item in client.stream("count", name, n)]

        got = await asyncio.gather(*(take(f"s{k}", 50 + k) for k in range(8)))
        assert got == [[(f"s{k}", i) for i in range(50 + k)] for k in range(8)]
        seen: list[Any] = []
        with pytest.raises(Boom, match="bad broke at 3"):
            async for item in client.stream("count", "bad", 10, 3):
                seen.append(item)
        assert seen == [("bad", i) for i in range(3)]
        assert server.items == sum(50 + k for k in range(8)) + 3 and not server._running
        with pytest.raises(BadFrame, match="answers a stream"):  # a stream read as a call: an error
            await client.call("count", "x", 1)
        assert await client.call("plain") == "plain"
        client.close()
        await server.close()

    asyncio.run(run())


def test_a_reader_that_leaves_or_whose_connection_vanishes_closes_the_generator() -> None:
    async def run() -> None:
        h = Counting()
        server = _server(h)
        host, port = await server.address("127.0.0.1")
        client = await LinkClient.connect(host, port, KEYS)
        async with contextlib.aclosing(client.stream("endless", "left")) as items:
            assert [await anext(items) for _ in range(3)] == [1, 2, 3]
        await _until(lambda: "left" in h.closed, "the generator of a reader that left is closed")
        # a DirectLink whose connection is dropped without a word (the ingress process died)
        link = DirectLink(lambda: server.address("127.0.0.1"), KEYS)
        items = link.stream("endless", "vanished")
        assert await anext(items) == 1
        link.close()
        with pytest.raises(LinkLost):
            await anext(items)
        await _until(lambda: "vanished" in h.closed, "the generator of a vanished reader is closed")
        await _until(lambda: not server._running, "no stream left running")
        client.close()
        await server.close()

    asyncio.run(run())


def test_a_reader_that_does_not_read_holds_the_generator_and_then_gets_every_item_in_order() -> None:
    """A raw DEALER that reads nothing: once the queues are full the generator is not resumed (what it
    would make waits in it, as the output channel coalesces steps); when the reader reads, every
    item arrives, in order, then the end."""

    async def run() -> None:
        h = Counting()
        server = _server(h, hwm=4, reply_patience_s=600)
        host, port = await server.address("127.0.0.1")
        ctx = zmq.asyncio.Context()
        sock = ctx.socket(zmq.DEALER)
        sock.setsockopt(zmq.LINGER, 0)
        sock.setsockopt(zmq.RCVHWM, 4)
        sock.setsockopt(zmq.RCVBUF, 4096)
        sock.setsockopt(zmq.CURVE_SERVERKEY, KEYS.server_public)
        sock.setsockopt(zmq.CURVE_PUBLICKEY, KEYS.client_public)
        sock.setsockopt(zmq.CURVE_SECRETKEY, KEYS.client_secret)
        sock.connect(f"tcp://{host}:{port}")
        n = 4000  # 64 KiB each: past what the sockets' buffers hold
        await sock.send_multipart(
            [msgpack.packb([1, "count", None]), pickle.dumps(("slow", n, None, 64 << 10))]
        )
        await _until(lambda: h.made.get("slow", 0) > 0, "the stream started")
        held = -1
        for _ in range(60):  # until the buffers are full and the generator stops
            await asyncio.sleep(0.5)
            if h.made["slow"] == held:
                break
            held = h.made["slow"]
        assert h.made["slow"] == held < n // 10, "the generator ran on while nobody read"
        got = []
        while True:
            frames = await asyncio.wait_for(sock.recv_multipart(), 10)
            seq, status = msgpack.unpackb(frames[0])[:2]
            assert seq == 1
            if status != MORE:
                assert status == OK
                break
            got.append(pickle.loads(frames[1])[1])
        assert got == list(range(n)) and "slow" in h.closed
        sock.close(0)
        ctx.term()
        await server.close()

    asyncio.run(run())


def test_a_server_that_goes_away_mid_stream_fails_it_with_link_lost() -> None:
    async def run() -> None:
        h = Counting()
        server = _server(h)
        link = DirectLink(lambda: server.address("127.0.0.1"), KEYS)
        items = link.stream("endless", "doomed")
        assert await anext(items) == 1
        await server.close()
        with pytest.raises(LinkLost):
            while True:
                await asyncio.wait_for(anext(items), 10)
        assert link.losses == 1 and not link.usable()
        link.close()

    asyncio.run(run())


def test_a_retired_link_lets_its_running_stream_finish_and_takes_no_new_calls() -> None:
    """What ``PoolLinks.forget`` does to the link of a replica that left the pool's set (it drains)."""

    async def run() -> None:
        h = Counting()
        server = _server(h)
        link = DirectLink(lambda: server.address("127.0.0.1"), KEYS)
        items = link.stream("endless", "draining")
        assert await anext(items) == 1
        client = link._client
        assert client is not None
        link.retire()
        assert not link.usable()
        assert [await anext(items) for _ in range(20)] == list(range(2, 22))
        assert client.lost is None  # the connection stays for the stream
        await items.aclose()
        assert client.lost is not None  # closed once the stream ended
        await _until(lambda: "draining" in h.closed and not server._running, "the stream ended there")
        await server.close()

    asyncio.run(run())
