"""Prefix-cache-aware choice of an LLM replica (pure logic; the Ray adapter is request_routers.py).

The router keeps an approximate map of which replica has seen which KV block hashes (the same
chained hashes, mm_hash extra keys and the request's cache salt included, that the engine computes —
llm_service.prefix_hash), so a request is never steered toward blocks its salt cannot hit.
A request goes to the replica holding the longest prefix of its block hashes, unless that replica
is much busier than the least-loaded one, in which case load wins (as in SGLang's cache-aware router).
"""

from __future__ import annotations

import random
from collections import OrderedDict
from collections.abc import Hashable, Mapping, Sequence
from dataclasses import dataclass

ReplicaKey = Hashable


@dataclass(frozen=True)
class AffinityConfig:
    max_entries: int = 200_000  # (replica, block hash) pairs remembered, LRU
    balance_abs_threshold: int = 4  # a cache hit may go to a replica this many requests busier...
    balance_rel_threshold: float = 1.5  # ...and at most this many times the least load (+1)
    min_match_blocks: int = 1


class PrefixAffinityIndex:
    """LRU map from block hash to the replicas that recently prefilled it."""

    def __init__(self, config: AffinityConfig | None = None, rng: random.Random | None = None) -> None:
        self.config = config or AffinityConfig()
        self._rng = rng or random.Random()
        self._entries: OrderedDict[tuple[Hashable, ReplicaKey], None] = OrderedDict()
        self._by_hash: dict[Hashable, set[ReplicaKey]] = {}

    def __len__(self) -> int:
        return len(self._entries)

    def record(self, replica: ReplicaKey, block_hashes: Sequence[Hashable]) -> None:
        for h in block_hashes:
            key = (h, replica)
            if key in self._entries:
                self._entries.move_to_end(key)
                continue
            self._entries[key] = None
            self._by_hash.setdefault(h, set()).add(replica)
        while len(self._entries) > self.config.max_entries:
            (h, r), _ = self._entries.popitem(last=False)
            owners = self._by_hash.get(h)
            if owners is not None:
                owners.discard(r)
                if not owners:
                    del self._by_hash[h]

    def remove_replica(self, replica: ReplicaKey) -> None:
        for key in [k for k in self._entries if k[1] == replica]:
            del self._entries[key]
            owners = self._by_hash.get(key[0])
            if owners is not None:
                owners.discard(replica)
                if not owners:
                    del self._by_hash[key[0]]

    def matched_blocks(self, block_hashes: Sequence[Hashable], replicas: Sequence[ReplicaKey]) -> dict:
        """For each replica, how many leading blocks of ``block_hashes`` it has seen."""
        matched = dict.fromkeys(replicas, 0)
        alive = set(replicas)
        for i, h in enumerate(block_hashes):
            owners = self._by_hash.get(h, set()) & alive
            alive = owners
            for r in alive:
                matched[r] = i + 1
            if not alive:
                break
        return matched

    def choose(self, block_hashes: Sequence[Hashable], load: Mapping[ReplicaKey, float]) -> list[ReplicaKey]:
        """Replicas in order of preference for a request with these block hashes."""
        if not load:
            return []
        replicas = list(load)
        matched = self.matched_blocks(block_hashes, replicas)
        least = min(load.values())
        cfg = self.config

        def acceptable(r: ReplicaKey) -> bool:
            return load[r] - least <= cfg.balance_abs_threshold or load[r] <= cfg.balance_rel_threshold * (
                least + 1
            )

        # Best cache match among replicas that are not overloaded, then the rest by load; ties in
        # random order (a burst routed before any of it is counted would all land on one replica).
        ties = {r: self._rng.random() for r in replicas}

        def key(r: ReplicaKey) -> tuple:
            hit = matched[r] if matched[r] >= cfg.min_match_blocks and acceptable(r) else 0
            return (-hit, load[r], ties[r])

        return sorted(replicas, key=key)


_SHARED: dict[str, PrefixAffinityIndex] = {}


def shared_index(deployment: str) -> PrefixAffinityIndex:
    """This process's one index for a deployment (``"app#name"``): its Serve request router chooses
    and records with it, for calls through Serve and over direct links alike (mmcore/link/pool_links.py)."""
    index = _SHARED.get(deployment)
    if index is None:
        index = _SHARED[deployment] = PrefixAffinityIndex()
    return index


def deployment_key(deployment_id: object) -> str:
    """``"app#name"`` of a Serve ``DeploymentID`` (or anything with ``app_name`` and ``name``)."""
    return f"{getattr(deployment_id, 'app_name', '')}#{getattr(deployment_id, 'name', '')}"


def least_loaded(load: Mapping[ReplicaKey, float], rng: random.Random | None = None) -> list[ReplicaKey]:
    """Replicas by load, equal loads in random order."""
    ties = {r: (rng or random).random() for r in load}
    return sorted(load, key=lambda r: (load[r], ties[r]))
