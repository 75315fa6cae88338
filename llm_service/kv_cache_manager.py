"""Per-request block tables on top of the BlockPool, with prefix-cache lookups (pure Python)."""

from __future__ import annotations

from llm_service.block_pool import BlockKey, BlockPool, KVBlock
from llm_service.prefix_hash import block_extra_keys, compute_block_hashes
from llm_service.sequence import Request


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


class KVCacheManager:
    """Hands out blocks to requests and finds cached prefixes.

    The hit rule: the longest chain of leading full blocks whose hashes are cached *and* whose tokens,
    extra keys and parent hash re-check equal. At most ``(num_tokens - 1) // block_size`` blocks are
    taken, so the last token is always recomputed (its logits are needed to sample).
    """

    def __init__(self, num_blocks: int, block_size: int, enable_caching: bool = True) -> None:
        self.block_size = block_size
        self.enable_caching = enable_caching
        self.pool = BlockPool(num_blocks, enable_caching)
        self._blocks: dict[str, list[KVBlock]] = {}
        self.prefix_hit_tokens = 0
        self.prefix_query_tokens = 0

    @property
    def num_free_blocks(self) -> int:
        return self.pool.num_free

    @property
    def num_total_blocks(self) -> int:
        return self.pool.num_blocks

    @property
    def usage(self) -> float:
        return 1.0 - self.pool.num_free / self.pool.num_blocks

    def block_table(self, request_id: str) -> list[int]:
        return [b.block_id for b in self._blocks.get(request_id, [])]

    def window_table(self, request_id: str) -> list[int] | None:
        """The sliding-window layers' own blocks (``WindowKVCacheManager``); None: they use the table above."""
        return None

    def get_computed_blocks(self, req: Request) -> list[KVBlock]:
        """The cached blocks covering ``req``'s leading tokens (not yet referenced: see allocate_slots)."""
        if not self.enable_caching:
            return []
        tokens = req.all_token_ids
        max_blocks = (len(tokens) - 1) // self.block_size
        self._extend_hashes(req, tokens, max_blocks)
        hits: list[KVBlock] = []
        for i in range(max_blocks):
            block = self.pool.lookup(req.block_hashes[i], self._key(req, tokens, i))
            if block is None:
                break
            hits.append(block)
        return hits

    def record_prefix_query(self, num_query_tokens: int, num_hit_tokens: int) -> None:
        """Count one admission's lookup (in tokens) in the hit/query counters."""
        if self.enable_caching:
            self.prefix_query_tokens += num_query_tokens
            self.prefix_hit_tokens += num_hit_tokens

    def can_ever_fit(self, num_tokens: int) -> bool:
        return cdiv(num_tokens, self.block_size) <= self.pool.num_blocks

    def allocate_slots(
        self, req: Request, num_new_tokens: int, computed: list[KVBlock] | None = None
    ) -> bool:
        """Make room for ``num_new_tokens`` after the computed ones (``computed`` hits are taken first).

        Returns False, changing nothing, when the pool cannot supply the blocks.
        """
        computed = computed or []
        held = self._blocks.get(req.request_id, [])
        num_computed = len(computed) * self.block_size if computed else req.num_computed_tokens
        need = cdiv(num_computed + num_new_tokens, self.block_size) - len(held) - len(computed)
        from_free_queue = sum(1 for b in computed if b.ref_count == 0)
        if max(need, 0) + from_free_queue > self.pool.num_free:
            return False
        self.pool.touch(computed)
        blocks = self._blocks.setdefault(req.request_id, [])
        blocks.extend(computed)
        if computed:
            req.num_hashed_blocks = len(computed)
        if need > 0:
            blocks.extend(self.pool.allocate(need))
        return True

    def allocate_swap_in(self, req: Request, num_new_tokens: int) -> bool:
        """Blocks for a swapped-out request's ``num_computed_tokens`` (their KV written back from host
        memory, not recomputed) and its next ``num_new_tokens``; False, changing nothing, if short."""
        return self.allocate_slots(req, num_new_tokens)

    def first_window_block(self, num_tokens: int) -> int:
        """The first window-group block a query after ``num_tokens`` tokens reads (0: no window group)."""
        return 0

    def allocate_import(self, req: Request, num_tokens: int) -> int | None:
        """Blocks for the KV of ``req``'s first ``num_tokens`` tokens, computed elsewhere (a prefill
        replica): the leading full blocks this prefix cache holds are taken as they are, the rest
        allocated. Returns how many leading blocks were hits (their KV need not cross); None, changing
        nothing, when the pool cannot supply the rest."""
        hits = self.get_computed_blocks(req)[: num_tokens // self.block_size]
        n = len(hits) * self.block_size
        if not self.allocate_slots(req, num_tokens - n, hits):
            return None
        return len(hits)

    def import_window(self, request_id: str, hit_blocks: int) -> tuple[int, list[int]]:
        """An import's window-group blocks to fill: ``(first block index, block ids)`` (none here)."""
        return 0, []

    def window_held(self, request_id: str, num_blocks: int) -> tuple[int, list[int]]:
        """A handed-off request's window-group table up to ``num_blocks`` and its first entry that is
        not the null block (none here)."""
        return 0, []

    def cache_computed_blocks(self, req: Request) -> None:
        """Register the request's newly full, computed blocks in the prefix cache."""
        if not self.enable_caching:
            return
        num_full = req.num_computed_tokens // self.block_size
        if num_full <= req.num_hashed_blocks:
            return
        tokens = req.all_token_ids
        self._extend_hashes(req, tokens, num_full)
        blocks = self._blocks[req.request_id]
        for i in range(req.num_hashed_blocks, num_full):
            self.pool.cache(blocks[i], req.block_hashes[i], self._key(req, tokens, i))
        req.num_hashed_blocks = num_full

    def free(self, req: Request) -> None:
        """Release the request's blocks; the tail goes first so a shared prefix is evicted last."""
        blocks = self._blocks.pop(req.request_id, [])
        self.pool.free(list(reversed(blocks)))
        req.num_hashed_blocks = 0

    def _extend_hashes(self, req: Request, tokens: list[int], num_blocks: int) -> None:
        have = len(req.block_hashes)
        if num_blocks > have:
            parent = req.block_hashes[-1] if have else None
            req.block_hashes.extend(
                compute_block_hashes(
                    tokens[: num_blocks * self.block_size],
                    req.mm_spans,
                    self.block_size,
                    start_block=have,
                    parent=parent,
                    cache_salt=req.cache_salt,
                )
            )

    def _key(self, req: Request, tokens: list[int], i: int) -> BlockKey:
        s = i * self.block_size
        parent = req.block_hashes[i - 1] if i else None
        extra = block_extra_keys(s, self.block_size, req.mm_spans, req.cache_salt)
        return (parent, tuple(tokens[s : s + self.block_size]), extra)
