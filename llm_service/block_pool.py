"""Fixed-size KV blocks: ref counts, a least-recently-freed queue, and the prefix-cache hash index."""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass

from llm_service.prefix_hash import ExtraKey

BlockKey = tuple[bytes | None, tuple[int, ...], tuple[ExtraKey, ...]]  # (parent hash, tokens, extra keys)


@dataclass
class KVBlock:
    block_id: int
    ref_count: int = 0
    block_hash: bytes | None = None
    key: BlockKey | None = None  # what the hash was computed from, re-checked on every hit


class BlockPool:
    """Owns every block. Invariants:

    - a block is in the free queue iff its ``ref_count`` is 0;
    - a freed block keeps its hash (and stays findable by ``lookup``) until ``allocate`` reuses it;
    - ``allocate`` takes the least recently freed block first (the queue's head).
    """

    def __init__(self, num_blocks: int, enable_caching: bool = True) -> None:
        if num_blocks <= 0:
            raise ValueError("num_blocks must be positive")
        self.num_blocks = num_blocks
        self.enable_caching = enable_caching
        self.blocks = [KVBlock(i) for i in range(num_blocks)]
        self._free: OrderedDict[int, None] = OrderedDict((i, None) for i in range(num_blocks))
        self._by_hash: dict[bytes, int] = {}
        self.on_evict: Callable[[bytes], None] | None = None  # told each hash that leaves the index

    @property
    def num_free(self) -> int:
        return len(self._free)

    def allocate(self, n: int) -> list[KVBlock]:
        """Take ``n`` free blocks (ref_count 1), evicting their cached hashes."""
        if n > len(self._free):
            raise RuntimeError(f"asked for {n} blocks, {len(self._free)} free")
        out = []
        for _ in range(n):
            block_id, _ = self._free.popitem(last=False)
            block = self.blocks[block_id]
            self._evict(block)
            block.ref_count = 1
            out.append(block)
        return out

    def touch(self, blocks: list[KVBlock]) -> None:
        """Take one more reference on each block (a prefix-cache hit), pulling free ones off the queue."""
        for block in blocks:
            if block.ref_count == 0:
                del self._free[block.block_id]
            block.ref_count += 1

    def free(self, blocks: list[KVBlock]) -> None:
        """Drop one reference on each block; blocks reaching 0 join the queue's tail in the given order."""
        for block in blocks:
            assert block.ref_count > 0, f"double free of block {block.block_id}"
            block.ref_count -= 1
            if block.ref_count == 0:
                self._free[block.block_id] = None

    def lookup(self, block_hash: bytes, key: BlockKey) -> KVBlock | None:
        """The cached block with this hash, if its tokens and extra keys really match."""
        block_id = self._by_hash.get(block_hash)
        if block_id is None:
            return None
        block = self.blocks[block_id]
        return block if block.key == key else None

    def cache(self, block: KVBlock, block_hash: bytes, key: BlockKey) -> None:
        """Register a full, computed block under its hash. On duplicates the first writer wins while
        it is held; a free one hands the hash to the new block (it would be evicted first, and a
        request that computed the same block again, a hybrid model's past its last state snapshot,
        would otherwise leave the prefix index without it)."""
        if not self.enable_caching or block.block_hash is not None:
            return
        if (held := self._by_hash.get(block_hash)) is not None:
            other = self.blocks[held]
            if other.ref_count > 0:
                return
            other.block_hash, other.key = None, None
        block.block_hash, block.key = block_hash, key
        self._by_hash[block_hash] = block.block_id

    def num_cached(self) -> int:
        return len(self._by_hash)

    def _evict(self, block: KVBlock) -> None:
        if block.block_hash is not None:
            if self._by_hash.get(block.block_hash) == block.block_id:
                del self._by_hash[block.block_hash]
                if self.on_evict is not None:
                    self.on_evict(block.block_hash)
            block.block_hash, block.key = None, None
