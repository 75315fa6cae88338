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
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence

ExtraKey = tuple[str, int]
MMItemSpan = tuple[int, int, str]  # (offset, length, mm_hash)


def block_extra_keys(start: int, block_size: int, mm_items: Sequence[MMItemSpan]) -> tuple[ExtraKey, ...]:
    """Extra keys of the block starting at ``start``: ``(mm_hash, start - offset)`` per overlapping item."""
    end = start + block_size
    keys = [
        (mm_hash, start - offset)
        for offset, length, mm_hash in sorted(mm_items)
        if offset < end and offset + length > start
    ]
    return tuple(keys)


def hash_block(parent: bytes | None, token_ids: Sequence[int], extra_keys: Sequence[ExtraKey] = ()) -> bytes:
    h = hashlib.sha256()
    h.update(parent or b"")
    h.update(b"|t")
    h.update(b"".join(int(t).to_bytes(4, "little", signed=True) for t in token_ids))
    for mm_hash, rel in extra_keys:
        h.update(b"|m")
        h.update(mm_hash.encode())
        h.update(b":")
        h.update(int(rel).to_bytes(8, "little", signed=True))
    return h.digest()


def compute_block_hashes(
    token_ids: Sequence[int],
    mm_items: Sequence[MMItemSpan],
    block_size: int,
    *,
    start_block: int = 0,
    parent: bytes | None = None,
) -> list[bytes]:
    """Hashes of the full blocks of ``token_ids``, one per full block (a partial tail block has none).

    ``start_block``/``parent`` continue an existing chain (hashes of blocks ``start_block..``).
    """
    if block_size <= 0:
        raise ValueError("block_size must be positive")
    hashes: list[bytes] = []
    for i in range(start_block, len(token_ids) // block_size):
        s = i * block_size
        parent = hash_block(parent, token_ids[s : s + block_size], block_extra_keys(s, block_size, mm_items))
        hashes.append(parent)
    return hashes
