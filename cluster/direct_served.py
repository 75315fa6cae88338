"""The pool replica's end of ``ingress.transport: auto`` (router/direct_link.py): a Serve replica
class mixes in ``DirectServed`` and names the methods a direct link may call.

The shared token every link must present lives in Ray's internal KV (the GCS), created once per
cluster by whichever process asks first: whoever can read it can run code on the cluster anyway.
"""

from __future__ import annotations

import secrets
from typing import ClassVar

from router.direct_link import LinkServer

_TOKEN_KEY = b"mmserve-direct-link-token"


def link_token() -> str:
    """The cluster's direct-link token (created on first use)."""
    from ray.experimental import internal_kv

    internal_kv._internal_kv_put(_TOKEN_KEY, secrets.token_urlsafe(32).encode(), overwrite=False)
    token = internal_kv._internal_kv_get(_TOKEN_KEY)
    assert token is not None
    return bytes(token).decode()


class DirectServed:
    """``direct_address()``: where this replica takes its ``DIRECT_METHODS`` as frames."""

    DIRECT_METHODS: ClassVar[dict[str, str]] = {}  # frame method -> this replica's method
    _link_server: LinkServer | None = None

    async def direct_address(self) -> tuple[str, int]:
        """Start listening on this node's address (the first time) and answer where."""
        import ray
        from ray import cloudpickle

        if self._link_server is None:
            handlers = {name: getattr(self, attr) for name, attr in self.DIRECT_METHODS.items()}
            self._link_server = LinkServer(handlers, link_token(), dumps=cloudpickle.dumps)
        return await self._link_server.address(ray.util.get_node_ip_address())
