"""Processor cache: an item's preprocessed tensors by mm_hash, LRU, bounded in bytes.

The bound is on the bytes the entries keep alive. A processor output can be a view of a larger buffer
(Qwen2-Audio's ``feature_attention_mask``: a [1, 3000] int32 view, 12 KB, of a 1.9 MB storage), which
keeps that whole buffer; ``put`` copies such a tensor out first, so an entry holds only its own bytes.
The soak found it: the audio encoder's cache held ~2.2x its 256 MiB bound (docs/benchmark-log.md, S5).
"""

from __future__ import annotations

from collections import OrderedDict

from encoder_service.types import EncoderInput


def own_nbytes(t: object) -> int:
    """The bytes of a tensor's (or numpy array's) own elements."""
    if hasattr(t, "nbytes"):
        return int(t.nbytes)
    if hasattr(t, "element_size") and hasattr(t, "numel"):
        return int(t.element_size() * t.numel())
    return 0


def held_nbytes(t: object) -> int:
    """The bytes a tensor keeps alive: its whole storage (a torch view), or its base (a numpy view)."""
    if hasattr(t, "untyped_storage"):
        return max(own_nbytes(t), int(t.untyped_storage().nbytes()))
    base = getattr(t, "base", None)
    return max(own_nbytes(t), own_nbytes(base)) if base is not None else own_nbytes(t)


def compact(inp: EncoderInput) -> None:
    """Copy out, in place, each of ``inp``'s tensors that keeps a larger buffer alive than its own bytes."""
    for name, t in inp.tensors.items():
        if held_nbytes(t) > own_nbytes(t):
            inp.tensors[name] = t.clone() if hasattr(t, "clone") else t.copy()


def encoder_input_nbytes(inp: EncoderInput) -> int:
    """Bytes kept alive by the item's tensors (torch tensors or numpy arrays), views' whole buffers included."""
    return sum(held_nbytes(t) for t in inp.tensors.values())


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
        """Store ``inp`` (its views of larger buffers copied out: ``compact``); evicts least recently used
        entries as needed. False if it can never fit."""
        compact(inp)
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
