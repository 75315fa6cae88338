"""Which IP addresses a media fetch may connect to: public unicast only, by the IANA registries.

``ipaddress``'s ``is_private`` / ``is_global`` lag the registries (``192.0.0.0/24`` and ``fec0::/10``
passed as public), so the blocks are listed here, each with its registry name, from:

- IANA IPv4 Special-Purpose Address Registry (RFC 6890 and updates), plus multicast (224.0.0.0/4);
- IANA IPv6 Special-Purpose Address Registry, plus the IPv6 Address Space registry: only
  ``2000::/3`` is allocated global unicast, so everything outside it is refused (ULA, link-local,
  site-local ``fec0::/10``, multicast, the reserved ``::/8`` with the IPv4-compatible form, ...).

Every special-purpose block is refused, even the few the registry marks globally reachable (PCP/TURN
anycast, AS112, AMT): none of them serves media. Addresses that carry an IPv4 address are judged by it:
IPv4-mapped ``::ffff:a.b.c.d``, NAT64 ``64:ff9b::a.b.c.d`` (RFC 6052), 6to4 ``2002:AABB:CCDD::/48``,
and ISATAP interface ids (``…:0:5efe:a.b.c.d``); Teredo (``2001::/32``) lies in ``2001::/23`` and is
refused whatever it embeds. Pure functions: nothing here resolves or connects.
"""

from __future__ import annotations

import ipaddress

IPAddress = ipaddress.IPv4Address | ipaddress.IPv6Address

_V4_BLOCKS: tuple[tuple[str, str], ...] = (
    ("0.0.0.0/8", "this-network"),
    ("10.0.0.0/8", "private-use"),
    ("100.64.0.0/10", "shared-address-space (CGN)"),
    ("127.0.0.0/8", "loopback"),
    ("169.254.0.0/16", "link-local"),
    ("172.16.0.0/12", "private-use"),
    ("192.0.0.0/24", "ietf-protocol-assignments"),
    ("192.0.2.0/24", "documentation (TEST-NET-1)"),
    ("192.31.196.0/24", "as112-v4"),
    ("192.52.193.0/24", "amt"),
    ("192.88.99.0/24", "deprecated-6to4-relay-anycast"),
    ("192.168.0.0/16", "private-use"),
    ("192.175.48.0/24", "as112-direct-delegation"),
    ("198.18.0.0/15", "benchmarking"),
    ("198.51.100.0/24", "documentation (TEST-NET-2)"),
    ("203.0.113.0/24", "documentation (TEST-NET-3)"),
    ("224.0.0.0/4", "multicast"),
    ("240.0.0.0/4", "reserved"),  # includes 255.255.255.255/32, limited broadcast
)

_V6_GLOBAL_UNICAST = ipaddress.IPv6Network("2000::/3")
_V6_BLOCKS: tuple[tuple[str, str], ...] = (
    # outside 2000::/3 these are refused anyway; named so the reason is precise
    ("::1/128", "loopback"),
    ("::/128", "unspecified"),
    ("64:ff9b:1::/48", "local-use-ipv4-ipv6-translation"),
    ("100::/64", "discard-only"),
    ("100:0:0:1::/64", "dummy-prefix"),
    ("fc00::/7", "unique-local"),
    ("fe80::/10", "link-local"),
    ("fec0::/10", "site-local (deprecated)"),
    ("ff00::/8", "multicast"),
    # inside 2000::/3
    ("2001::/23", "ietf-protocol-assignments (incl. teredo 2001::/32)"),
    ("2001:db8::/32", "documentation"),
    ("2620:4f:8000::/48", "as112-direct-delegation"),
    ("3fff::/20", "documentation"),
    ("5f00::/16", "srv6-sids"),
)

_V4 = tuple((ipaddress.IPv4Network(n), why) for n, why in _V4_BLOCKS)
_V6 = tuple((ipaddress.IPv6Network(n), why) for n, why in _V6_BLOCKS)
_NAT64 = ipaddress.IPv6Network("64:ff9b::/96")
_SIXTOFOUR = ipaddress.IPv6Network("2002::/16")


def _v4_refusal(ip: ipaddress.IPv4Address) -> str | None:
    for net, why in _V4:
        if ip in net:
            return why
    return None


def _embedded_v4(ip: ipaddress.IPv6Address) -> tuple[ipaddress.IPv4Address, str] | None:
    """The IPv4 address an IPv6 form carries (and the form's name), or None."""
    if ip.ipv4_mapped is not None:
        return ip.ipv4_mapped, "ipv4-mapped"
    if ip in _NAT64:
        return ipaddress.IPv4Address(int(ip) & 0xFFFFFFFF), "nat64"
    if ip in _SIXTOFOUR:
        return ipaddress.IPv4Address((int(ip) >> 80) & 0xFFFFFFFF), "6to4"
    iid_high = (int(ip) >> 32) & 0xFFFFFFFF
    if iid_high in (0x00005EFE, 0x02005EFE):  # ISATAP (RFC 5214) interface identifier
        return ipaddress.IPv4Address(int(ip) & 0xFFFFFFFF), "isatap"
    return None


def _v6_refusal(ip: ipaddress.IPv6Address) -> str | None:
    embedded = _embedded_v4(ip)
    if embedded is not None:
        v4, form = embedded
        why = _v4_refusal(v4)
        if why is not None:
            return f"{form} embedding {why}"
        if form in ("ipv4-mapped", "nat64"):  # it IS that IPv4 address
            return None
    for net, why in _V6:
        if ip in net:
            return why
    if ip not in _V6_GLOBAL_UNICAST:
        return "not-global-unicast (outside 2000::/3)"
    return None


def address_refusal(addr: str) -> str | None:
    """Why ``addr`` is not a public unicast address (the registry's name for its block), or None.

    A zone id (``fe80::1%eth0``) is ignored; a string that is not an IP address raises ``ValueError``.
    """
    ip: IPAddress = ipaddress.ip_address(addr.split("%", 1)[0])
    if isinstance(ip, ipaddress.IPv4Address):
        return _v4_refusal(ip)
    return _v6_refusal(ip)
