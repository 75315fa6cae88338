"""Calls to any replica of a pool over direct links, routed as Serve would route them.

Every pool replica announces where it takes direct-link calls in its routing stats (``LINK_STAT``), which
Serve's controller polls every second and pushes to each handle's router with the live replica set. A
``PoolLinks`` asks this process's router of the pool (router/routing/request_routers.py: ``choose_linked``) for
the replica a Serve call would go to — prefix affinity for the LLM pool, fewest queued embeddings for
the encoder pool, both over the same in-flight counts — and sends the call as a frame on that replica's
link, one connection per (this process, replica), opened on first use and dropped when the replica
leaves the set. So a pool of many replicas, autoscaling or not, stays on the fast path:

    scale-up    the new replica joins the router's set; once its first routing stats name its link
                (≤ 1 s), calls start reaching it over the link
    scale-down  Serve drops the replica from the set before stopping it, so new calls go elsewhere;
                a frame that still reaches it while it drains is answered ``LinkLost`` unrun, and the
                caller sends it again through Serve (router.protocol.errors.replica_gone)

Until the router exists (this process made no Serve call to the pool yet) or no replica has announced
a link, ``pick`` answers None and the caller goes through Serve's handle. No Ray here: the wiring
(cluster/replica_links.py) gives the router lookup and the link factory.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Protocol

from mmcore.link.direct_link import DirectLink

Address = tuple[str, int]
LINK_STAT = "link"  # routing-stats key: (host, port) where a replica takes direct-link calls


class LinkRouter(Protocol):
    """What ``PoolLinks`` needs of a pool's router (request_routers._LoadAwareRouter)."""

    def choose_linked(self, args: tuple[object, ...]) -> tuple[str, Address] | None: ...

    def linked_routed(self, request_id: str, replica_uid: str, args: tuple[object, ...]) -> None: ...

    def linked_done(self, request_id: str) -> None: ...

    def live_uids(self) -> set[str]: ...


_ROUTERS: dict[str, LinkRouter] = {}  # deployment key -> this process's router of that pool


def register_router(key: str, router: LinkRouter) -> None:
    """A pool's Serve router (``deployment_key``) was made in this process. Kept here, not beside the
    router classes: Serve ships those classes by value, so each copy has module globals of its own."""
    _ROUTERS[key] = router


def live_router(key: str) -> LinkRouter | None:
    """This process's router of the pool ``key``, once a handle to it made one."""
    return _ROUTERS.get(key)


class PoolLinks:
    """Direct links to the replicas of one pool (per process and pool)."""

    def __init__(
        self, router: Callable[[], LinkRouter | None], connect: Callable[[Address], DirectLink]
    ) -> None:
        self._router = router
        self._connect = connect
        self._links: dict[str, tuple[Address, DirectLink]] = {}  # replica unique id -> its link
        self._routed: dict[str, LinkRouter] = {}  # request id -> the router that counts it
        self._picks = 0

    def pick(self, *args: object) -> tuple[str, DirectLink] | None:
        """The replica a call with ``args`` goes to and its link; None: send it through Serve."""
        router = self._router()
        if router is None:
            return None
        chosen = router.choose_linked(args)
        if chosen is None:
            return None
        uid, address = chosen
        self._picks += 1
        if self._picks % 256 == 0:  # replicas come and go: close the links of those that left
            self.forget(router.live_uids())
        link = self._link(uid, address)
        if not link.usable():  # lost lately: Serve knows better where its successor is
            return None
        return uid, link

    def routed(self, request_id: str, replica_uid: str, *args: object) -> None:
        """``request_id`` went to ``replica_uid``: counted in flight there until ``done``."""
        router = self._router()
        if router is not None:
            router.linked_routed(request_id, replica_uid, args)
            self._routed[request_id] = router

    def done(self, request_id: str) -> None:
        router = self._routed.pop(request_id, None)
        if router is not None:
            router.linked_done(request_id)

    def link(self, replica_uid: str) -> DirectLink | None:
        """The open link to ``replica_uid``, if this process has one (aborts go where the request went)."""
        entry = self._links.get(replica_uid)
        return entry[1] if entry is not None and entry[1].usable() else None

    def _link(self, uid: str, address: Address) -> DirectLink:
        entry = self._links.get(uid)
        if entry is not None and entry[0] == address:
            return entry[1]
        if entry is not None:  # the replica moved (restarted in place): forget the old connection
            entry[1].close()
        link = self._connect(address)
        self._links[uid] = (address, link)
        return link

    def forget(self, live: set[str]) -> None:
        """Retire the links of replicas no longer in ``live``: a replica leaves the set before it
        drains, so what runs on its link (an output channel's stream) goes on to its end."""
        for uid in [u for u in self._links if u not in live]:
            self._links.pop(uid)[1].retire()

    def close(self) -> None:
        for _, link in self._links.values():
            link.close()
        self._links.clear()
