"""API keys -> tenants, 401s in OpenAI's shape, the prefix-cache salt a tenant gets."""

from __future__ import annotations

from pathlib import Path

import pytest

from router.http.auth import DEFAULT_TENANT, KeyRing, Unauthorized, effective_cache_salt, load_keys_file


def test_open_server_without_keys() -> None:
    assert KeyRing().authenticate(None) is None and not KeyRing().enabled


def test_keys_name_tenants_and_bad_keys_are_401(tmp_path: Path) -> None:
    path = tmp_path / "keys.yaml"
    path.write_text("sk-a-1: team-a\nsk-a-2: team-a\n'sk-b': team-b\n")
    ring = KeyRing.from_sources("sk-solo", str(path))
    assert ring.authenticate("Bearer sk-a-1") == ring.authenticate("bearer  sk-a-2 ") == "team-a"
    assert ring.authenticate("Bearer sk-b") == "team-b"
    assert ring.authenticate("Bearer sk-solo") == DEFAULT_TENANT
    for header, why in [
        (None, "missing API key"),
        ("", "missing API key"),
        ("Bearer", "malformed"),
        ("Basic c2stYg==", "malformed"),
        ("Bearer sk-a-", "incorrect API key"),
        ("Bearer sk-a-10", "incorrect API key"),
        ("Bearer team-a", "incorrect API key"),
    ]:
        with pytest.raises(Unauthorized) as e:
            ring.authenticate(header)
        body = e.value.body()["error"]
        assert e.value.status_code == 401 and why in body["message"]
        assert body["type"] == "invalid_request_error" and body["code"] == "invalid_api_key"
        assert "sk-" not in body["message"]  # never echoes a key
    assert "sk-" not in repr(ring) and "3 tenants" in repr(ring)


@pytest.mark.parametrize("text", ["", "[sk-a]", "sk-a: ''", "'': team", "sk-a: [1]", "{{{"])
def test_bad_keys_files_are_refused_without_showing_keys(tmp_path: Path, text: str) -> None:
    path = tmp_path / "keys.yaml"
    path.write_text(text)
    with pytest.raises(ValueError) as e:
        load_keys_file(path)
    assert "sk-a" not in str(e.value)


def test_cache_salt_is_the_requests_when_open_and_always_the_tenants_with_keys() -> None:
    assert effective_cache_salt(None, None) is None
    assert effective_cache_salt(None, "s") == "s"  # vLLM's semantics, unchanged
    salts = {effective_cache_salt(t, s) for t in ("a", "b") for s in (None, "s", "t")}
    assert len(salts) == 6 and "s" not in salts and None not in salts
    # a client cannot pick a salt that lands in another tenant's space
    assert effective_cache_salt("a", '","b') != effective_cache_salt("a\\", "b")
