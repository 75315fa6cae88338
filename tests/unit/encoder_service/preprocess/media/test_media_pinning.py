"""DNS-rebinding guard: a fetch connects only to the addresses its URL check resolved and checked.

Public addresses are only ever handed to ``FakeNetwork``, which records them and opens no socket; real
fetches go to a loopback server this module starts, through a network that refuses anything else.
"""

from __future__ import annotations

import asyncio
import ipaddress
import threading
from collections.abc import Iterable
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import httpcore
import httpx
import pytest

from encoder_service.preprocess.errors import MediaFetchError, URLNotAllowed
from encoder_service.preprocess.media import MediaLimits
from encoder_service.preprocess.media.fetch import fetch_http, next_hop
from encoder_service.preprocess.media.pinned_client import PinnedBackend, PinnedClient

PUBLIC, PUBLIC2 = "93.184.216.34", "93.184.216.35"
OK = b"HTTP/1.1 200 OK\r\nContent-Type: image/png\r\nContent-Length: 3\r\n\r\nabc"


def _redirect(location: str) -> bytes:
    return f"HTTP/1.1 302 Found\r\nLocation: {location}\r\nContent-Length: 0\r\n\r\n".encode()


class _FakeStream(httpcore.AsyncNetworkStream):
    def __init__(self, net: FakeNetwork, response: bytes) -> None:
        self._net, self._pending = net, response

    async def read(self, max_bytes: int, timeout: float | None = None) -> bytes:
        out, self._pending = self._pending[:max_bytes], self._pending[max_bytes:]
        return out

    async def write(self, buffer: bytes, timeout: float | None = None) -> None:
        self._net.sent += buffer

    async def aclose(self) -> None:
        pass

    async def start_tls(self, ssl_context, server_hostname=None, timeout=None) -> _FakeStream:
        self._net.tls_names.append(server_hostname)
        return self


class FakeNetwork(httpcore.AsyncNetworkBackend):
    """Records every connect and answers from ``responses`` (address -> raw HTTP); opens no socket."""

    def __init__(self, responses: dict[str, bytes]) -> None:
        self.responses = responses
        self.connected: list[tuple[str, int]] = []
        self.tls_names: list[str | None] = []
        self.sent = b""

    async def connect_tcp(self, host, port, timeout=None, local_address=None, socket_options=None):
        self.connected.append((host, port))
        if host not in self.responses:
            raise httpcore.ConnectError(f"fake network: {host} is down")
        return _FakeStream(self, self.responses[host])

    async def sleep(self, seconds: float) -> None:
        pass


class Rebinding:
    """Answers ``first`` to the first lookup of a name and ``later`` to every lookup after it."""

    def __init__(self, first: dict[str, list[str]], later: str = "127.0.0.1") -> None:
        self.first, self.later, self.calls = first, later, []

    def __call__(self, host: str, port: int) -> list[str]:
        self.calls.append(host)
        return self.first[host] if self.calls.count(host) == 1 else [self.later]


def _fetch(url: str, net: httpcore.AsyncNetworkBackend, resolver, limits=None) -> tuple[bytes, str | None]:
    async def go():
        async with PinnedClient(timeout=5.0, network=net) as client:
            got = await fetch_http(url, limits or MediaLimits(), item=1, client=client, resolver=resolver)
        return got.data, got.content_type

    return asyncio.run(go())


@pytest.mark.parametrize(("scheme", "port"), [("http", 80), ("https", 443)])
def test_connection_goes_to_the_checked_address(scheme, port):
    net, resolver = FakeNetwork({PUBLIC: OK}), Rebinding({"media.test": [PUBLIC]})
    assert _fetch(f"{scheme}://media.test/a.png", net, resolver) == (b"abc", "image/png")
    assert net.connected == [(PUBLIC, port)]  # not 127.0.0.1, which a second lookup would have said
    assert resolver.calls == ["media.test"]
    assert b"\r\nHost: media.test\r\n" in net.sent
    assert net.tls_names == (["media.test"] if scheme == "https" else [])  # SNI + cert check by name


def test_redirect_hops_each_checked_and_pinned():
    net = FakeNetwork({PUBLIC: _redirect("http://other.test/b.png"), PUBLIC2: OK})
    resolver = Rebinding({"media.test": [PUBLIC], "other.test": [PUBLIC2]})
    assert _fetch("http://media.test/a.png", net, resolver)[0] == b"abc"
    assert net.connected == [(PUBLIC, 80), (PUBLIC2, 80)]
    # a hop back to a name that now answers loopback is refused before any connection to it
    net = FakeNetwork({PUBLIC: _redirect("/again.png")})
    resolver = Rebinding({"media.test": [PUBLIC]})
    with pytest.raises(URLNotAllowed, match=r"^media: host 'media.test' is not allowed") as e:
        _fetch("http://media.test/a.png", net, resolver)
    assert e.value.item == 1 and e.value.status_code == 403
    assert net.connected == [(PUBLIC, 80)]


def test_a_redirect_from_https_to_http_is_refused_before_connecting_to_it():
    net = FakeNetwork({PUBLIC: _redirect("http://other.test/b.png"), PUBLIC2: OK})
    resolver = Rebinding({"media.test": [PUBLIC], "other.test": [PUBLIC2]})
    with pytest.raises(
        MediaFetchError, match=r"^media: https://media\.test/a\.png redirects from https to http"
    ) as e:
        _fetch("https://media.test/a.png", net, resolver)
    assert e.value.item == 1 and e.value.status_code == 400
    assert net.connected == [(PUBLIC, 443)] and resolver.calls == ["media.test"]  # the http hop: never
    # the other way, http -> https, is followed
    net = FakeNetwork({PUBLIC: _redirect("https://other.test/b.png"), PUBLIC2: OK})
    resolver = Rebinding({"media.test": [PUBLIC], "other.test": [PUBLIC2]})
    assert _fetch("http://media.test/a.png", net, resolver)[0] == b"abc"
    assert net.connected == [(PUBLIC, 80), (PUBLIC2, 443)]


