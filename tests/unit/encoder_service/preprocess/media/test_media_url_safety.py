"""URL / path safety as pure functions: resolved address lists are fed in, no socket is opened."""

from __future__ import annotations

import os

import pytest

from encoder_service.preprocess.errors import URLNotAllowed
from encoder_service.preprocess.media.url_safety import (
    CheckedHost,
    address_refusal,
    check_url,
    domain_allowed,
    resolve_checked,
    resolve_local_path,
)

PUBLIC = "93.184.216.34"


@pytest.mark.parametrize(
    "addr",
    [
        "127.0.0.1",
        "10.1.2.3",
        "172.16.0.1",
        "192.168.1.1",
        "169.254.169.254",
        "0.0.0.0",
        "224.0.0.1",
        "240.0.0.1",
        "100.64.0.1",
        "::1",
        "fd00::1",
        "fe80::1",
        "::ffff:127.0.0.1",
        "::ffff:10.0.0.1",
        "2002:7f00:1::1",
        "ff02::1",
        "::",
    ],
)
def test_non_public_addresses_refused(addr):
    assert address_refusal(addr) is not None


@pytest.mark.parametrize("addr", [PUBLIC, "8.8.8.8", "2606:4700:4700::1111", "::ffff:8.8.8.8"])
def test_public_addresses_pass(addr):
    assert address_refusal(addr) is None


def _fake(answers):
    def resolver(host, port):
        return answers[host]

    return resolver


def test_every_resolved_address_is_checked():
    resolver = _fake({"ok.test": [PUBLIC], "mixed.test": [PUBLIC, "10.0.0.7"], "v6.test": ["fd12::5"]})
    check_url("https://ok.test/a.png", allowed_domains=None, allow_private_addresses=False, resolver=resolver)
    with pytest.raises(URLNotAllowed, match=r"host 'mixed.test' is not allowed") as e:
        check_url(
            "https://mixed.test/a.png",
            allowed_domains=None,
            allow_private_addresses=False,
            resolver=resolver,
            item=3,
            label="image 3",
        )
    assert e.value.status_code == 403 and e.value.item == 3 and str(e.value).startswith("image 3:")
    assert "10.0.0.7" not in str(e.value) and "private" not in str(e.value)  # nothing about where
    with pytest.raises(URLNotAllowed):
        check_url("http://v6.test/", allowed_domains=None, allow_private_addresses=False, resolver=resolver)
    for literal in ("http://127.0.0.1:8080/x", "http://[::ffff:169.254.169.254]/x", "http://[fe80::1]/"):
        with pytest.raises(URLNotAllowed):
            check_url(literal, allowed_domains=None, allow_private_addresses=False, resolver=_fake({}))
    # opted out: loopback allowed, resolver never consulted
    check_url("http://mixed.test/", allowed_domains=None, allow_private_addresses=True, resolver=_fake({}))


def test_resolve_checked_resolves_once_and_returns_what_it_checked():
    calls = []

    def resolver(host, port):
        calls.append((host, port))
        return {"ok.test": [PUBLIC, "2606:4700:4700::1111"], "lo.test": ["127.0.0.1"], "none.test": []}[host]

    kw = {"allowed_domains": None, "resolver": resolver}
    got = resolve_checked("https://OK.test/a.png", allow_private_addresses=False, **kw)
    assert got == CheckedHost("ok.test", 443, (PUBLIC, "2606:4700:4700::1111"))
    assert calls == [("ok.test", 443)]
    # opted out of the address check, the host is still resolved (the connection is pinned to it)
    got = resolve_checked("http://lo.test:8080/", allow_private_addresses=True, **kw)
    assert got == CheckedHost("lo.test", 8080, ("127.0.0.1",))
    with pytest.raises(URLNotAllowed, match="not allowed"):
        resolve_checked("http://lo.test/", allow_private_addresses=False, **kw)
    with pytest.raises(URLNotAllowed, match="did not resolve"):
        resolve_checked("http://none.test/", allow_private_addresses=True, **kw)
    calls.clear()
    got = resolve_checked("http://[::1]:81/", allow_private_addresses=True, **kw)
    assert got == CheckedHost("::1", 81, ("::1",)) and calls == []  # a literal is its own answer


def test_allow_list_and_schemes():
    resolver = _fake({"cdn.example.com": [PUBLIC], "evil.com": [PUBLIC]})
    allowed = ("example.com",)
    check_url(
        "https://cdn.example.com/a", allowed_domains=allowed, allow_private_addresses=False, resolver=resolver
    )
    for bad in ("https://evil.com/a", "https://example.com.evil.com/a", "https://notexample.com/a"):
        with pytest.raises(URLNotAllowed, match="allowed_domains"):
            check_url(bad, allowed_domains=allowed, allow_private_addresses=False, resolver=resolver)
    with pytest.raises(URLNotAllowed, match="scheme"):
        check_url("ftp://cdn.example.com/a", allowed_domains=None, allow_private_addresses=True)
    assert domain_allowed("A.Example.COM.", ["example.com"]) and not domain_allowed(
        "xexample.com", ["example.com"]
    )


def test_local_paths(tmp_path):
    root = tmp_path / "media"
    root.mkdir()
    (root / "ok.png").write_bytes(b"x")
    secret = tmp_path / "secret.txt"
    secret.write_text("s")
    os.symlink(secret, root / "link.png")
    assert resolve_local_path(f"file://{root}/ok.png", str(root)) == root / "ok.png"
    for url in (
        f"file://{root}/../secret.txt",
        f"file://{root}/link.png",
        "file:///etc/passwd",
        f"file://{root}/%2e%2e/secret.txt",
    ):
        with pytest.raises(URLNotAllowed, match="outside allowed_local_media_path"):
            resolve_local_path(url, str(root))
    with pytest.raises(URLNotAllowed, match="disabled"):
        resolve_local_path(f"file://{root}/ok.png", None)
    with pytest.raises(URLNotAllowed, match="remote host"):
        resolve_local_path("file://otherhost/x", str(root))
