"""What the direct-link tests' peers share: the cluster's keys, an echo handler, a raw DEALER
socket as an outsider (or a misbehaving insider) would open it, and a bounded wait for a condition."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from typing import Any

import zmq
import zmq.asyncio

from mmcore.link.direct_link import LinkKeys

KEYS = LinkKeys.generate()


async def echo(*args: Any) -> Any:
    return ("echo", args)


def raw_dealer(ctx: zmq.asyncio.Context, keys: LinkKeys | None, server_public: bytes) -> zmq.asyncio.Socket:
    """A DEALER as an outsider would make it: no key (NULL), or CURVE with ``keys``' client pair."""
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    if keys is not None:
        sock.setsockopt(zmq.CURVE_SERVERKEY, server_public)
        sock.setsockopt(zmq.CURVE_PUBLICKEY, keys.client_public)
        sock.setsockopt(zmq.CURVE_SECRETKEY, keys.client_secret)
    return sock


async def until(condition: Callable[[], object], what: str, timeout_s: float = 60.0) -> None:
    """Wait for ``condition()`` on the event loop, failing with ``what`` after ``timeout_s`` (a bare
    ``while not ...: await asyncio.sleep`` would wait forever when the condition never comes)."""
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, f"still waiting after {timeout_s:.0f} s: {what}"
        await asyncio.sleep(0.01)
