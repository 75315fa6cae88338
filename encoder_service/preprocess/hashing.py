"""``mm_hash``: the content id of one media item, shared by both caches and the KV prefix cache.

blake3 over length-prefixed fields — a version tag, the model id, the modality, the item's ORIGINAL
bytes, and the canonical JSON of every processor kwarg that changes the item's encoding. Length
prefixes keep field boundaries unambiguous; canonical JSON (sorted keys, no whitespace) keeps the hash
stable across processes and Python versions.

An mm_hash always names content: a client's ``uuid`` never replaces the bytes in it (that let one
client's bytes answer another's request). A uuid is a NAME in its tenant's namespace, pointing at an
mm_hash (``uuid_alias_key`` → mm_hash, encoder_service/cache/uuid_aliases.py): a part that carries bytes
and a uuid re-points the name at those bytes' mm_hash; a part with a uuid alone is served through it.
"""

from __future__ import annotations

import json
from collections.abc import Mapping

import blake3

HASH_VERSION = b"mmserve-mm-hash-v2"  # v2: content only (v1 let a uuid replace the bytes)
ALIAS_VERSION = b"mmserve-uuid-alias-v1"


# What canonical JSON is made of: JSON's own values, each dict key a string.
Canonical = dict[str, "Canonical"] | list["Canonical"] | str | int | float | bool | None


def _canonical(value: object) -> Canonical:
    if isinstance(value, dict):
        return {str(k): _canonical(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_canonical(v) for v in value]
    if isinstance(value, float) and value.is_integer():
        return int(value)  # 2.0 and 2 encode the same
    if value is None or isinstance(value, (str, int, float, bool)):
        return value
    if hasattr(value, "tolist"):
        return _canonical(value.tolist())
    return str(value)


def canonical_kwargs(kwargs: Mapping[str, object]) -> bytes:
    return json.dumps(_canonical(kwargs), sort_keys=True, separators=(",", ":")).encode()


def _digest(parts: tuple[bytes, ...]) -> str:
    h = blake3.blake3()
    for part in parts:
        h.update(len(part).to_bytes(8, "little"))
        h.update(part)
    return h.hexdigest()


def compute_mm_hash(
    model_id: str,
    modality: str,
    data: bytes,
    processor_kwargs: Mapping[str, object] | bytes | None = None,
) -> str:
    """Hex digest identifying one item's encoder output: its bytes under these processor settings.

    ``processor_kwargs`` may be given already canonical (``canonical_kwargs``'s bytes): the same digest."""
    kwargs = (
        processor_kwargs if isinstance(processor_kwargs, bytes) else canonical_kwargs(processor_kwargs or {})
    )
    return _digest((HASH_VERSION, model_id.encode(), modality.encode(), bytes(data), kwargs))


def uuid_alias_key(model_id: str, modality: str, tenant: str | None, uuid: str) -> str:
    """The key of the name ``uuid`` in ``tenant``'s namespace (None: the server has no API keys).

    Tenants are separate namespaces: no tenant can name, read or re-point another's uuid."""
    scope = b"-" if tenant is None else b"t:" + tenant.encode()
    return _digest((ALIAS_VERSION, model_id.encode(), modality.encode(), scope, uuid.encode()))
