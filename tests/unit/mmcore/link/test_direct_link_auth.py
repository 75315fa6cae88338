"""mmcore/link/direct_link.py at the door: a peer without the cluster's key (none, or another
cluster's) gets no frame decoded and no handler run; PLAIN is refused off loopback and checks its
secret in constant time."""

from __future__ import annotations

import asyncio
import pickle
from typing import Any

import msgpack
import pytest
import zmq
import zmq.asyncio

from mmcore.link.direct_link import (
    LinkClient,
    LinkKeys,
    LinkLost,
    LinkServer,
    PlainOffLoopback,
    check_mechanism,
)
from mmcore.link.frames import is_loopback
from tests.unit.mmcore.link.peers import KEYS, echo, raw_dealer

PWNED: list[str] = []


def _pwn() -> None:
    PWNED.append("unpickled")


class _Payload:
    def __reduce__(self) -> tuple[Any, ...]:
        return (_pwn, ())


_REFUSED = {
    zmq.EVENT_HANDSHAKE_FAILED_AUTH,
    zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL,
    zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL,
    zmq.EVENT_DISCONNECTED,
}


@pytest.mark.parametrize("peer", ["no key", "another cluster's client key"])
def test_a_peer_without_the_cluster_key_never_gets_a_frame_decoded_or_a_handler_run(peer: str) -> None:
    from zmq.utils.monitor import parse_monitor_message

    async def run() -> None:
        server = LinkServer({"echo": echo}, KEYS)
        host, port = await server.address("127.0.0.1")
        ctx = zmq.asyncio.Context()
        outsider = raw_dealer(ctx, None if peer == "no key" else LinkKeys.generate(), KEYS.server_public)
        monitor = outsider.get_monitor_socket()
        outsider.connect(f"tcp://{host}:{port}")
        call = [msgpack.packb([1, "echo", None]), pickle.dumps((_Payload(),))]
        outsider.send_multipart(call)  # queued: goes out if the handshake passes
        while (
            event := parse_monitor_message(await asyncio.wait_for(monitor.recv_multipart(), 10))["event"]
        ) not in (_REFUSED | {zmq.EVENT_HANDSHAKE_SUCCEEDED}):
            pass
        assert event != zmq.EVENT_HANDSHAKE_SUCCEEDED
        # the cluster's own client still gets through, after the outsider tried
        client = await LinkClient.connect(host, port, KEYS)
        assert await client.call("echo", 1) == ("echo", (1,))
        assert PWNED == [] and server.calls == 1 and server.garbled == 0
        with pytest.raises(LinkLost, match=r"refused|handshake"):
            await LinkClient.connect(host, port, LinkKeys.generate())  # the client's view of the same
        outsider.disable_monitor()
        monitor.close(0)
        outsider.close(0)
        ctx.term()
        client.close()
        await server.close()

    asyncio.run(run())


@pytest.mark.parametrize(
    ("host", "loopback"),
    [
        ("127.0.0.1", True),
        ("127.3.2.1", True),
        ("::1", True),
        ("[::1]", True),
        ("localhost", True),
        ("10.0.0.5", False),
        ("192.168.1.20", False),
        ("0.0.0.0", False),
        ("::", False),
        ("fe80::1", False),
        ("node-3.cluster.local", False),
    ],
)
def test_plain_is_refused_off_loopback_and_curve_is_not(host: str, loopback: bool) -> None:
    assert is_loopback(host) is loopback
    check_mechanism(KEYS, host)  # CURVE: anywhere
    plain = LinkKeys.generate(encrypt=False)
    if loopback:
        check_mechanism(plain, host)
    else:
        with pytest.raises(PlainOffLoopback, match=r"only on loopback.*turn encryption on"):
            check_mechanism(plain, host)


def test_plain_checks_its_secret_in_constant_time(monkeypatch: pytest.MonkeyPatch) -> None:
    import hmac

    from mmcore.link import server as link_server

    compared: list[bytes] = []
    real = hmac.compare_digest

    def compare_digest(a: bytes, b: bytes) -> bool:
        compared.append(b)
        return real(a, b)

    monkeypatch.setattr(link_server.hmac, "compare_digest", compare_digest)

    async def run() -> None:
        keys = LinkKeys.generate(encrypt=False)
        server = LinkServer({"echo": echo}, keys)
        host, port = await server.address("127.0.0.1")
        client = await LinkClient.connect(host, port, keys)
        assert await client.call("echo", 1) == ("echo", (1,))
        assert keys.client_secret in compared  # the password went through compare_digest, not ==
        same_length = LinkKeys(*[b"A" * len(v) if isinstance(v, bytes) else v for v in vars(keys).values()])
        with pytest.raises(LinkLost, match="refused"):
            await LinkClient.connect(host, port, same_length)
        client.close()
        await server.close()

    asyncio.run(run())