@pytest.mark.parametrize(
    ("url", "location", "target"),
    [
        ("https://a.test/x", "/y", "https://a.test/y"),
        ("https://a.test/x", "//b.test/y", "https://b.test/y"),
        ("https://a.test/x", "HTTPS://b.test/y", "https://b.test/y"),
        ("http://a.test/x", "https://b.test/y", "https://b.test/y"),
        ("http://a.test/x", "http://b.test/y", "http://b.test/y"),
        ("https://a.test/x", "http://b.test/y", None),
        ("https://a.test/x", "HTTP://a.test/y", None),
        ("HTTPS://a.test/x", "http://a.test/y", None),
    ],
)
def test_next_hop_never_drops_tls(url, location, target):
    if target is None:
        with pytest.raises(MediaFetchError, match="redirects from https to http") as e:
            next_hop(url, location, item=4, label="image 4")
        assert e.value.item == 4 and str(e.value).startswith("image 4: ")
    else:
        assert next_hop(url, location).lower() == target


def test_backend_maps_host_to_pinned_addresses_only():
    net = FakeNetwork({PUBLIC2: OK})  # PUBLIC is down: the next pinned address is tried
    backend = PinnedBackend(net)
    backend.pin("media.test", 80, [PUBLIC, PUBLIC2])
    asyncio.run(backend.connect_tcp("MEDIA.test", 80))
    assert net.connected == [(PUBLIC, 80), (PUBLIC2, 80)]
    for host, port in (("evil.test", 80), ("media.test", 8080)):
        with pytest.raises(httpcore.ConnectError, match="was not checked"):
            asyncio.run(backend.connect_tcp(host, port))
    assert len(net.connected) == 2  # never pinned: no connection attempted at all
    with pytest.raises(ValueError):
        backend.pin("empty.test", 80, [])


def test_pins_are_bounded_oldest_first():
    from encoder_service.preprocess.media.pinned_client import MAX_PINS

    backend = PinnedBackend(FakeNetwork({}))
    for i in range(MAX_PINS + 10):
        backend.pin(f"h{i}.test", 443, [PUBLIC])
    backend.pin("h10.test", 443, [PUBLIC])  # re-pinned: newest again
    assert backend.addresses_for(f"h{MAX_PINS + 9}.test", 443) == (PUBLIC,)
    assert backend.addresses_for("h10.test", 443) == (PUBLIC,)
    with pytest.raises(httpcore.ConnectError, match="was not checked"):
        backend.addresses_for("h0.test", 443)  # evicted: refused, never resolved


def test_plain_httpx_client_is_refused():
    async def go():
        async with httpx.AsyncClient() as plain:
            await fetch_http("http://media.test/a.png", MediaLimits(), client=plain, resolver=Rebinding({}))

    with pytest.raises(TypeError, match="PinnedClient"):
        asyncio.run(go())


class _HostEcho(BaseHTTPRequestHandler):
    def log_message(self, *args):
        pass

    def do_GET(self):
        if self.path.startswith("/redirect?to="):
            self.send_response(302)
            self.send_header("Location", self.path.split("=", 1)[1])
            body = b""
        else:
            self.send_response(200)
            body = self.headers["Host"].encode()
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)


@pytest.fixture(scope="module")
def port():
    srv = ThreadingHTTPServer(("127.0.0.1", 0), _HostEcho)
    srv.daemon_threads = True
    threading.Thread(target=srv.serve_forever, daemon=True).start()
    yield srv.server_address[1]
    srv.shutdown()


class LoopbackOnly(httpcore.AnyIOBackend):
    """The real network, for loopback addresses only; records each address it connects to."""

    def __init__(self) -> None:
        self.connected: list[tuple[str, int]] = []

    async def connect_tcp(
        self,
        host: str,
        port: int,
        timeout: float | None = None,
        local_address: str | None = None,
        socket_options: Iterable[httpcore.SOCKET_OPTION] | None = None,
    ) -> httpcore.AsyncNetworkStream:
        assert ipaddress.ip_address(host).is_loopback, f"test tried to connect to {host}"
        self.connected.append((host, port))
        return await super().connect_tcp(host, port, timeout, local_address, socket_options)


LOOP = MediaLimits(allow_private_addresses=True, fetch_timeout_s=5.0)


def test_real_fetch_keeps_host_header_and_uses_pinned_ip(port):
    # media.test / cdn.test exist only in this resolver: the fetch succeeds only through the pin
    resolver = Rebinding({"media.test": ["127.0.0.1"], "cdn.test": ["127.0.0.1"]})
    net = LoopbackOnly()
    url = f"http://media.test:{port}/redirect?to=http://cdn.test:{port}/x"
    assert _fetch(url, net, resolver, LOOP)[0] == f"cdn.test:{port}".encode()
    assert net.connected == [("127.0.0.1", port), ("127.0.0.1", port)]
    assert resolver.calls == ["media.test", "cdn.test"]
    # the default client (made by fetch_http itself) pins the same way
    got = asyncio.run(fetch_http(f"http://media.test:{port}/x", LOOP, resolver=Rebinding(resolver.first)))
    assert got.data == f"media.test:{port}".encode()
