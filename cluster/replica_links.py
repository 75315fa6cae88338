"""Where the replicas are given a link server (``ingress.transport: auto``), and their callers links to them.

A replica class mixes in ``DirectServed`` (``DirectLLM`` for the LLM replica) and names the methods a
direct link may call; ``direct_link`` and ``pool_links`` give a caller its links to the replicas behind a
handle. The transport itself (sockets, frames, keys, the in-band pickle) is mmcore/link/; this module only
knows which replica answers what, and how a pool's Serve router is found (router/routing/).
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import TYPE_CHECKING, ClassVar

from mmcore.link.direct_link import DEFAULT_TIMEOUT_S, DirectLink, LinkServer, check_mechanism
from mmcore.link.on_ray import frame_dumps, link_keys
from mmcore.link.pool_links import LINK_STAT, Address, PoolLinks, live_router
from router.routing.prefix_affinity import deployment_key

if TYPE_CHECKING:
    from ray.actor import ActorHandle
    from ray.serve.handle import DeploymentHandle

    from llm_service.output_channels import ChannelBatch, OutputChannels
    from llm_service.request_spec import LLMRequestSpec, ReplicaTarget, SubmitReply


def direct_link(
    handle: DeploymentHandle | ActorHandle, timeout_s: float | None = DEFAULT_TIMEOUT_S
) -> DirectLink:
    """A caller's link to the replica behind ``handle`` (a Serve handle or a Ray actor handle of a
    ``DirectServed`` class), which answers where it listens; the keys are fetched here, once.
    ``timeout_s``: each call's deadline unless the caller gives one (the ingress's request timeout)."""

    async def locate() -> tuple[str, int]:
        host, port = await handle.direct_address.remote()
        return str(host), int(port)

    return DirectLink(locate, link_keys(), dumps=frame_dumps, timeout_s=timeout_s)


def pool_links(handle: DeploymentHandle, timeout_s: float | None = DEFAULT_TIMEOUT_S) -> PoolLinks:
    """A caller's links to the replicas behind ``handle`` (a Serve handle of a ``DirectServed`` pool),
    routed by this process's router of that pool, which Serve keeps current as the pool scales."""
    key = deployment_key(handle.deployment_id)
    keys = link_keys()

    def connect(address: Address) -> DirectLink:
        async def locate() -> Address:
            return address

        return DirectLink(locate, keys, dumps=frame_dumps, timeout_s=timeout_s)

    return PoolLinks(lambda: live_router(key), connect)


MAX_KV_LINKS = 64  # a decode replica's open links to prefill replicas


def kv_links(timeout_s: float | None = DEFAULT_TIMEOUT_S) -> Callable[[Address], DirectLink]:
    """A decode replica's links to prefill replicas by address (E/P/D's KV pulls), one per address,
    made on first use with the cluster's keys (authenticated; encrypted unless the keys are PLAIN)."""
    keys = link_keys()
    links: dict[Address, DirectLink] = {}  # most recently used last

    def connect(address: Address) -> DirectLink:
        address = (str(address[0]), int(address[1]))
        link = links.pop(address, None)
        if link is None:

            async def locate() -> Address:
                return address

            link = DirectLink(locate, keys, dumps=frame_dumps, timeout_s=timeout_s)
        links[address] = link
        while len(links) > MAX_KV_LINKS:  # prefill replicas come and go: close the least recently used
            links.pop(next(iter(links))).close()
        return link

    return connect


