"""mmcore/link/direct_link.py against peers that misbehave on a connection: garbage and oversized
frames, a client that does not read, a server that stops answering without closing, a slow link,
calls past the bytes-in-flight bound (who may connect at all: test_direct_link_auth.py)."""

from __future__ import annotations

import asyncio
import os
import pickle
import signal
import sys
from pathlib import Path
from typing import Any

import msgpack
import pytest
import zmq
import zmq.asyncio

from mmcore.link.direct_link import (
    BadFrame,
    DirectLink,
    FrameTooLarge,
    LinkBusy,
    LinkClient,
    LinkKeys,
    LinkLost,
    LinkServer,
)
from router.protocol.errors import replica_gone
from tests.unit.mmcore.link.peers import KEYS, echo, raw_dealer, until


def test_garbage_and_oversized_frames_fail_their_own_call_and_the_connection_goes_on() -> None:
    async def run() -> None:
        async def big(n: int) -> bytes:
            return b"x" * n

        async def junk() -> str:
            return "junk"

        def dumps(value: Any) -> bytes:  # a server whose encoder garbles one reply
            return b"\x80not a pickle" if value == "junk" else pickle.dumps(value)

        bound = 1 << 20
        server = LinkServer({"echo": echo, "big": big, "junk": junk}, KEYS, dumps, max_frame_bytes=bound)
        host, port = await server.address("127.0.0.1")
        client = await LinkClient.connect(host, port, KEYS, max_frame_bytes=bound)
        with pytest.raises(FrameTooLarge, match="not sent"):
            await client.call("echo", b"y" * (bound + 1))  # refused by the sender
        with pytest.raises(FrameTooLarge, match="past the link's"):
            await client.call("big", 2 * bound)  # a reply past the bound: the server answers that
        with pytest.raises(BadFrame, match="undecodable reply"):
            await client.call("junk")
        assert await client.call("echo", "after") == ("echo", ("after",))
        assert client.lost is None and server.calls == 3

        ctx = zmq.asyncio.Context()  # an authenticated peer that speaks garbage
        peer = raw_dealer(ctx, KEYS, KEYS.server_public)
        peer.connect(f"tcp://{host}:{port}")
        await peer.send_multipart([b"\xc1 no header"])  # no seq to answer: dropped
        await peer.send_multipart([msgpack.packb([7, "echo", None]), b"\x80not a pickle"])
        await peer.send_multipart([msgpack.packb([8, "echo", None]), pickle.dumps(("fine",))])
        seven = await asyncio.wait_for(peer.recv_multipart(), 10)
        eight = await asyncio.wait_for(peer.recv_multipart(), 10)
        assert msgpack.unpackb(seven[0])[:3] == [7, 2, "bad_frame"]
        assert msgpack.unpackb(eight[0]) == [8, 0] and pickle.loads(eight[1]) == ("echo", ("fine",))
        assert server.garbled == 2
        peer.close(0)
        ctx.term()
        assert await client.call("echo", "still") == ("echo", ("still",))
        client.close()
        await server.close()

    asyncio.run(run())


def _rss_bytes() -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    raise AssertionError("no VmRSS")


