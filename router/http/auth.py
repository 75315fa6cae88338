"""API keys and tenants at the front door (pure: no Ray, no FastAPI).

Keys come from ``--api-key`` / ``MMSERVE_API_KEY`` (one key, tenant ``default``, as ``vllm serve
--api-key``) and from a keys file mapping each key to a tenant name (YAML or JSON,
``{"sk-...": "team-a", ...}``; several keys may name one tenant). With no key configured the server
is open and every request belongs to the anonymous tenant ``None``.

Only SHA-256 digests of the keys are kept in memory. A presented key's digest is compared with every
stored digest in constant time (``hmac.compare_digest``, no early exit), so neither the comparison
time nor its position tells anything about the keys. Keys never reach a log line or an error body.

An operator key (``--operator-api-key`` / ``MMSERVE_OPERATOR_API_KEY`` / ``ingress.operator_api_key``)
alone opens the operator routes (``/stats``: counters across every tenant, which would tell one tenant
whether another sent an image). Where API keys are on, a tenant's key there is a 403
``operator_key_required``, as is every key when no operator key is set; with no key of either kind
configured the server is open, ``/stats`` too. The operator key is kept and compared as the others.

The tenant name scopes what a client can name: its media ``uuid`` values (encoder_service/preprocess/hashing.py)
and, by default, its prefix-cache salt (``effective_cache_salt``).
"""

from __future__ import annotations

import hashlib
import hmac
import json
from collections.abc import Mapping
from pathlib import Path

import yaml

from router.protocol.errors import APIError
from router.protocol.openai import ErrorBody, error_body

DEFAULT_TENANT = "default"  # the tenant of the single --api-key / MMSERVE_API_KEY key
API_KEY_ENV = "MMSERVE_API_KEY"
OPERATOR_KEY_ENV = "MMSERVE_OPERATOR_API_KEY"


class Unauthorized(APIError):
    """401 in OpenAI's shape (``invalid_request_error`` / ``invalid_api_key``)."""

    def __init__(self, message: str) -> None:
        super().__init__(401, message, code="invalid_api_key")

    def body(self) -> ErrorBody:
        return error_body(self.message, type_="invalid_request_error", code=self.code)

    def headers(self) -> dict[str, str]:
        return {"WWW-Authenticate": "Bearer"}


class OperatorKeyRequired(APIError):
    """403: a valid tenant key on an operator route."""

    def __init__(self) -> None:
        super().__init__(
            403,
            "this route shows counters across tenants: it needs the operator key (--operator-api-key)",
            code="operator_key_required",
        )


def key_digest(key: str) -> bytes:
    return hashlib.sha256(key.encode()).digest()


def load_keys_file(path: str | Path) -> dict[str, str]:
    """``{api key: tenant}`` from a YAML/JSON mapping; a ValueError names what is wrong (never a key)."""
    try:
        data = yaml.safe_load(Path(path).read_text())
    except (OSError, yaml.YAMLError) as e:
        raise ValueError(f"api keys file {path}: cannot read it as YAML/JSON ({type(e).__name__})") from e
    if not isinstance(data, dict) or not data:
        raise ValueError(f"api keys file {path}: expected a non-empty mapping of API key to tenant name")
    out: dict[str, str] = {}
    for i, (key, tenant) in enumerate(data.items()):
        if not isinstance(key, str) or not key.strip() or not isinstance(tenant, str) or not tenant.strip():
            raise ValueError(f"api keys file {path}: entry {i} must map a non-empty key to a tenant name")
        out[key.strip()] = tenant.strip()
    return out


class KeyRing:
    """Which tenant a request's ``Authorization: Bearer <key>`` names; open when empty."""

    def __init__(self, keys: Mapping[str, str] | None = None, operator_key: str | None = None) -> None:
        self._digests: list[tuple[bytes, str]] = [(key_digest(k), t) for k, t in (keys or {}).items()]
        self._operator = key_digest(operator_key) if operator_key else None

    @classmethod
    def from_sources(
        cls, api_key: str | None = None, keys_file: str | None = None, operator_key: str | None = None
    ) -> KeyRing:
        keys = load_keys_file(keys_file) if keys_file else {}
        if api_key:
            keys[api_key] = DEFAULT_TENANT
        if operator_key and operator_key in keys:
            raise ValueError("the operator API key must differ from every tenant's API key")
        return cls(keys, operator_key)

    @property
    def enabled(self) -> bool:
        return bool(self._digests)

    @property
    def tenants(self) -> set[str]:
        return {t for _, t in self._digests}

    def __repr__(self) -> str:  # never the digests
        operator = ", an operator key" if self._operator else ""
        return f"KeyRing({len(self._digests)} keys, {len(self.tenants)} tenants{operator})"

    def authenticate_operator(self, authorization: str | None) -> None:
        """Let an operator route through: open when no key of either kind is configured, else only for
        the operator key. A tenant's valid key is a 403 ``operator_key_required``; a missing, malformed
        or unknown one a 401."""
        if not self._digests and self._operator is None:
            return
        if not authorization:
            raise Unauthorized("missing API key: send the operator key as 'Authorization: Bearer <key>'")
        scheme, _, key = authorization.strip().partition(" ")
        if scheme.lower() != "bearer" or not key.strip():
            raise Unauthorized("malformed Authorization header: expected 'Bearer <key>'")
        presented = key_digest(key.strip())
        is_operator = self._operator is not None and hmac.compare_digest(presented, self._operator)
        is_tenant = False
        for digest, _ in self._digests:  # every digest, no early exit, as authenticate()
            if hmac.compare_digest(presented, digest):
                is_tenant = True
        if is_operator:
            return
        if is_tenant:
            raise OperatorKeyRequired()
        raise Unauthorized("incorrect API key provided")

    def authenticate(self, authorization: str | None) -> str | None:
        """The tenant of the key in an ``Authorization`` header value; None when no keys are set.

        Raises ``Unauthorized`` (401) for a missing, malformed or unknown key."""
        if not self._digests:
            return None
        if not authorization:
            raise Unauthorized("missing API key: send it as 'Authorization: Bearer <key>'")
        scheme, _, key = authorization.strip().partition(" ")
        if scheme.lower() != "bearer" or not key.strip():
            raise Unauthorized("malformed Authorization header: expected 'Bearer <key>'")
        presented = key_digest(key.strip())
        found: str | None = None
        for digest, tenant in self._digests:  # every digest, no early exit: constant time in the key
            if hmac.compare_digest(presented, digest):
                found = tenant
        if found is None:
            raise Unauthorized("incorrect API key provided")
        return found


def effective_cache_salt(tenant: str | None, cache_salt: str | None) -> str | None:
    """The salt the prefix cache sees: the request's ``cache_salt`` as sent when the server is open;
    with keys, the tenant always enters it, so no two tenants share cached blocks whatever they send."""
    if tenant is None:
        return cache_salt
    return json.dumps([tenant, cache_salt], separators=(",", ":"))
