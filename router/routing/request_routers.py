"""Ray Serve request routers (the plug-in point of Serve's handles) for the encoder and LLM pools.

Both keep exact per-replica in-flight counts for the requests this handle sent (routed/completed
hooks) and add what replicas report through ``record_routing_stats`` for everyone else's: the report's
stamp tells what this handle itself had in flight when it was made (router.routing.inflight).
The decisions themselves are the pure functions in router.routing.prefix_affinity.

Calls that travel outside Serve (direct links, mmcore/link/pool_links.py) are routed by the same router:
each router registers itself per deployment in this process (``pool_links.live_router``), and ``choose_linked``
ranks the live replicas that announced a link address in their routing stats, exactly as
``choose_replicas`` ranks them for a Serve call; ``linked_routed``/``linked_done`` keep its in-flight
counts (and the LLM pool's prefix index) for those calls too. Serve's long poll keeps the replica set
current as the pool scales: a replica is dropped before it is asked to stop.
"""

from __future__ import annotations

from collections.abc import Hashable, Sequence
from typing import TypeVar

from ray.serve.request_router import FIFOMixin, PendingRequest, ReplicaID, RequestRouter, RunningReplica

from mmcore.link.pool_links import LINK_STAT, register_router
from router.routing.decode_choice import ImportNeed, rank_decode
from router.routing.inflight import REPORTED_AT, InFlight
from router.routing.prefix_affinity import deployment_key, least_loaded, shared_index


class _Args:
    """A call's arguments where ``_request_arg`` looks for routing hints (a ``PendingRequest``'s shape)."""

    def __init__(self, args: tuple[object, ...]) -> None:
        self.args = args
        self.kwargs: dict[str, object] = {}


_T = TypeVar("_T")
_NO_HASHES: tuple[Hashable, ...] = ()


def _request_arg(pending: PendingRequest | _Args | None, attr: str, default: _T) -> _T:
    """``attr`` of the first argument that has it (a request record's routing hint, of ``default``'s
    type: ``num_embeds``, ``target_replica``, ``block_hashes``), else ``default``."""
    if pending is None:
        return default
    for arg in [*pending.args, *pending.kwargs.values()]:
        if hasattr(arg, attr):
            return getattr(arg, attr)
    return default


class _LoadAwareRouter(RequestRouter):
    """Shared machinery: exact in-flight amounts per replica, and an ordering hook ``_rank``."""

    def initialize_state(self, **kwargs: object) -> None:
        self._inflight = InFlight()
        register_router(deployment_key(self._deployment_id), self)

    def choose_linked(self, args: tuple[object, ...]) -> tuple[str, tuple[str, int]] | None:
        """For a call sent over a direct link: the replica this router would choose among the live ones
        that announced a link address (its unique id and the address); None while none has."""
        linked = {rid: r for rid, r in self.curr_replicas.items() if r.routing_stats.get(LINK_STAT)}
        if not linked:
            return None
        load = {rid: self._load(r) for rid, r in linked.items()}
        best = self._rank(_Args(args), load)[0]
        host, port = linked[best].routing_stats[LINK_STAT]
        return best.unique_id, (str(host), int(port))

    def linked_routed(self, request_id: str, replica_uid: str, args: tuple[object, ...]) -> None:
        """A call went to ``replica_uid`` over its link: count it as ``on_request_routed`` counts Serve's."""
        for rid in self.curr_replicas:
            if rid.unique_id == replica_uid:
                self._on_linked(_Args(args), rid)
                self._inflight.add(request_id, rid, max(1.0, self._amount(_Args(args))))
                return

    def linked_done(self, request_id: str) -> None:
        self._inflight.done(request_id)

    def live_uids(self) -> set[str]:
        return {rid.unique_id for rid in self.curr_replicas}

    def _on_linked(self, args: _Args, replica_id: ReplicaID) -> None:
        """What a routed call records besides its in-flight count (the LLM pool: its prefix)."""

    def _load(self, replica: RunningReplica) -> float:
        """Others' share of the replica's last report plus this router's own in flight now
        (router.routing.inflight: a report that arrives late does not count this router's finished calls)."""
        stamp = replica.routing_stats.get(REPORTED_AT)
        reported_at = float(stamp) if isinstance(stamp, int | float) else None
        return self._inflight.load(replica.replica_id, self._reported(replica), reported_at)

    def _reported(self, replica: RunningReplica) -> float:
        raise NotImplementedError

    def _amount(self, pending_request: PendingRequest | _Args) -> float:
        raise NotImplementedError

    def _rank(
        self, pending_request: PendingRequest | _Args | None, load: dict[ReplicaID, float]
    ) -> list[ReplicaID]:
        return least_loaded(load)

    async def choose_replicas(
        self, candidate_replicas: list[RunningReplica], pending_request: PendingRequest | None = None
    ) -> Sequence[list[RunningReplica]]:
        if pending_request is not None:
            pending_request.routing_context.should_backoff = True
        load = {r.replica_id: self._load(r) for r in candidate_replicas}
        by_id = {r.replica_id: r for r in candidate_replicas}
        return [[by_id[rid]] for rid in self._rank(pending_request, load)]

    def on_request_routed(
        self, pending_request: PendingRequest, replica_id: ReplicaID, result: object
    ) -> None:
        self._inflight.add(
            pending_request.metadata.internal_request_id, replica_id, self._amount(pending_request)
        )

    def on_request_completed(self, replica_id: ReplicaID, internal_request_id: str) -> None:
        self._inflight.done(internal_request_id)

    def on_replica_actor_died(self, replica_id: ReplicaID) -> None:
        super().on_replica_actor_died(replica_id)
        self._inflight.forget(replica_id)


