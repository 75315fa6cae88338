"""An httpx client that connects only to addresses that were checked: the DNS-rebinding guard.

httpx would resolve a host name again when it connects, so a DNS server that answers a public address
to the URL check and 127.0.0.1 a moment later would walk past the check. Here the connection pool's
network backend looks each host up in the pins the fetch set after checking it, and never in DNS:

    each hop:   resolve_checked(url) ─► backend.pin(host, port, checked addresses)
                client.stream(url)  ─► pool ─► backend.connect_tcp(host, port) ─► checked address 1, 2, …
                                              (host not pinned: ConnectError, no DNS lookup)

The URL keeps the host name, so the Host header, the https SNI name and the certificate check do too.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterable, Sequence

import httpcore
import httpx

# httpx's own defaults for AsyncClient (httpcore's pool has smaller ones)
_LIMITS = httpx.Limits(max_connections=100, max_keepalive_connections=20, keepalive_expiry=5.0)


MAX_PINS = 4096


class PinnedBackend(httpcore.AsyncNetworkBackend):
    """Connects a (host, port) to the addresses pinned for it, in order; refuses hosts never pinned.

    ``network`` does the real connecting (tests pass a fake that records and opens no socket).
    """

    def __init__(self, network: httpcore.AsyncNetworkBackend | None = None) -> None:
        self._network = network if network is not None else httpcore.AnyIOBackend()
        # Newest last; bounded, since a long-lived preprocessor may fetch from endless hosts. Every
        # fetch pins its hop right before connecting, so only a pin older than MAX_PINS newer ones
        # is ever missing, and then the connect is refused, never resolved here.
        self._pins: OrderedDict[tuple[str, int], tuple[str, ...]] = OrderedDict()

    def pin(self, host: str, port: int, addresses: Sequence[str]) -> None:
        """From now on ``host:port`` connects to ``addresses`` (already checked) and nothing else."""
        if not addresses:
            raise ValueError(f"no address to pin {host}:{port} to")
        key = (host.lower(), port)
        self._pins[key] = tuple(addresses)
        self._pins.move_to_end(key)
        while len(self._pins) > MAX_PINS:
            self._pins.popitem(last=False)

    def addresses_for(self, host: str, port: int) -> tuple[str, ...]:
        try:
            return self._pins[(host.lower(), port)]
        except KeyError:
            raise httpcore.ConnectError(
                f"{host}:{port} was not checked before connecting; refusing to resolve it here"
            ) from None

    async def connect_tcp(
        self,
        host: str,
        port: int,
        timeout: float | None = None,
        local_address: str | None = None,
        socket_options: Iterable[httpcore.SOCKET_OPTION] | None = None,
    ) -> httpcore.AsyncNetworkStream:
        last: httpcore.ConnectError | httpcore.ConnectTimeout | None = None
        for address in self.addresses_for(host, port):
            try:
                return await self._network.connect_tcp(
                    address, port, timeout=timeout, local_address=local_address, socket_options=socket_options
                )
            except (httpcore.ConnectError, httpcore.ConnectTimeout) as e:
                last = e  # every pinned address was checked: the next one is as safe
        assert last is not None  # pin() refuses an empty address list
        raise last

    async def connect_unix_socket(
        self,
        path: str,
        timeout: float | None = None,
        socket_options: Iterable[httpcore.SOCKET_OPTION] | None = None,
    ) -> httpcore.AsyncNetworkStream:
        raise httpcore.ConnectError("media is never fetched over a unix socket")

    async def sleep(self, seconds: float) -> None:
        await self._network.sleep(seconds)


class PinnedClient(httpx.AsyncClient):
    """``httpx.AsyncClient`` whose connections go through a ``PinnedBackend`` (``self.backend``).

    No redirects are followed and no proxy from the environment is used (a proxy would resolve the
    host itself). Share one client only between fetches under the same ``MediaLimits``: a pooled
    connection was checked under the policy of the fetch that opened it.
    """

    def __init__(self, *, timeout: float, network: httpcore.AsyncNetworkBackend | None = None) -> None:
        self.backend = PinnedBackend(network)
        transport = httpx.AsyncHTTPTransport(limits=_LIMITS)
        # httpx takes no network backend, so its pool is swapped for one with ours (same settings)
        transport._pool = httpcore.AsyncConnectionPool(
            ssl_context=httpx.create_ssl_context(),
            max_connections=_LIMITS.max_connections,
            max_keepalive_connections=_LIMITS.max_keepalive_connections,
            keepalive_expiry=_LIMITS.keepalive_expiry,
            network_backend=self.backend,
        )
        super().__init__(transport=transport, follow_redirects=False, timeout=timeout)
