"""The ingress end of the LLM pool's output channels (llm_service/output_channels.py).

``LLMClient.stream(spec)`` submits a request (a unary call, routed by prefix affinity) and yields
its outputs as they arrive on the channel of the replica that took it: requests submitted over the
direct link (``transport: auto``) have a channel of their own, read as a stream on that link; the
others' channel is read with Serve's streaming call. One reader task per open channel receives each engine step's outputs for every request of this ingress on that replica as
one message and fans them out to the requests' queues. If a channel breaks (the replica died),
every request still waiting on it gets ``ChannelLost``; a request whose caller leaves is aborted on
its replica by cancelling its submit call, which stays open until the request is done.

Replica death: a request that got nothing from the dead replica yet (its submit failed with the
actor gone, or its channel broke before its first output) is submitted again — Serve routes it to a
live replica, or to the dead one's successor — for up to ``reroute_timeout_s``; a request that was
already streaming fails with ``ChannelLost`` (a 503 on the stream, never a hang).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import uuid
from collections.abc import AsyncGenerator, AsyncIterator, Awaitable, Coroutine
from dataclasses import dataclass, field, replace
from typing import Protocol

from llm_service.output_channels import ChannelBatch
from llm_service.outputs import RequestOutput
from llm_service.request_spec import LLMRequestSpec, ReplicaTarget, SubmitReply
from mmcore.feature import MediaFeature
from mmcore.link.direct_link import LinkBusy, LinkLost
from mmcore.link.pool_links import PoolLinks
from router.journey.serve_calls import Counters, StreamCall, StreamingMethod, UnaryMethod
from router.protocol.errors import replica_gone

logger = logging.getLogger("mmserve.router")

_Item = RequestOutput | BaseException
LINKED = "+link"  # ingress id suffix of requests submitted over a link: a channel of their own


class ChannelLost(RuntimeError):
    """The LLM replica's output channel broke before the request finished (the replica died)."""

    status_code = 503
    code = "llm_replica_lost"


class StreamingLLMPool(Protocol):
    @property
    def submit(self) -> StreamingMethod[SubmitReply]: ...

    @property
    def channel(self) -> StreamingMethod[ChannelBatch]: ...


class LLMPool(Protocol):
    """The LLM pool as the router calls it (a Serve DeploymentHandle in production), its methods
    those of ``llm_service.serve.deployment.LLMServer``."""

    @property
    def arrived(self) -> UnaryMethod[None]: ...

    @property
    def abort(self) -> UnaryMethod[None]: ...

    @property
    def stats(self) -> UnaryMethod[Counters]: ...

    def options(self, *, stream: bool) -> StreamingLLMPool: ...


async def counters_or_error(call: Awaitable[Counters], timeout_s: float) -> dict[str, object]:
    """A replica's ``stats`` answer, or ``{"error": ...}`` if it fails or takes over ``timeout_s``
    (a dead or stuck replica: the operator's view still answers, with the others' counters)."""
    try:
        return dict(await asyncio.wait_for(call, timeout_s))
    except Exception as e:
        return {"error": f"{type(e).__name__}: {e}"}


MAX_REPLICAS_LISTED = 256  # replica_stats: the replicas remembered (the most recent)


@dataclass
class _Reader:
    replica_id: str
    channel_id: str
    requests: set[str] = field(default_factory=set)
    aborted: set[str] = field(default_factory=set)  # orphans this reader already asked to abort
    linked: bool = False  # its requests were submitted over the direct link: read it there too
    task: asyncio.Task[None] | None = None


