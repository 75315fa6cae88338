"""The state cache's books (pure Python). The tensors live in ``llm_service/linear_states.py``; the
memory is (running slots + snapshot slots) x a slot's bytes, fixed at start. A slot holds one
sequence's linear-attention states (conv + recurrent, every linear layer) at one token position.

``StatePool``: the running sequences' slots. A slot is held from admission until the request
finishes, is aborted or is preempted; a preempted request's states are dropped with its KV blocks
and recomputed on resume (from the nearest snapshot, or from its first token).

``SnapshotIndex``: states at block boundaries, filed under the chained hash of the block that ends
there (the prefix cache's own key, which carries ``mm_hash`` and ``cache_salt``), so a prefix hit
can restore the KV blocks plus the states where they end.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass, field


@dataclass
class StateAssignment:
    """Where a running request's linear-attention states live (``Request.state``): its own ``slot``,
    read and written by its chunks; ``restore_from``: the snapshot slot its next chunk reads instead
    (a prefix hit ends there); ``captures``: ``(token position, snapshot slot)`` this step fills."""

    slot: int
    restore_from: int | None = None
    captures: list[tuple[int, int]] = field(default_factory=list)


class StatePool:
    """Invariant: every slot is free or held by exactly one owner."""

    def __init__(self, num_slots: int) -> None:
        if num_slots <= 0:
            raise ValueError("num_slots must be positive")
        self.num_slots = num_slots
        self._free = list(range(num_slots - 1, -1, -1))  # pop() hands out slot 0 first
        self._owner: dict[str, int] = {}

    @property
    def num_free(self) -> int:
        return len(self._free)

    def slot_of(self, owner: str) -> int | None:
        return self._owner.get(owner)

    def allocate(self, owner: str) -> int:
        if owner in self._owner:
            raise RuntimeError(f"{owner!r} already holds state slot {self._owner[owner]}")
        if not self._free:
            raise RuntimeError("no free state slot")
        slot = self._free.pop()
        self._owner[owner] = slot
        return slot

    def free(self, owner: str) -> None:
        slot = self._owner.pop(owner, None)
        if slot is not None:
            self._free.append(slot)


class SnapshotIndex:
    """Snapshots of linear-attention states at block boundaries, keyed by the chained hash of the
    block that ends there, in ``num_slots`` slots numbered from ``base`` (after the running slots).

    A slot is **free**, **reserved** (a step will write a snapshot into it; ``register`` or ``release``
    it after the step), or **registered** under a hash. Registered snapshots are evicted least
    recently used first, when a reservation needs a slot, or at once when their block leaves the
    prefix cache (``drop``); a **pinned** one (a request restores from it) is never evicted.
    """

    def __init__(self, num_slots: int, base: int) -> None:
        if num_slots < 0:
            raise ValueError("num_slots must not be negative")
        self.num_slots = num_slots
        self._free = list(range(base + num_slots - 1, base - 1, -1))
        self._by_hash: OrderedDict[bytes, int] = OrderedDict()  # LRU first
        self._pins: dict[bytes, int] = {}
        self.num_evicted = 0

    @property
    def num_free(self) -> int:
        return len(self._free)

    @property
    def num_registered(self) -> int:
        return len(self._by_hash)

    def lookup(self, block_hash: bytes) -> int | None:
        return self._by_hash.get(block_hash)

    def reserve(self) -> int | None:
        """A slot for a snapshot a step will take: a free one, else the LRU unpinned one's. None: all
        pinned (the snapshot is skipped: snapshots are best effort)."""
        if not self._free:
            victim = next((h for h in self._by_hash if h not in self._pins), None)
            if victim is None:
                return None
            self._free.append(self._by_hash.pop(victim))
            self.num_evicted += 1
        return self._free.pop()

    def register(self, block_hash: bytes, slot: int) -> None:
        """File a written snapshot; a hash already held keeps its snapshot and ``slot`` is freed."""
        if block_hash in self._by_hash:
            self._free.append(slot)
            self._by_hash.move_to_end(block_hash)
            return
        self._by_hash[block_hash] = slot

    def release(self, slot: int) -> None:
        """A reserved slot whose snapshot was not taken (its request left before its step ended)."""
        self._free.append(slot)

    def pin(self, block_hash: bytes) -> int:
        slot = self._by_hash[block_hash]
        self._by_hash.move_to_end(block_hash)
        self._pins[block_hash] = self._pins.get(block_hash, 0) + 1
        return slot

    def unpin(self, block_hash: bytes) -> None:
        n = self._pins[block_hash] - 1
        if n:
            self._pins[block_hash] = n
        else:
            del self._pins[block_hash]

    def discard(self, block_hash: bytes) -> None:
        """Give up a snapshot the policy no longer wants (kept if a request restores from it)."""
        if block_hash in self._by_hash and block_hash not in self._pins:
            self._free.append(self._by_hash.pop(block_hash))

    def drop(self, block_hash: bytes) -> None:
        """The block ending at this snapshot left the prefix cache: the snapshot goes with it."""
        if block_hash in self._pins:  # its block is held by the restoring request: cannot happen
            raise RuntimeError("a pinned snapshot's block was evicted")
        slot = self._by_hash.pop(block_hash, None)
        if slot is not None:
            self._free.append(slot)
            self.num_evicted += 1