def test_a_client_that_does_not_read_keeps_the_server_bounded_and_gets_fast_503s() -> None:
    """Calls for 256 KiB each from a peer that reads nothing: once the queues (a few MiB) are full,
    the server holds at most ``max_in_flight`` replies and refuses 2,000 more calls at once (500 MiB
    of replies, had it run and buffered them); the process's memory grows by the queues only."""

    async def run() -> None:
        async def blob() -> bytes:
            return os.urandom(256 << 10)

        server = LinkServer({"blob": blob, "echo": echo}, KEYS, max_in_flight=16, hwm=8, reply_patience_s=600)
        host, port = await server.address("127.0.0.1")
        ctx = zmq.asyncio.Context()
        reader = raw_dealer(ctx, KEYS, KEYS.server_public)
        reader.setsockopt(zmq.RCVHWM, 8)
        reader.setsockopt(zmq.SNDHWM, 10_000)
        reader.connect(f"tcp://{host}:{port}")
        before = _rss_bytes()
        seq = 0
        while len(server._running) < 16 and seq < 1000:  # the queues fill up, then the slots
            for _ in range(16):
                await reader.send_multipart([msgpack.packb([seq, "blob", None]), pickle.dumps(())])
                seq += 1
            await asyncio.sleep(0.2)
        assert len(server._running) == 16  # each holding a reply the reader does not take
        ran, refused = server.calls, server.refused
        for _ in range(2000):  # the flood: refused unrun, at once
            await reader.send_multipart([msgpack.packb([seq, "blob", None]), pickle.dumps(())])
            seq += 1
        await until(lambda: server.calls + server.refused >= seq, "every flooded call counted")
        assert server.calls == ran and server.refused == refused + 2000 and len(server._running) == 16
        grown = _rss_bytes() - before
        assert grown < 120 << 20, f"memory grew {grown >> 20} MiB"
        # another client of the same server is refused at once while the slots are held
        client = await LinkClient.connect(host, port, KEYS)
        with pytest.raises(Exception) as e:
            await client.call("echo", 1)
        assert getattr(e.value, "status_code", None) == 503 and not replica_gone(e.value)
        # the slow reader reads: the held replies arrive, and the server takes calls again
        statuses = []
        while server._running:
            frames = await asyncio.wait_for(reader.recv_multipart(), 10)
            statuses.append(msgpack.unpackb(frames[0])[1])
        assert statuses.count(0) >= 1
        assert await client.call("echo", 2) == ("echo", (2,))
        reader.close(0)
        ctx.term()
        client.close()
        await server.close()

    asyncio.run(run())


_SERVER = """
import asyncio, sys
from mmcore.link.direct_link import LinkKeys, LinkServer

async def main():
    async def hang():
        await asyncio.sleep(3600)
    async def echo(*args):
        return args
    server = LinkServer({"hang": hang, "echo": echo}, LinkKeys.from_bytes(bytes.fromhex(sys.argv[1])))
    host, port = await server.address("127.0.0.1")
    print(port, flush=True)
    await asyncio.Event().wait()

asyncio.run(main())
"""


def test_a_server_that_stops_answering_without_closing_fails_waiting_calls_within_the_heartbeat_bound() -> (
    None
):
    """SIGSTOP: the kernel keeps the TCP connection open, only the heartbeats go unanswered. Without
    them the call would wait forever (the link's deadline is off here); the bound is ~4 s."""

    async def run() -> None:
        env = dict(os.environ, PYTHONPATH=str(Path(__file__).resolve().parents[4]))
        proc = await asyncio.create_subprocess_exec(
            sys.executable, "-c", _SERVER, KEYS.to_bytes().hex(), stdout=asyncio.subprocess.PIPE, env=env
        )
        try:
            assert proc.stdout is not None
            port = int(await asyncio.wait_for(proc.stdout.readline(), 60))

            async def locate() -> tuple[str, int]:
                return "127.0.0.1", port

            link = DirectLink(locate, KEYS, timeout_s=None)
            assert await link.call("echo", 1) == (1,)
            waiting = asyncio.ensure_future(link.call("hang"))
            await asyncio.sleep(0.2)
            os.kill(proc.pid, signal.SIGSTOP)
            with pytest.raises(LinkLost, match="heartbeat"):
                await asyncio.wait_for(waiting, 20)
            assert link.losses == 1 and not link.usable()
            link.close()
        finally:
            os.kill(proc.pid, signal.SIGCONT)
            proc.kill()
            await proc.wait()

    asyncio.run(run())


class _SlowLink:
    """A loopback TCP relay to ``port`` that passes the server's bytes to the client at ``rate`` bytes
    a second (a busy link between nodes), the client's at once."""

    def __init__(self, port: int, rate: int) -> None:
        self.port, self.rate = port, rate
        self.server: asyncio.Server | None = None
        self.relays: list[asyncio.Task[None]] = []

    async def start(self) -> int:
        self.server = await asyncio.start_server(self._relay, "127.0.0.1", 0)
        return int(self.server.sockets[0].getsockname()[1])

    async def _relay(self, client_r: asyncio.StreamReader, client_w: asyncio.StreamWriter) -> None:
        server_r, server_w = await asyncio.open_connection("127.0.0.1", self.port)
        self.relays += [
            asyncio.ensure_future(self._pump(client_r, server_w, None)),
            asyncio.ensure_future(self._pump(server_r, client_w, self.rate)),
        ]

    async def _pump(self, r: asyncio.StreamReader, w: asyncio.StreamWriter, rate: int | None) -> None:
        step = 16 << 10
        try:
            while data := await r.read(step):
                w.write(data)
                await w.drain()
                if rate is not None:
                    await asyncio.sleep(len(data) / rate)
        except (ConnectionError, asyncio.CancelledError):
            pass
        finally:
            w.close()

    async def close(self) -> None:
        for t in self.relays:
            t.cancel()
        if self.server is not None:
            self.server.close()


