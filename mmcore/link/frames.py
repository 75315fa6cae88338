"""The direct link's wire (mmcore/link/direct_link.py tells the design): limits, errors, keys, and the
helpers both ends share to tune sockets and send and receive multipart messages without waiting."""

from __future__ import annotations

import asyncio
import hmac
import ipaddress
import pickle
from collections.abc import AsyncGenerator, Awaitable, Callable
from dataclasses import dataclass
from typing import cast

import msgpack
import zmq
import zmq.asyncio

from mmcore.errors import Overloaded

MAX_FRAME_BYTES = 256 << 20  # a body's bound (the ingress's requests are bounded at 64 MiB by default)
# A body travels in parts of at most this many bytes (one multipart message): libzmq restarts its
# heartbeat timer at each whole frame it receives, so a large body in flight on a slow link keeps its
# connection alive as long as one part arrives per heartbeat timeout (1 MiB in 3 s: ~350 kB/s).
PART_BYTES = 1 << 20
HWM = 1024  # messages each socket queues each way
MAX_IN_FLIGHT = 1024  # calls a server runs at once; past it LinkBusy
MAX_IN_FLIGHT_BYTES = 1 << 30  # bytes of arguments the calls a server runs hold at once; past it LinkBusy
HEARTBEAT_S = 1.0  # PING every second; no answer for 3 s: the peer is gone
CONNECT_TIMEOUT_S = 5.0  # TCP + handshake + authentication
DEFAULT_TIMEOUT_S = 300.0  # a call's deadline unless its caller gives one (the ingress's request timeout)
REPLY_PATIENCE_S = 10.0  # how long a reply waits for a client that does not read
LOST_BACKOFF_S = 5.0  # after a lost link, calls go through Serve this long
PLAIN_USER = b"mmserve"  # PLAIN's user name (the password is the secret)

OK, RAISED, FAILED, MORE = 0, 1, 2, 3  # a reply's status; MORE: one item of a stream, more to come

# an async function, or an async generator function (a stream), called with the call's arguments
Handler = Callable[..., Awaitable[object] | AsyncGenerator[object, None]]
Dumps = Callable[[object], bytes]
Frame = bytes | memoryview  # one ZeroMQ frame as sent: a header, or a body's part
Loads = Callable[[bytes], object]


class LinkLost(ConnectionError):
    """The connection to the replica broke (or never opened), or the replica is shutting down,
    with the call unanswered: its callers send it through Serve."""

    status_code = 503
    code = "replica_link_lost"


class LinkBusy(Overloaded):
    """Too many calls queued or running on the link: refused at once, not run."""


class LinkTimeout(TimeoutError):
    """The call's deadline passed; it was cancelled on the replica."""

    status_code = 504
    code = "replica_link_timeout"


class CallCancelled(RuntimeError):
    """The handler was cancelled on the replica by its own doing (an inner task cancelled under it),
    not by its caller: answered at once, so the caller does not wait out its deadline."""

    status_code = 503
    code = "replica_call_cancelled"


class FrameTooLarge(ValueError):
    """A body past the link's frame bound: refused by its sender, the connection goes on."""

    status_code = 413
    code = "frame_too_large"


class BadFrame(RuntimeError):
    """A frame that did not decode: that one call fails, the connection goes on."""

    status_code = 500
    code = "bad_frame"


FAILURES: dict[str, type[Exception]] = {
    "lost": LinkLost,
    "busy": LinkBusy,
    "too_large": FrameTooLarge,
    "bad_frame": BadFrame,
    "cancelled": CallCancelled,
}


@dataclass(frozen=True)
class LinkKeys:
    """A cluster's link credentials: one CURVE key pair for every server, one for every client (z85).
    ``encrypt=False``: PLAIN, the client secret as password, messages in clear (one machine)."""

    server_public: bytes
    server_secret: bytes
    client_public: bytes
    client_secret: bytes
    encrypt: bool = True

    @classmethod
    def generate(cls, encrypt: bool = True) -> LinkKeys:
        if encrypt and not zmq.has("curve"):
            raise RuntimeError(
                "this libzmq has no CURVE; install a pyzmq wheel (it bundles one) or encrypt=False"
            )
        server_public, server_secret = zmq.curve_keypair()
        client_public, client_secret = zmq.curve_keypair()
        return cls(server_public, server_secret, client_public, client_secret, encrypt)

    def to_bytes(self) -> bytes:
        return bytes(msgpack.packb(list(vars(self).values())))

    @classmethod
    def from_bytes(cls, raw: bytes) -> LinkKeys:
        return cls(*msgpack.unpackb(raw))


class PlainOffLoopback(ValueError):
    """PLAIN (``encrypt=False``) asked for off loopback, where its secret would cross a wire in clear."""


