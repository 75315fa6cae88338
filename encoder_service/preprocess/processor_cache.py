"""Processor cache: an item's preprocessed tensors by mm_hash, LRU, bounded in bytes."""

from __future__ import annotations

from collections import OrderedDict

from encoder_service.types import EncoderInput


def encoder_input_nbytes(inp: EncoderInput) -> int:
    """Bytes held by the item's tensors (torch tensors or numpy arrays)."""
    total = 0
    for t in inp.tensors.values():
        if hasattr(t, "nbytes"):
            total += int(t.nbytes)
        elif hasattr(t, "element_size"):
            total += int(t.element_size() * t.numel())
    return total


class ProcessorCache:
    """LRU of ``EncoderInput`` by mm_hash. An item larger than the whole capacity is not stored."""

    def __init__(self, capacity_bytes: int) -> None:
        self.capacity_bytes = capacity_bytes
        self._entries: OrderedDict[str, tuple[EncoderInput, int]] = OrderedDict()
        self.used_bytes = 0
        self.hits = 0
        self.misses = 0
        self.evictions = 0

    def __len__(self) -> int:
        return len(self._entries)

    def __contains__(self, mm_hash: str) -> bool:
        return mm_hash in self._entries

    def get(self, mm_hash: str) -> EncoderInput | None:
        entry = self._entries.get(mm_hash)
        if entry is None:
            self.misses += 1
            return None
        self._entries.move_to_end(mm_hash)
        self.hits += 1
        return entry[0]

    def put(self, inp: EncoderInput) -> bool:
        """Store ``inp``; evicts least recently used entries as needed. False if it can never fit."""
        size = encoder_input_nbytes(inp)
        if size > self.capacity_bytes:
            return False
        old = self._entries.pop(inp.mm_hash, None)
        if old is not None:
            self.used_bytes -= old[1]
        while self.used_bytes + size > self.capacity_bytes:
            _, (_, freed) = self._entries.popitem(last=False)
            self.used_bytes -= freed
            self.evictions += 1
        self._entries[inp.mm_hash] = (inp, size)
        self.used_bytes += size
        return True

    def stats(self) -> dict[str, int]:
        return {
            "entries": len(self._entries),
            "used_bytes": self.used_bytes,
            "capacity_bytes": self.capacity_bytes,
            "hits": self.hits,
            "misses": self.misses,
            "evictions": self.evictions,
        }