@pytest.mark.parametrize("encrypt", [True, False], ids=["curve", "plain"])
def test_a_frame_that_takes_longer_than_the_heartbeat_timeout_to_arrive_keeps_the_connection(
    monkeypatch: pytest.MonkeyPatch, encrypt: bool
) -> None:
    """A 12 MiB reply over a 6 MiB/s link takes ~2 s; the heartbeat times out after 0.75 s here (a
    test-only 0.25 s interval, loose enough for a busy host): the reply must arrive whole, and the
    connection go on."""
    from mmcore.link import frames

    monkeypatch.setattr(frames, "HEARTBEAT_S", 0.25)
    size = 12 << 20

    async def big() -> bytes:
        return b"e" * size

    async def run() -> None:
        keys = KEYS if encrypt else LinkKeys.generate(encrypt=False)
        server = LinkServer({"echo": echo, "big": big}, keys)
        _, port = await server.address("127.0.0.1")
        slow = _SlowLink(port, rate=size // 2)
        client = await LinkClient.connect("127.0.0.1", await slow.start(), keys, timeout_s=60)
        try:  # closed on a failure too: an open socket would hold its context's term() later
            assert await client.call("echo", 1) == ("echo", (1,))
            reply = await client.call("big")
            assert len(reply) == size and client.lost is None
            assert await client.call("echo", "after") == ("echo", ("after",))
        finally:
            client.close()
            await slow.close()
            await server.close()

    asyncio.run(run())


def test_past_the_bytes_in_flight_bound_a_call_is_refused_unrun_and_the_bytes_come_back() -> None:
    async def run() -> None:
        started, release = asyncio.Event(), asyncio.Event()

        async def hold(body: bytes) -> int:
            started.set()
            await release.wait()
            return len(body)

        server = LinkServer({"echo": echo, "hold": hold}, KEYS, max_in_flight_bytes=1 << 20)
        host, port = await server.address("127.0.0.1")
        client = await LinkClient.connect(host, port, KEYS)
        held = asyncio.ensure_future(client.call("hold", b"h" * (768 << 10)))
        await asyncio.wait_for(started.wait(), 10)
        with pytest.raises(LinkBusy, match="bytes of calls in flight"):
            await client.call("hold", b"x" * (512 << 10))  # 1.25 MiB in all: refused, not run
        assert await client.call("echo", "small") == ("echo", ("small",))  # within the bound
        release.set()
        assert await held == 768 << 10
        assert server.bytes_in_flight == 0 and server.refused == 1
        alone = await client.call("echo", b"y" * (3 << 20))  # larger than the bound, alone: let in
        assert alone == ("echo", (b"y" * (3 << 20),))
        client.close()
        await server.close()

    asyncio.run(run())


def test_a_body_in_parts_is_joined_within_the_bound_and_refused_past_it() -> None:
    from mmcore.link.frames import PART_BYTES, join_body, split_body

    body = bytes(range(256)) * (3 * PART_BYTES // 256) + b"tail"
    parts = split_body(body)
    assert len(parts) == 4 and all(len(p) <= PART_BYTES for p in parts)
    assert join_body([bytes(p) for p in parts], 4 * PART_BYTES) == body
    with pytest.raises(ValueError, match="past the link's"):
        join_body([bytes(p) for p in parts], 2 * PART_BYTES)  # a peer sending more than the bound
    with pytest.raises(ValueError, match="past the link's"):
        join_body([b"a" * (PART_BYTES + 1), b"b"], 4 * PART_BYTES)  # parts larger than a part
