"""``mm_hash``: the content id of one media item, shared by both caches and the KV prefix cache.

blake3 over length-prefixed fields — a version tag, the model id, the modality, either the item's
ORIGINAL bytes or the client's ``uuid``, and the canonical JSON of every processor kwarg that changes the
item's encoding. Length prefixes keep field boundaries unambiguous; canonical JSON (sorted keys, no
whitespace) keeps the hash stable across processes and Python versions.
"""

from __future__ import annotations

import json
from typing import Any

import blake3

HASH_VERSION = b"mmserve-mm-hash-v1"


def _canonical(value: Any) -> Any:
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


def canonical_kwargs(kwargs: dict[str, Any]) -> bytes:
    return json.dumps(_canonical(kwargs), sort_keys=True, separators=(",", ":")).encode()


def compute_mm_hash(
    model_id: str,
    modality: str,
    *,
    data: bytes | None = None,
    uuid: str | None = None,
    processor_kwargs: dict[str, Any] | bytes | None = None,
) -> str:
    """Hex digest identifying one item's encoder output. A ``uuid`` replaces ``data`` as the content.

    ``processor_kwargs`` may be given already canonical (``canonical_kwargs``'s bytes): the same digest."""
    if uuid is None and data is None:
        raise ValueError("compute_mm_hash needs data or uuid")
    h = blake3.blake3()
    content = b"uuid:" + uuid.encode() if uuid is not None else b"data:" + bytes(data or b"")
    for part in (
        HASH_VERSION,
        model_id.encode(),
        modality.encode(),
        content,
        processor_kwargs if isinstance(processor_kwargs, bytes) else canonical_kwargs(processor_kwargs or {}),
    ):
        h.update(len(part).to_bytes(8, "little"))
        h.update(part)
    return h.hexdigest()
