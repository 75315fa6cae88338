"""Which decode replica takes an E/P/D request (pure logic; the Ray adapter is request_routers.py's
``FreeKVRouter``): the one with the most free KV and the least load.

A decode replica's KV fills as its requests generate, and one short of blocks preempts (recomputes)
a running request; its load is its running plus waiting requests. The score adds load and KV use,
a replica whose KV is full counting ``kv_weight`` requests busier than an empty one, so KV decides
between replicas of equal load, and a replica close to full loses to a busier one with room.
A replica with fewer free blocks than the request needs is ranked last.
"""

from __future__ import annotations

import random
from collections.abc import Hashable, Mapping
from typing import TypeVar

K = TypeVar("K", bound=Hashable)

KV_WEIGHT = 4.0  # a full replica's KV counts as this many more requests in flight


def rank_decode(
    load: Mapping[K, float],
    kv_usage: Mapping[K, float],
    free_blocks: Mapping[K, float],
    need_blocks: int = 0,
    kv_weight: float = KV_WEIGHT,
    rng: random.Random | None = None,
) -> list[K]:
    """Replicas best first: room for ``need_blocks``, then ``load + kv_weight * kv_usage``, ties at random.
    A replica with no report yet counts as empty (no use, room)."""
    ties = {r: (rng or random).random() for r in load}

    def key(r: K) -> tuple[bool, float, float]:
        short = free_blocks.get(r, float("inf")) < need_blocks
        return (short, load[r] + kv_weight * kv_usage.get(r, 0.0), ties[r])

    return sorted(load, key=key)