def is_loopback(host: str) -> bool:
    """``localhost``, or an address in 127.0.0.0/8 or ``::1``; a name other than localhost is not."""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False


def check_mechanism(keys: LinkKeys, host: str) -> None:
    """Refuse PLAIN anywhere but loopback: it sends the cluster's secret and every message in clear, so
    a listener on (or a connection to) a node's address would hand them to whoever sees the wire."""
    if not keys.encrypt and not is_loopback(host):
        raise PlainOffLoopback(
            f"the direct link's unencrypted mode (PLAIN, MMSERVE_LINK_ENCRYPT=0) runs only on loopback, "
            f"and {host} is not: turn encryption on (unset MMSERVE_LINK_ENCRYPT where `ray start` runs and "
            "start the cluster again, so that its link keys are made anew as CURVE keys), or set "
            "ingress.transport: serve"
        )


class ClientKeyCheck:
    """The ZAP check: CURVE's client key must be the cluster's."""

    def __init__(self, z85_key: bytes) -> None:
        self.key = z85_key

    def callback(self, domain: str, key: bytes) -> bool:
        return hmac.compare_digest(key, self.key)


def pickle_dumps(obj: object) -> bytes:
    return pickle.dumps(obj, protocol=5)


def endpoint(host: str, port: int | str) -> str:
    return f"tcp://[{host}]:{port}" if ":" in host else f"tcp://{host}:{port}"


def tune(sock: zmq.asyncio.Socket, hwm: int, max_frame_bytes: int, ipv6: bool) -> None:
    sock.setsockopt(zmq.LINGER, 0)
    sock.setsockopt(zmq.SNDHWM, hwm)
    sock.setsockopt(zmq.RCVHWM, hwm)
    # per ZeroMQ frame: a body's part (or a header); a body's parts are counted by ``join_body``
    sock.setsockopt(zmq.MAXMSGSIZE, min(max_frame_bytes, PART_BYTES) + 4096)
    sock.setsockopt(zmq.HEARTBEAT_IVL, int(HEARTBEAT_S * 1000))
    sock.setsockopt(zmq.HEARTBEAT_TIMEOUT, int(3 * HEARTBEAT_S * 1000))
    sock.setsockopt(zmq.HEARTBEAT_TTL, int(3 * HEARTBEAT_S * 1000))
    sock.setsockopt(zmq.IPV6, int(ipv6))


def split_body(body: bytes) -> list[Frame]:
    """A body as the frames it travels in: parts of at most ``PART_BYTES`` (views, not copies)."""
    if len(body) <= PART_BYTES:
        return [body]
    view = memoryview(body)
    return [view[i : i + PART_BYTES] for i in range(0, len(body), PART_BYTES)]


def join_body(parts: list[bytes], max_frame_bytes: int) -> bytes:
    """A body from its parts (``split_body``); ``ValueError`` if a peer sent more than the bound or
    parts larger than ``PART_BYTES`` (its sender is not this code)."""
    if len(parts) == 1:
        return parts[0]
    if len(parts) > -(-max_frame_bytes // PART_BYTES) or any(len(p) > PART_BYTES for p in parts):
        raise ValueError(f"a body of {len(parts)} parts is past the link's {max_frame_bytes}-byte bound")
    return b"".join(parts)


def failed_reply(seq: int, code: str, message: str) -> list[Frame]:
    return [msgpack.packb([seq, FAILED, code, message]), b""]


def send_nowait(sock: zmq.asyncio.Socket, frames: list[Frame]) -> BaseException | None:
    """Send without waiting; what went wrong (``zmq.Again``: the queue is full), or None. With
    ``DONTWAIT`` pyzmq's future is done on return (no send here ever waits in its queue)."""
    sent = cast("asyncio.Future[object]", sock.send_multipart(frames, flags=zmq.DONTWAIT))
    return sent.exception() if sent.done() else None


async def recv_batch(sock: zmq.asyncio.Socket, most: int = 256) -> list[list[bytes]] | None:
    """One message awaited, then those already queued behind it (up to ``most``); None: closed."""
    try:
        batch = [await sock.recv_multipart()]
        while len(batch) < most:
            batch.append(
                cast("asyncio.Future[list[bytes]]", sock.recv_multipart(flags=zmq.DONTWAIT)).result()
            )
    except zmq.Again:
        pass
    except zmq.ZMQError:
        return None
    return batch


def decode_header(raw: bytes) -> tuple[int, list[object]] | None:
    """A message's msgpack header: its sequence number and the whole list (``[seq, method, timeout_ms]``
    for a call, ``[seq, status, ...]`` for a reply); None: not a list that starts with an int."""
    try:
        header = msgpack.unpackb(raw)
    except Exception:
        return None
    if not isinstance(header, list) or len(header) < 2 or not isinstance(header[0], int):
        return None
    return header[0], header
