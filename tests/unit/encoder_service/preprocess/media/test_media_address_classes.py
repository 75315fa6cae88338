"""Address classes (issue 11, item 10) as pure functions over address lists: nothing resolves or connects.

The expectations are the IANA special-purpose registries (IPv4 and IPv6) and the IPv6 address space
registry, written out here by hand from the registries, independently of the module's table.
"""

from __future__ import annotations

import ipaddress

import pytest

from encoder_service.preprocess.errors import URLNotAllowed
from encoder_service.preprocess.media.address_classes import address_refusal
from encoder_service.preprocess.media.url_safety import check_addresses, resolve_checked

# one address inside every IPv4 special-purpose block (and its edges where the old check slipped)
REFUSED_V4 = [
    "0.0.0.0", "0.1.2.3",  # this network
    "10.0.0.1", "172.16.0.1", "172.31.255.255", "192.168.0.1",  # private-use
    "100.64.0.1", "100.127.255.254",  # shared address space (carrier-grade NAT)
    "127.0.0.1", "127.255.255.254",  # loopback
    "169.254.169.254",  # link-local (cloud metadata)
    "192.0.0.1", "192.0.0.8", "192.0.0.9", "192.0.0.10", "192.0.0.170", "192.0.0.255",  # IETF protocol
    "192.0.2.1", "198.51.100.7", "203.0.113.9",  # documentation
    "192.31.196.1", "192.175.48.1",  # AS112
    "192.52.193.1",  # AMT
    "192.88.99.1",  # deprecated 6to4 relay anycast
    "198.18.0.1", "198.19.255.254",  # benchmarking
    "224.0.0.1", "239.255.255.250",  # multicast
    "240.0.0.1", "255.255.255.254", "255.255.255.255",  # reserved, limited broadcast
]  # fmt: skip

REFUSED_V6 = [
    "::1", "::",  # loopback, unspecified
    "::ffff:127.0.0.1", "::ffff:10.0.0.1", "::ffff:192.0.0.9", "::ffff:0:0",  # IPv4-mapped, judged as v4
    "::127.0.0.1", "::8.8.8.8",  # deprecated IPv4-compatible: reserved ::/8
    "64:ff9b::7f00:1", "64:ff9b::a9fe:a9fe", "64:ff9b::c000:2",  # NAT64 of loopback, metadata, TEST-NET
    "64:ff9b:1::1",  # local-use translation
    "100::1", "100:0:0:1::1",  # discard-only, dummy prefix
    "2001::1", "2001:0:4136:e378:8000:63bf:3fff:fdd2",  # Teredo
    "2001:1::1", "2001:2::1", "2001:3::1", "2001:4:112::1", "2001:20::1", "2001:30::1",  # 2001::/23
    "2001:db8::1", "2001:db8:ffff::1", "3fff::1", "3fff:fff::1",  # documentation
    "2002:7f00:1::1", "2002:0a00:0001::1", "2002:c0a8:0101::1", "2002:c000:0201::1",  # 6to4 of private v4
    "2620:4f:8000::1",  # AS112
    "5f00::1",  # SRv6 SIDs
    "fc00::1", "fd12:3456::1",  # unique local
    "fe80::1", "fe80::1%eth0", "febf::1",  # link-local
    "fec0::1", "feff::1",  # site-local (deprecated; passed as public before)
    "ff02::1", "ff0e::1",  # multicast
    "4000::1", "8000::1", "e000::1", "1::1",  # outside 2000::/3: unallocated
    "2a00:1450::5efe:a00:1", "2a00:1450::200:5efe:c0a8:101",  # ISATAP ids carrying private v4
]  # fmt: skip

PUBLIC = [
    "8.8.8.8", "1.1.1.1", "93.184.216.34", "100.63.255.255", "100.128.0.1", "172.15.255.255",
    "172.32.0.1", "192.0.3.1", "198.17.255.255", "198.20.0.1", "223.255.255.255",
    "2606:4700:4700::1111", "2a00:1450:4001:82b::200e", "2001:200::1", "3ffe::1", "2c0f::1",
    "::ffff:8.8.8.8",  # mapped public v4
    "64:ff9b::808:808",  # NAT64 of 8.8.8.8
    "2002:0808:0808::1",  # 6to4 of a public v4
    "2a00:1450::5efe:808:808",  # ISATAP id carrying a public v4
]  # fmt: skip


@pytest.mark.parametrize("addr", REFUSED_V4 + REFUSED_V6)
def test_special_purpose_addresses_refused(addr):
    assert address_refusal(addr) is not None


@pytest.mark.parametrize("addr", PUBLIC)
def test_public_unicast_addresses_pass(addr):
    assert address_refusal(addr) is None


def test_cases_the_standard_library_calls_public():
    # what slipped through before: is_private / is_global alone called these fine
    slipped = [
        a for a in ("192.0.0.9", "fec0::1", "2001:30::1", "5f00::1") if ipaddress.ip_address(a).is_global
    ]
    slipped += [a for a in ("fec0::1",) if not ipaddress.ip_address(a).is_private]
    assert slipped  # the reference classifier really is too lax on these
    assert all(address_refusal(a) for a in slipped)


def test_reason_names_the_registry_block():
    assert address_refusal("192.0.0.9") == "ietf-protocol-assignments"
    assert address_refusal("fec0::1") == "site-local (deprecated)"
    assert address_refusal("::ffff:10.1.2.3") == "ipv4-mapped embedding private-use"
    assert address_refusal("2002:a9fe:a9fe::1") == "6to4 embedding link-local"
    assert address_refusal("64:ff9b::7f00:1") == "nat64 embedding loopback"


def test_every_ipv4_block_edge():
    # the first and last address of each private-use block are refused, their neighbours are not
    for first, last, below, above in [
        ("10.0.0.0", "10.255.255.255", "9.255.255.255", "11.0.0.0"),
        ("100.64.0.0", "100.127.255.255", "100.63.255.255", "100.128.0.0"),
        ("198.18.0.0", "198.19.255.255", "198.17.255.255", "198.20.0.0"),
        ("192.0.0.0", "192.0.0.255", "191.255.255.255", "192.0.1.0"),
    ]:
        assert address_refusal(first) and address_refusal(last)
        assert address_refusal(below) is None and address_refusal(above) is None


def test_one_refused_address_refuses_the_host_and_the_403_names_no_address():
    answers = {"cdn.test": ["8.8.8.8", "fec0::7"]}
    with pytest.raises(URLNotAllowed) as e:
        resolve_checked(
            "https://cdn.test/a.mp4",
            allowed_domains=None,
            allow_private_addresses=False,
            resolver=lambda host, port: answers[host],
            item=0,
            label="video 0",
        )
    msg = e.value.message
    assert e.value.status_code == 403 and msg.startswith("video 0: host 'cdn.test' is not allowed")
    for leak in ("fec0", "8.8.8.8", "site-local", "private", "resolves to"):
        assert leak not in msg
    with pytest.raises(URLNotAllowed, match="not allowed"):
        check_addresses("x.test", ["93.184.216.34", "192.0.0.9"])
    check_addresses("x.test", ["93.184.216.34", "2606:4700:4700::1111"])