class LeastQueuedEmbeddingsRouter(FIFOMixin, _LoadAwareRouter):
    """Encoder pool: the replica with the fewest embeddings waiting to be computed (oldest request first)."""

    def _reported(self, replica: RunningReplica) -> float:
        return float(replica.routing_stats.get("queued_embeddings", 0.0))

    def _amount(self, pending_request: PendingRequest | _Args) -> float:
        return float(_request_arg(pending_request, "num_embeds", 0))


class PrefixAffinityRouter(_LoadAwareRouter):
    """LLM pool: longest cached prefix of the request's block hashes, balanced against load.

    A call that names ``target_replica`` (output channels, aborts) goes to that replica; if it is
    gone, anywhere (the replica that gets it answers "unknown channel", an abort is a no-op). No
    FIFOMixin here: it hands a chosen replica to the oldest pending request, whatever that one's
    own choice was, which would break both affinity and targeting.
    """

    def initialize_state(self, **kwargs: object) -> None:
        super().initialize_state(**kwargs)
        # Keyed by replica unique id: the ingress records forwarded requests by the id they report.
        self._index = shared_index(deployment_key(self._deployment_id))

    def _reported(self, replica: RunningReplica) -> float:
        stats = replica.routing_stats
        return float(stats.get("num_running", 0)) + float(stats.get("num_waiting", 0))

    def _amount(self, pending_request: PendingRequest | _Args) -> float:
        return 0.0 if _request_arg(pending_request, "target_replica", "") else 1.0

    def _rank(
        self, pending_request: PendingRequest | _Args | None, load: dict[ReplicaID, float]
    ) -> list[ReplicaID]:
        target = _request_arg(pending_request, "target_replica", "")
        if target:
            for rid in load:
                if rid.unique_id == target:
                    return [rid]
            return least_loaded(load)
        by_uid = {rid.unique_id: rid for rid in load}
        hashes = list(_request_arg(pending_request, "block_hashes", _NO_HASHES))
        order = self._index.choose(hashes, {rid.unique_id: v for rid, v in load.items()})
        return [by_uid[uid] for uid in order]

    def on_request_routed(
        self, pending_request: PendingRequest, replica_id: ReplicaID, result: object
    ) -> None:
        if not _request_arg(pending_request, "target_replica", ""):
            self._index.record(
                replica_id.unique_id, list(_request_arg(pending_request, "block_hashes", _NO_HASHES))
            )
        super().on_request_routed(pending_request, replica_id, result)

    def _on_linked(self, args: _Args, replica_id: ReplicaID) -> None:
        if not _request_arg(args, "target_replica", ""):
            self._index.record(replica_id.unique_id, list(_request_arg(args, "block_hashes", _NO_HASHES)))

    def on_replica_actor_died(self, replica_id: ReplicaID) -> None:
        super().on_replica_actor_died(replica_id)
        self._index.remove_replica(replica_id.unique_id)


class FreeKVRouter(PrefixAffinityRouter):
    """E/P/D's decode pool: the replica with the most free KV and the least load
    (router.routing.decode_choice); calls naming ``target_replica`` (channels, aborts) go there. The
    load is ``PrefixAffinityRouter``'s (running + waiting, this router's own in flight exact:
    router.routing.inflight); the KV is each replica's last routing report (``kv_usage``, and what
    it has free of what the import needs: ``num_free_blocks``, ``num_free_window_blocks``,
    ``num_free_state_slots``); replicas that refused this hand-off already (``refused_by``) go last."""

    def _rank(
        self, pending_request: PendingRequest | _Args | None, load: dict[ReplicaID, float]
    ) -> list[ReplicaID]:
        if _request_arg(pending_request, "target_replica", ""):
            return super()._rank(pending_request, load)
        stats = {rid: r.routing_stats for rid, r in self.curr_replicas.items() if rid in load}
        usage = {rid: float(s.get("kv_usage", 0.0)) for rid, s in stats.items()}
        handoff = _request_arg(pending_request, "handoff", None)
        need = ImportNeed(
            int(getattr(handoff, "num_blocks", 0) or 0),
            int(getattr(handoff, "num_window_blocks", 0) or 0),
            int(getattr(handoff, "num_state_slots", 0) or 0),
        )
        refused_uids = set(getattr(handoff, "refused_by", ()) or ())
        refused = [rid for rid in load if rid.unique_id in refused_uids]
        return rank_decode(load, usage, stats, need, refused)

    def on_request_routed(
        self, pending_request: PendingRequest, replica_id: ReplicaID, result: object
    ) -> None:
        _LoadAwareRouter.on_request_routed(self, pending_request, replica_id, result)  # no prefix index

    def _on_linked(self, args: _Args, replica_id: ReplicaID) -> None:
        """Decode replicas compute no prompts: nothing for a prefix index."""
