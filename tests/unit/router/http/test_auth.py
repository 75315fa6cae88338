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


def test_operator_routes_need_the_operator_key_where_keys_are_on() -> None:
    from router.http.auth import OperatorKeyRequired

    KeyRing().authenticate_operator(None)  # no keys at all: open, as before
    ring = KeyRing({"sk-a": "team-a"}, operator_key="sk-op")
    ring.authenticate_operator("Bearer sk-op")
    with pytest.raises(OperatorKeyRequired) as e:
        ring.authenticate_operator("Bearer sk-a")
    assert e.value.status_code == 403 and e.value.body()["error"]["code"] == "operator_key_required"
    for header in (None, "Bearer sk-o", "Basic sk-op"):
        with pytest.raises(Unauthorized):
            ring.authenticate_operator(header)
    with pytest.raises(Unauthorized):
        ring.authenticate("Bearer sk-op")  # the operator key is no tenant's key
    with pytest.raises(OperatorKeyRequired):  # keys on, no operator key: nobody sees the counters
        KeyRing({"sk-a": "team-a"}).authenticate_operator("Bearer sk-a")
    only_operator = KeyRing(operator_key="sk-op")  # the API stays open; /stats does not
    assert only_operator.authenticate(None) is None
    with pytest.raises(Unauthorized):
        only_operator.authenticate_operator(None)
    assert "sk-op" not in repr(ring) and "an operator key" in repr(ring)
    with pytest.raises(ValueError, match="operator API key must differ"):
        KeyRing.from_sources("sk-same", operator_key="sk-same")
