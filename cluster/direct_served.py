"""The pool replica's end of ``ingress.transport: auto`` (router/direct_link.py): a Serve replica
class mixes in ``DirectServed`` and names the methods a direct link may call.

The shared token every link must present lives in Ray's internal KV (the GCS), created once per
cluster by whichever process asks first: whoever can read it can run code on the cluster anyway.
"""

from __future__ import annotations

import secrets
from typing import Any, ClassVar

from router.direct_link import LinkServer

_TOKEN_KEY = b"mmserve-direct-link-token"


def link_token() -> str:
    """The cluster's direct-link token (created on first use)."""
    from ray.experimental import internal_kv

    internal_kv._internal_kv_put(_TOKEN_KEY, secrets.token_urlsafe(32).encode(), overwrite=False)
    token = internal_kv._internal_kv_get(_TOKEN_KEY)
    assert token is not None
    return bytes(token).decode()


def frame_dumps(obj: Any) -> bytes:
    """``ray.cloudpickle.dumps`` as Ray pickles a task's arguments ("in band"): each ObjectRef is
    written with its owner's address, and not pinned. Out of band (a bare ``cloudpickle.dumps``) Ray
    pins every ref it writes for the life of the process: 496 references left in the ingress after
    the 500-request leak test. The object stays alive while its owner holds it, as in Serve's own
    gRPC transport (README, "No pins")."""
    import ray
    from ray import cloudpickle

    ctx = ray._private.worker.global_worker.get_serialization_context()
    if ctx.is_in_band_serialization():  # inside another serialisation: leave its books alone
        return bytes(cloudpickle.dumps(obj))
    ctx.set_in_band_serialization()
    try:
        return bytes(cloudpickle.dumps(obj))
    finally:
        ctx.set_out_of_band_serialization()
        ctx.get_and_clear_contained_object_refs()


class DirectServed:
    """``direct_address()``: where this replica takes its ``DIRECT_METHODS`` as frames."""

    DIRECT_METHODS: ClassVar[dict[str, str]] = {}  # frame method -> this replica's method
    _link_server: LinkServer | None = None

    async def direct_address(self) -> tuple[str, int]:
        """Start listening on this node's address (the first time) and answer where."""
        import ray

        if self._link_server is None:
            handlers = {name: getattr(self, attr) for name, attr in self.DIRECT_METHODS.items()}
            self._link_server = LinkServer(handlers, link_token(), dumps=frame_dumps)
        return await self._link_server.address(ray.util.get_node_ip_address())
