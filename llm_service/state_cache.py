"""The state cache's books (pure Python): a fixed number of slots, each holding one running
sequence's linear-attention states (conv + recurrent, every linear layer). The tensors live in
``llm_service/linear_states.py``; the memory is ``num_slots`` x a slot's bytes, fixed at start.

A slot is held from admission until the request finishes, is aborted or is preempted; a preempted
request's states are dropped with its KV blocks and recomputed from its first token on resume.
"""

from __future__ import annotations


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