class LLMClient:
    """Per ingress replica and model: submits to the LLM pool, reads its output channels."""

    def __init__(
        self,
        handle: LLMPool,
        ingress_id: str | None = None,
        connect_timeout_s: float = 30.0,
        reroute_timeout_s: float = 30.0,
        links: PoolLinks | None = None,
    ) -> None:
        self.handle = handle
        self.links = links  # the pool's replicas over direct links: submit and abort as frames
        self.ingress_id = ingress_id or f"ingress-{uuid.uuid4().hex[:12]}"
        self.connect_timeout_s = connect_timeout_s
        self.reroute_timeout_s = reroute_timeout_s
        self._specs: dict[str, LLMRequestSpec] = {}  # submitted, no output yet: may be submitted again
        self.rerouted = 0
        self.linked_channels = 0  # output channels read over a direct link (the rest: Serve's calls)
        self._queues: dict[str, asyncio.Queue[_Item]] = {}
        self._readers: dict[str, _Reader] = {}  # channel id -> reader
        self._calls: dict[str, StreamCall[SubmitReply]] = {}  # request id -> its open submit call
        self._replies: dict[str, SubmitReply] = {}  # request id -> where it runs, until its outputs end
        self._tasks: set[asyncio.Task[None]] = set()
        self._replicas_seen: dict[str, None] = {}  # every replica this client had a channel to

    def __len__(self) -> int:
        return len(self._queues)

    async def submit(self, spec: LLMRequestSpec) -> SubmitReply:
        """Queue ``spec`` on a replica; its outputs go to ``self.outputs(request_id, reply)``.

        The submit call stays open on the replica until the request is done (Serve counts it as
        ongoing there, for routing and autoscaling); ``outputs`` closes it, or cancels it to abort.
        """
        spec = _with_ingress(spec, self.ingress_id)
        rid = spec.request_id
        self._queues[rid] = asyncio.Queue()
        try:
            reply, call = await self._submit_rerouting(spec)
        except BaseException:
            self._queues.pop(rid, None)
            raise
        self._specs[rid] = spec
        self._attach(rid, reply, call)
        return reply

    async def _submit_rerouting(
        self, spec: LLMRequestSpec, via_link: bool = True
    ) -> tuple[SubmitReply, StreamCall[SubmitReply] | None]:
        """One submit call, sent again while the replica it reached turns out dead."""
        deadline = asyncio.get_running_loop().time() + self.reroute_timeout_s
        attempt = 0
        while True:
            call = None
            try:
                # Over a link, the request's life is its channel's (leaving aborts it by name). A retry
                # goes through Serve, which waits for a live replica (the link's may be the dead one).
                if via_link and attempt == 0 and self.links is not None:
                    picked = self.links.pick(spec)
                    if picked is not None:
                        uid, link = picked
                        self.links.routed(spec.request_id, uid, spec)
                        try:  # its own channel, read over the link too (Serve's submits: Serve's)
                            linked = _with_ingress(spec, self.ingress_id + LINKED)
                            reply: SubmitReply = await link.call("submit", linked)
                        except BaseException:
                            self.links.done(spec.request_id)
                            raise
                        return reply, None
                call = self.handle.options(stream=True).submit.remote(spec)
                return await call.__anext__(), call
            except BaseException as e:
                if call is not None:
                    call.cancel()
                attempt += 1
                if not replica_gone(e) or asyncio.get_running_loop().time() > deadline:
                    raise
                logger.warning(
                    "LLM replica lost before %s started (%r); routing it again", spec.request_id, e
                )
                self.rerouted += 1
                await asyncio.sleep(min(0.1 * attempt, 1.0))

    async def arrived(
        self, request_id: str, items: list[MediaFeature], error: BaseException | None = None
    ) -> None:
        """Hand the replica running ``request_id`` items that were still encoding at submit (or the
        error that ended their encoding: the request fails with it there). A request submitted
        again later (its replica lost) carries the items that have arrived by then."""
        reply = self._replies.get(request_id)
        if reply is None:  # over: nothing waits for them
            return
        if (spec := self._specs.get(request_id)) is not None and items:
            by_offset = {it.offset: it for it in items}
            merged = [by_offset.get(m.offset, m) for m in spec.mm_items]
            self._specs[request_id] = replace(spec, mm_items=merged)
        target = ReplicaTarget(reply.replica_id, request_ids=(request_id,))
        link = self.links.link(reply.replica_id) if self.links is not None else None
        if link is not None:
            await link.call("arrived", target, items, error)
        else:
            await self.handle.arrived.remote(target, items, error)

    def fail(self, request_id: str, error: BaseException) -> None:
        """End the open request ``request_id`` with ``error`` here, as its replica would have (for
        when that replica cannot be reached); its ``outputs`` raises it. Nothing if it is over."""
        if (queue := self._queues.get(request_id)) is not None:
            queue.put_nowait(error)

    def _attach(self, rid: str, reply: SubmitReply, call: StreamCall[SubmitReply] | None) -> None:
        self._replies[rid] = reply
        if call is not None:
            self._calls[rid] = call
        reader = self._readers.get(reply.channel_id)
        if reader is None:
            reader = _Reader(reply.replica_id, reply.channel_id, linked=call is None)
            self._readers[reply.channel_id] = reader
            self._replicas_seen[reply.replica_id] = None
            if len(self._replicas_seen) > MAX_REPLICAS_LISTED:  # replicas churn: forget the oldest
                del self._replicas_seen[next(iter(self._replicas_seen))]
            reader.task = asyncio.get_running_loop().create_task(self._read(reader))
        reader.requests.add(rid)

    async def _reroute(self, request_id: str, old: SubmitReply) -> SubmitReply | None:
        """The channel of a request with no output yet broke: submit it again; None if it may not be."""
        spec = self._specs.pop(request_id, None)
        if spec is None:
            return None
        if (reader := self._readers.get(old.channel_id)) is not None:
            reader.requests.discard(request_id)
        if (call := self._calls.pop(request_id, None)) is not None:
            call.cancel()
        logger.warning(
            "LLM replica %s lost before %s produced output; routing it again", old.replica_id, request_id
        )
        self.rerouted += 1
        reply, call = await self._submit_rerouting(spec, via_link=False)
        self._specs[request_id] = spec
        self._attach(request_id, reply, call)
        return reply

    async def outputs(self, request_id: str, reply: SubmitReply) -> AsyncGenerator[RequestOutput, None]:
        """The submitted request's outputs; leaving before the last aborts it on its replica."""
        queue = self._queues[request_id]
        finished = False
        try:
            while True:
                item = await queue.get()
                if isinstance(item, BaseException):
                    if isinstance(item, ChannelLost) and (new := await self._reroute(request_id, reply)):
                        reply = new
                        continue
                    finished = True
                    raise item
                self._specs.pop(request_id, None)  # it started: never submitted twice from here on
                # Set before the yield: a caller that stops at the last output (the ingress does)
                # closes us there, and a finished request must not be aborted on its replica.
                finished = item.finished
                yield item
                if finished:
                    return
        finally:
            if self.links is not None:
                self.links.done(request_id)
            self._queues.pop(request_id, None)
            self._specs.pop(request_id, None)
            self._replies.pop(request_id, None)
            reader = self._readers.get(reply.channel_id)
            if reader is not None:
                reader.requests.discard(request_id)
            call = self._calls.pop(request_id, None)
            if finished:
                if call is not None:  # the replica ends the call on its own now: collect its end
                    self._background(_drain(call))
            else:  # abort on its replica: cancel the open submit call (if ours), and say so outright
                if call is not None:  # (a cancel need not reach the replica on every Serve transport)
                    call.cancel()
                self._background(self._abort(reply, request_id))

    async def replica_stats(self, timeout_s: float = 5.0) -> dict[str, dict[str, object]]:
        """The counters of each LLM replica this client has had a channel to (idle channels close;
        the replicas stay listed), asked of it by name; one that does not answer within ``timeout_s``
        (stuck) reports its error instead, and so does one that is gone: Serve's router sends a call
        for a replica it no longer has to another, whose counters must not be shown as the gone one's."""

        ids = sorted(self._replicas_seen)
        calls = (counters_or_error(self.handle.stats.remote(ReplicaTarget(rid)), timeout_s) for rid in ids)
        out = dict(zip(ids, await asyncio.gather(*calls), strict=True))
        for rid, counters in out.items():
            if "error" not in counters and counters.get("replica_id", rid) != rid:
                out[rid] = {"error": f"replica gone (the call reached {counters['replica_id']})"}
        return out

    async def _abort(self, reply: SubmitReply, request_id: str) -> None:
        try:
            target = ReplicaTarget(reply.replica_id, request_ids=(request_id,))
            link = self.links.link(reply.replica_id) if self.links is not None else None
            if link is not None:
                await asyncio.wait_for(link.call("abort", target), self.connect_timeout_s)
            else:
                await asyncio.wait_for(self.handle.abort.remote(target), self.connect_timeout_s)
        except Exception:  # the replica is gone: nothing left to abort there
            logger.debug("abort of %s on %s failed", request_id, reply.replica_id, exc_info=True)

    def _background(self, coro: Coroutine[object, object, None]) -> None:
        task = asyncio.get_running_loop().create_task(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def stream(self, spec: LLMRequestSpec) -> AsyncIterator[RequestOutput]:
        reply = await self.submit(spec)
        async for out in self.outputs(spec.request_id, reply):
            yield out

    async def _read(self, reader: _Reader) -> None:
        target = ReplicaTarget(reader.replica_id, channel_id=reader.channel_id)
        error: BaseException | None = None
        try:
            stream = await self._open_channel(target, reader.linked)
            async with contextlib.aclosing(stream):
                async for batch in stream:
                    self._dispatch(batch, reader)
        except asyncio.CancelledError:
            error = ChannelLost("the ingress is shutting down")
            raise
        except BaseException as e:
            logger.warning("output channel %s broke: %r", reader.channel_id, e)
            error = ChannelLost(f"the LLM replica {reader.replica_id} stopped sending: {e}")
        finally:
            self._readers.pop(reader.channel_id, None)
            # Requests still open on a closed channel never get another output: fail them.
            why = error or ChannelLost(f"output channel {reader.channel_id} closed early")
            for rid in reader.requests:
                if (q := self._queues.get(rid)) is not None:
                    q.put_nowait(why)

    async def _open_channel(self, target: ReplicaTarget, linked: bool) -> AsyncGenerator[ChannelBatch, None]:
        """The channel's batches, its hello checked: a stream on the replica's direct link for a
        channel of requests submitted over it, else (or if the link fails before the hello) Serve's
        streaming call. The hello is read here, and yielded first."""
        link = self.links.link(target.target_replica) if linked and self.links is not None else None
        if link is not None:
            stream = link.stream("channel", target)
            try:
                hello = await asyncio.wait_for(anext(stream), self.connect_timeout_s)
            except (LinkLost, LinkBusy) as e:  # not started there: Serve still reaches the replica
                logger.debug("output channel %s: no link (%r); through Serve", target.channel_id, e)
                await stream.aclose()
            except BaseException:
                await stream.aclose()
                raise
            else:
                self.linked_channels += 1
                return _checked(hello, target, stream)
        call = self.handle.options(stream=True).channel.remote(target)
        hello = await asyncio.wait_for(call.__anext__(), self.connect_timeout_s)
        return _checked(hello, target, call)

    def _dispatch(self, batch: ChannelBatch, reader: _Reader) -> None:
        orphans: set[str] = set()
        for out in batch.outputs:
            if (q := self._queues.get(out.request_id)) is not None:
                q.put_nowait(out)
            elif not out.finished:  # nobody reads it any more (its client left mid-submit): stop it
                orphans.add(out.request_id)
        for rid in orphans - reader.aborted:
            reader.aborted.add(rid)
            self._background(self._abort(SubmitReply(reader.replica_id, reader.channel_id), rid))
        for rid, err in batch.errors:
            if (q := self._queues.get(rid)) is not None:
                q.put_nowait(err)

    async def close(self) -> None:
        for reader in list(self._readers.values()):
            if reader.task is not None:
                reader.task.cancel()


async def _checked(
    hello: ChannelBatch, target: ReplicaTarget, rest: AsyncIterator[ChannelBatch]
) -> AsyncGenerator[ChannelBatch, None]:
    """``hello``, if it comes from the replica that was asked for, then the rest of the channel."""
    try:
        if hello.replica_id != target.target_replica:
            raise ChannelLost(f"channel {target.channel_id} reached {hello.replica_id}")
        yield hello
        async for batch in rest:
            yield batch
    finally:
        if (close := getattr(rest, "aclose", None)) is not None:
            await close()


async def _drain(call: StreamCall[object]) -> None:
    try:
        async for _ in call:
            pass
    except Exception:  # the request is answered already; its call's end changes nothing
        logger.debug("submit call ended with an error after its request finished", exc_info=True)


def _with_ingress(spec: LLMRequestSpec, ingress_id: str) -> LLMRequestSpec:
    from dataclasses import replace

    return replace(spec, ingress_id=ingress_id)
