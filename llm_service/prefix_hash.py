"""Prefix-cache block hashes. Pure Python: the router imports this for prefix-affinity routing.

A FULL block ``i`` covers prompt positions ``[s, s + block_size)`` with ``s = i * block_size``. Its hash
chains three things::

    hash_i = sha256( hash_{i-1} | token ids of the block | extra keys )        (hash_{-1} = b"")

The extra keys hold one ``(mm_hash, s - offset)`` pair for every media item ``[offset, offset+length)``
that overlaps the block, in prompt order. ``s - offset`` is the block start measured inside the item:
0 when the item starts exactly at the block start, positive when the block starts inside the item,
negative when the item starts inside the block::

    tokens  | t t t [i i i i i i i i] t t |
    block     [ s . . . . ) [ . . . . ) [ . . . . )
    key       (h, -3)        (h, 2)       (h, 7)

So the same placeholder ids with another image give another hash, and the same image at another
offset inside a block gives another hash too. Hashes are 32-byte digests, stable across processes.

``cache_salt`` (vLLM's name and semantics): a request's salt is one more extra key of its FIRST block
only, ``("salt:" + cache_salt, 0)``. Every later hash chains the first, so two requests share cached
blocks only when their salts are equal (or both absent), and a client cannot probe by timing which
prefixes a request under another salt left in the cache. Extra-key strings are length-prefixed in
the hash, so no salt can imitate a sequence of other keys.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence

ExtraKey = tuple[str, int]
MMItemSpan = tuple[int, int, str]  # (offset, length, mm_hash)
SALT_KEY_PREFIX = "salt:"  # mm_hashes are hex digests: no media key starts with it


def salt_key(cache_salt: str) -> ExtraKey:
    return (SALT_KEY_PREFIX + cache_salt, 0)


def block_extra_keys(
    start: int, block_size: int, mm_items: Sequence[MMItemSpan], cache_salt: str | None = None
) -> tuple[ExtraKey, ...]:
    """Extra keys of the block starting at ``start``: the salt first (block 0 only), then
    ``(mm_hash, start - offset)`` per overlapping item."""
    end = start + block_size
    keys = [
        (mm_hash, start - offset)
        for offset, length, mm_hash in sorted(mm_items)
        if offset < end and offset + length > start
    ]
    if cache_salt is not None and start == 0:
        keys.insert(0, salt_key(cache_salt))
    return tuple(keys)


def hash_block(parent: bytes | None, token_ids: Sequence[int], extra_keys: Sequence[ExtraKey] = ()) -> bytes:
    h = hashlib.sha256()
    h.update(parent or b"")
    h.update(b"|t")
    h.update(b"".join(int(t).to_bytes(4, "little", signed=True) for t in token_ids))
    for key, rel in extra_keys:
        raw = key.encode()
        h.update(b"|m")
        h.update(len(raw).to_bytes(4, "little"))
        h.update(raw)
        h.update(int(rel).to_bytes(8, "little", signed=True))
    return h.digest()


def compute_block_hashes(
    token_ids: Sequence[int],
    mm_items: Sequence[MMItemSpan],
    block_size: int,
    *,
    start_block: int = 0,
    parent: bytes | None = None,
    cache_salt: str | None = None,
) -> list[bytes]:
    """Hashes of the full blocks of ``token_ids``, one per full block (a partial tail block has none).

    ``start_block``/``parent`` continue an existing chain (hashes of blocks ``start_block..``);
    ``cache_salt`` enters block 0's extra keys.
    """
    if block_size <= 0:
        raise ValueError("block_size must be positive")
    hashes: list[bytes] = []
    for i in range(start_block, len(token_ids) // block_size):
        s = i * block_size
        extra = block_extra_keys(s, block_size, mm_items, cache_salt)
        parent = hash_block(parent, token_ids[s : s + block_size], extra)
        hashes.append(parent)
    return hashes
