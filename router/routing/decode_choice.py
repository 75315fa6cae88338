"""Which decode replica takes an E/P/D request (pure logic; the Ray adapter is request_routers.py's
``FreeKVRouter``): one with room for everything the import needs, the least loaded and freest first.

A decode replica's KV fills as its requests generate, and one short of blocks preempts a running
request; its load is its running plus waiting requests. The score adds load and KV use, a replica
whose KV is full counting ``kv_weight`` requests busier than an empty one, so KV decides between
replicas of equal load, and a replica close to full loses to a busier one with room.

An import needs more than full-attention blocks (``ImportNeed``): a sliding-window family's window
blocks (Gemma 3/4), a hybrid family's state slot (Qwen3.5). A replica whose last report shows less of
any of them than the request needs would refuse it (503 ``overloaded``): it is ranked after every
replica with room; one that did refuse it already (``KVHandoff.refused_by``) goes after those.
"""

from __future__ import annotations

import random
from collections.abc import Collection, Hashable, Mapping
from dataclasses import dataclass
from typing import TypeVar

K = TypeVar("K", bound=Hashable)

KV_WEIGHT = 4.0  # a full replica's KV counts as this many more requests in flight

# a decode replica's routing report (llm_service/serve/deployment.py: ``stats``): what it has free
FREE_BLOCKS = "num_free_blocks"
FREE_WINDOW_BLOCKS = "num_free_window_blocks"
FREE_STATE_SLOTS = "num_free_state_slots"


@dataclass(frozen=True)
class ImportNeed:
    """What a decode replica allocates to import a request (``KVHandoff``'s counts): at most
    ``blocks`` full-attention blocks (fewer where its prefix cache holds the leading ones),
    ``window_blocks`` window-group blocks, ``state_slots`` linear-attention state slots."""

    blocks: int = 0
    window_blocks: int = 0
    state_slots: int = 0

    def fits(self, report: Mapping[str, object]) -> bool:
        """``report`` (a replica's last routing report) shows room for all of it; a count it does not
        report (a model without that resource, or no report yet) has room."""
        for key, n in (
            (FREE_BLOCKS, self.blocks),
            (FREE_WINDOW_BLOCKS, self.window_blocks),
            (FREE_STATE_SLOTS, self.state_slots),
        ):
            have = report.get(key)
            if n > 0 and isinstance(have, int | float) and have < n:
                return False
        return True


def rank_decode(
    load: Mapping[K, float],
    kv_usage: Mapping[K, float],
    reports: Mapping[K, Mapping[str, object]],
    need: ImportNeed = ImportNeed(),
    refused: Collection[K] = (),
    kv_weight: float = KV_WEIGHT,
    rng: random.Random | None = None,
) -> list[K]:
    """Replicas best first: not among ``refused``, then room for ``need`` (their ``reports``), then
    ``load + kv_weight * kv_usage``, ties at random. A replica with no report yet counts as empty."""
    ties = {r: (rng or random).random() for r in load}

    def key(r: K) -> tuple[bool, bool, float, float]:
        short = not need.fits(reports.get(r, {}))
        return (r in refused, short, load[r] + kv_weight * kv_usage.get(r, 0.0), ties[r])

    return sorted(load, key=key)