class DirectServed:
    """``direct_address()``: where this replica takes its ``DIRECT_METHODS`` as frames;
    ``link_stats()``: the same, for its routing stats (``LINK_STAT``), which is how callers find it."""

    DIRECT_METHODS: ClassVar[dict[str, str]] = {}  # frame method -> this replica's method
    REF_STREAMS: ClassVar[frozenset[str]] = frozenset()  # streaming methods whose items carry ObjectRefs
    links_on = True  # False under ``ingress.transport: serve``: no listener at all (set by the replica)
    _link_server: LinkServer | None = None

    def link_calls(self) -> int:
        """Calls this replica took over its link (``GET /stats?pools=true`` shows them per replica)."""
        return self._link_server.calls if self._link_server is not None else 0

    async def link_stats(self) -> dict[str, tuple[str, int]]:
        """``{LINK_STAT: (host, port)}`` while this replica takes frames (listening from the first call
        on); nothing once it drains or when links are off."""
        if not self.links_on or not self.DIRECT_METHODS:
            return {}
        if self._link_server is not None and self._link_server.draining:
            return {}
        return {LINK_STAT: await self.direct_address()}

    def refuse_plain_off_loopback(self) -> None:
        """At the replica's start: with links on, the cluster's keys PLAIN (``MMSERVE_LINK_ENCRYPT=0``)
        and this node's address not loopback, fail now with what to do, not at the first call."""
        import ray

        if self.links_on and self.DIRECT_METHODS:
            check_mechanism(link_keys(), ray.util.get_node_ip_address())

    async def direct_address(self) -> tuple[str, int]:
        """Start listening on this node's address (the first time) and answer where."""
        import ray

        if self._link_server is None:
            handlers = {name: getattr(self, attr) for name, attr in self.DIRECT_METHODS.items()}
            self._link_server = LinkServer(
                handlers, link_keys(), dumps=frame_dumps, ref_streams=self.REF_STREAMS
            )
        return await self._link_server.address(ray.util.get_node_ip_address())

    def drain_link(self) -> None:
        """Shutting down: later frames are refused unrun (their callers go through Serve)."""
        if self._link_server is None:
            return
        try:
            asyncio.get_running_loop()
        except RuntimeError:  # the garbage collector's call: no loop to close a server on
            return
        self._link_server.drain()


class DirectLLM(DirectServed):
    """An LLM replica's direct link: ``submit`` as ``submit_detached`` (the request's life is its output
    channel's), ``abort``, and ``channel``: the output channel as a stream on the link (one MORE frame
    per ``ChannelBatch``), in place of Serve's streaming call. Serve counts no call for such a request,
    so its graceful shutdown would not wait for it: ``__del__`` (Serve's hook) refuses new frames, then
    waits for every request that came over the link to finish (Serve's ``graceful_shutdown_timeout_s``
    bounds the wait)."""

    DIRECT_METHODS: ClassVar[dict[str, str]] = {
        "submit": "direct_submit",
        "abort": "abort",
        "arrived": "arrived",
        "channel": "direct_channel",
    }
    channels: OutputChannels  # the LLM replica's (LLMServer)
    submit_detached: Callable[[LLMRequestSpec], Awaitable[SubmitReply]]  # the LLM replica's (LLMServer)
    linked_channel_batches = 0  # channel batches sent over the link (``stats``: ``link_channel_batches``)

    async def direct_channel(self, target: ReplicaTarget) -> AsyncIterator[ChannelBatch]:
        """``channel`` over the link: the output channel's batches as stream items. The reader leaving
        (a cancel frame, or its connection gone) closes the channel, which aborts its requests."""
        # OutputChannels.stream is an async generator, annotated as the AsyncIterator it also is
        batches_of = self.channels.stream(target.channel_id)
        async with contextlib.aclosing(batches_of) as batches:  # type: ignore[type-var]
            async for batch in batches:
                self.linked_channel_batches += 1
                yield batch

    async def direct_submit(self, spec: LLMRequestSpec) -> SubmitReply:
        reply = await self.submit_detached(spec)
        done = self.channels.done(spec.request_id)
        if not hasattr(self, "_direct_open"):
            self._direct_open: set[asyncio.Future[None]] = set()
        if not done.done():
            self._direct_open.add(done)
            done.add_done_callback(self._direct_open.discard)
        return reply

    async def _drain_direct(self) -> None:
        self.drain_link()
        open_ = set(getattr(self, "_direct_open", ()))
        if open_:
            await asyncio.wait(open_)

    def __del__(self) -> Awaitable[None] | None:
        """A plain ``def``, as ``EncoderServer.__del__``: the garbage collector calls it too."""
        try:
            asyncio.get_running_loop()
        except RuntimeError:
            return None
        return self._drain_direct()
