"""Which URLs and local paths the media loader may read (SSRF guard, domain allow-list, local root).

The checks are pure functions over already-resolved addresses, so they are tested without sockets;
``resolve_host`` is the one place that touches DNS and can be swapped for a fake. ``resolve_checked``
returns the addresses it checked so the fetch connects to exactly those (see ``pinned_client``).
"""

from __future__ import annotations

import ipaddress
import logging
import os
import socket
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path
from urllib.parse import unquote, urlsplit

from encoder_service.preprocess.errors import InvalidMediaInput, URLNotAllowed
from encoder_service.preprocess.media.address_classes import address_refusal

log = logging.getLogger(__name__)

Resolver = Callable[[str, int], list[str]]


def resolve_host(host: str, port: int) -> list[str]:
    """Every address ``host`` resolves to (IPv4 and IPv6)."""
    infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)
    return sorted({str(info[4][0]) for info in infos})


def check_addresses(
    host: str, addresses: Iterable[str], *, item: int | None = None, label: str = "media"
) -> None:
    """Refuse ``host`` if ANY of its resolved addresses is non-public (one private answer is enough).

    The client is told "not allowed" only: where the host resolved, and the class of that address,
    would map the server's internal network for whoever asks. The server's log says which address.
    """
    addresses = list(addresses)
    if not addresses:
        raise URLNotAllowed(f"{label}: host {host!r} did not resolve", item=item)
    for addr in addresses:
        why = address_refusal(addr)
        if why is not None:
            log.info("%s: refused host %r: it resolves to %s (%s)", label, host, addr, why)
            raise URLNotAllowed(
                f"{label}: host {host!r} is not allowed (only hosts whose every address is public "
                "may be fetched)",
                item=item,
            )


def domain_allowed(host: str, allowed_domains: Iterable[str]) -> bool:
    """``host`` equals an allowed domain or is a subdomain of one (``a.example.com`` under ``example.com``)."""
    host = host.lower().rstrip(".")
    for dom in allowed_domains:
        dom = dom.lower().strip(".")
        if host == dom or host.endswith("." + dom):
            return True
    return False


@dataclass(frozen=True)
class CheckedHost:
    """A URL's host and port and the addresses it resolved to ONCE, each checked: connect to these only."""

    host: str
    port: int
    addresses: tuple[str, ...]


def check_url(
    url: str,
    *,
    allowed_domains: Iterable[str] | None,
    allow_private_addresses: bool,
    resolver: Resolver = resolve_host,
    item: int | None = None,
    label: str = "media",
) -> None:
    """Check one http(s) URL (one redirect hop); with ``allow_private_addresses`` nothing is resolved."""
    if allow_private_addresses:
        _check_scheme_and_domain(url, allowed_domains, item, label)
        return
    resolve_checked(
        url,
        allowed_domains=allowed_domains,
        allow_private_addresses=False,
        resolver=resolver,
        item=item,
        label=label,
    )


def resolve_checked(
    url: str,
    *,
    allowed_domains: Iterable[str] | None,
    allow_private_addresses: bool,
    resolver: Resolver = resolve_host,
    item: int | None = None,
    label: str = "media",
) -> CheckedHost:
    """Check one http(s) URL and resolve its host exactly once; the connection must go to the result.

    The host is resolved even with ``allow_private_addresses`` so that the connection is still pinned.
    """
    host, port = _check_scheme_and_domain(url, allowed_domains, item, label)
    try:
        addresses = [host] if _is_ip_literal(host) else resolver(host, port)
    except OSError as e:
        raise URLNotAllowed(f"{label}: cannot resolve host {host!r}: {e}", item=item) from e
    if not addresses:
        raise URLNotAllowed(f"{label}: host {host!r} did not resolve", item=item)
    if not allow_private_addresses:
        check_addresses(host, addresses, item=item, label=label)
    return CheckedHost(host, port, tuple(addresses))


def _check_scheme_and_domain(
    url: str, allowed_domains: Iterable[str] | None, item: int | None, label: str
) -> tuple[str, int]:
    parts = urlsplit(url)
    if parts.scheme not in ("http", "https"):
        raise URLNotAllowed(f"{label}: scheme {parts.scheme!r} is not allowed for remote media", item=item)
    host = parts.hostname
    if not host:
        raise InvalidMediaInput(f"{label}: URL has no host", item=item)
    if allowed_domains is not None and not domain_allowed(host, allowed_domains):
        raise URLNotAllowed(f"{label}: host {host!r} is not in allowed_domains", item=item)
    try:
        port = parts.port
    except ValueError as e:
        raise InvalidMediaInput(f"{label}: URL has an invalid port: {e}", item=item) from e
    return host, port or (443 if parts.scheme == "https" else 80)


def _is_ip_literal(host: str) -> bool:
    try:
        ipaddress.ip_address(host)
    except ValueError:
        return False
    return True


def resolve_local_path(
    url: str, allowed_local_media_path: str | None, *, item: int | None = None, label: str = "media"
) -> Path:
    """Map a ``file://`` URL to a real path under ``allowed_local_media_path``, refusing escapes.

    Symlinks and ``..`` are resolved first and the RESULT must lie under the (resolved) root.
    """
    if not allowed_local_media_path:
        raise URLNotAllowed(f"{label}: file:// URLs are disabled (no allowed_local_media_path)", item=item)
    parts = urlsplit(url)
    if parts.netloc not in ("", "localhost"):
        raise URLNotAllowed(f"{label}: file:// URL with a remote host is not allowed", item=item)
    path = unquote(parts.path)
    if "\x00" in path:
        raise InvalidMediaInput(f"{label}: file:// path contains a NUL byte (%00)", item=item)
    if not path.startswith("/"):
        raise InvalidMediaInput(f"{label}: file:// URL needs an absolute path", item=item)
    root = Path(os.path.realpath(allowed_local_media_path))
    target = Path(os.path.realpath(path))
    if target != root and root not in target.parents:
        raise URLNotAllowed(f"{label}: path {path!r} is outside allowed_local_media_path", item=item)
    return target
