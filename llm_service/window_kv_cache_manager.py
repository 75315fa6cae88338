"""KV blocks for models with sliding-window layers (pure Python): the window layers keep only the
blocks their window still reads.

Two block groups, as vLLM's hybrid allocator has them:

- the **full** group (``KVCacheManager``'s pool and tables): the layers that attend the whole context;
- the **window** group (its own ``BlockPool``, ``window_table``): the layers that see the last
  ``window`` positions. When a request's next chunk starts at ``start``, its queries read keys at
  positions ``>= start - window + 1`` only, so every window block wholly before that goes back to the
  pool (its table entry becomes the **null block**, which the attention's window mask never reads).
  A request holds at most about ``window / block_size + 2`` window blocks plus its chunk's.

Prefix caching keeps both: window blocks are cached under the same chained hashes as the full ones,
stay findable after they leave a request's window (until the pool reuses them), and a hit of ``k``
full blocks is trimmed to the longest ``k`` whose window blocks ``[k*bs - window + 1, k*bs)`` are
cached too (the next chunk's queries read them).

Admission counts both pools: ``allocate_slots`` changes nothing unless both can supply their blocks.

An import (E/P/D's decode side, ``allocate_import``) of a prompt of ``P`` tokens takes window blocks
for ``[(P - window + 1) // block_size, cdiv(P, block_size))`` only: what its first decode reads. The
entries before are the null block, as if its window had already passed them here.
"""

from __future__ import annotations

from llm_service.block_pool import BlockPool, KVBlock
from llm_service.kv_cache_manager import KVCacheManager, cdiv
from llm_service.sequence import Request


def window_blocks_needed(max_num_seqs: int, max_num_batched_tokens: int, window: int, block_size: int) -> int:
    """Window blocks the running batch can hold at once: per sequence its window and two partial
    blocks, and the last and the next step's chunks (a sequence drops its old blocks at its next
    allocation). A window pool this large never holds up admission."""
    return max_num_seqs * (cdiv(window, block_size) + 3) + 2 * cdiv(max_num_batched_tokens, block_size)


class WindowKVCacheManager(KVCacheManager):
    def __init__(
        self,
        num_blocks: int,
        block_size: int,
        num_window_blocks: int,
        window: int,
        enable_caching: bool = True,
    ) -> None:
        super().__init__(num_blocks, block_size, enable_caching)
        if window <= 0 or num_window_blocks <= 0:
            raise ValueError("window and num_window_blocks must be positive")
        self.window = window
        self.window_pool = BlockPool(num_window_blocks + 1, enable_caching)
        self.null_block = self.window_pool.allocate(1)[0]  # held forever: a dropped entry's stand-in
        self._window: dict[str, list[KVBlock]] = {}
        self._dropped: dict[str, int] = {}  # request id -> its leading entries that are null
        self._window_hashed: dict[str, int] = {}

    @property
    def num_window_blocks(self) -> int:
        return self.window_pool.num_blocks - 1

    @property
    def num_free_window_blocks(self) -> int:
        return self.window_pool.num_free

    def window_table(self, request_id: str) -> list[int] | None:
        return [b.block_id for b in self._window.get(request_id, [])]

    def num_window_blocks_held(self, request_id: str) -> int:
        return sum(b is not self.null_block for b in self._window.get(request_id, []))

    def _first_read(self, start: int) -> int:
        """The first block a chunk starting at ``start`` reads in the window layers."""
        return max(0, (start - self.window + 1) // self.block_size)

    def get_computed_blocks(self, req: Request) -> list[KVBlock]:
        """The full group's hit, trimmed to where the window group holds every block it would read."""
        hits = super().get_computed_blocks(req)
        if not hits:
            return hits
        tokens = req.all_token_ids
        for k in range(len(hits), 0, -1):
            if all(
                self._window_lookup(req, tokens, i) for i in range(self._first_read(k * self.block_size), k)
            ):
                return hits[:k]
        return []

    def _window_lookup(self, req: Request, tokens: list[int], i: int) -> KVBlock | None:
        return self.window_pool.lookup(req.block_hashes[i], self._key(req, tokens, i))

    def allocate_slots(
        self, req: Request, num_new_tokens: int, computed: list[KVBlock] | None = None
    ) -> bool:
        rid, bs = req.request_id, self.block_size
        table = self._window.get(rid, [])
        hits: list[KVBlock] = []
        if computed:
            start = len(computed) * bs
            tokens = req.all_token_ids
            first = self._first_read(start)
            found = [self._window_lookup(req, tokens, i) for i in range(first, len(computed))]
            if any(b is None for b in found):
                return False  # get_computed_blocks trims hits to this; a pool reuse in between
            hits = [b for b in found if b is not None]
            have = len(computed)
        else:
            start = req.num_computed_tokens
            have = len(table)
        need = max(cdiv(start + num_new_tokens, bs) - have, 0)
        from_free_queue = sum(1 for b in hits if b.ref_count == 0)
        if need + from_free_queue > self.window_pool.num_free:
            return False
        if not super().allocate_slots(req, num_new_tokens, computed):
            return False
        if computed:
            self.window_pool.touch(hits)
            table = [self.null_block] * (len(computed) - len(hits)) + hits
            self._dropped[rid] = len(computed) - len(hits)
            self._window_hashed[rid] = len(computed)
        self._window[rid] = table
        if need:
            table.extend(self.window_pool.allocate(need))
        self._drop(rid, table, self._first_read(start))
        return True

    def first_window_block(self, num_tokens: int) -> int:
        return self._first_read(num_tokens)

    def allocate_swap_in(self, req: Request, num_new_tokens: int) -> bool:
        """The full group as ``KVCacheManager``'s; the window group only from the first block the next
        query reads (the null block before it, as for a request whose window has passed them)."""
        rid, start = req.request_id, req.num_computed_tokens
        first = self._first_read(start)
        need = cdiv(start + num_new_tokens, self.block_size) - first
        if need > self.window_pool.num_free or not KVCacheManager.allocate_slots(self, req, num_new_tokens):
            return False
        self._window[rid] = [self.null_block] * first + self.window_pool.allocate(need)
        self._dropped[rid] = first
        self._window_hashed[rid] = 0
        return True

    def allocate_import(self, req: Request, num_tokens: int) -> int | None:
        """The full group as ``KVCacheManager``'s; the window group only the blocks the first query after
        the prompt reads (cached ones taken, the rest allocated to be pulled)."""
        rid, bs = req.request_id, self.block_size
        hits = self.get_computed_blocks(req)[: num_tokens // bs]
        k, first = len(hits), self._first_read(num_tokens)
        tokens = req.all_token_ids
        found = [self._window_lookup(req, tokens, i) for i in range(first, k)]
        kept = [b for b in found if b is not None]
        if len(kept) != len(found):  # get_computed_blocks trimmed the hit to where they are cached
            return None
        need = cdiv(num_tokens, bs) - max(first, k)
        if need + sum(1 for b in kept if b.ref_count == 0) > self.window_pool.num_free:
            return None
        if not KVCacheManager.allocate_slots(self, req, num_tokens - k * bs, hits):
            return None
        self.window_pool.touch(kept)
        self._window[rid] = [self.null_block] * first + kept + self.window_pool.allocate(need)
        self._dropped[rid] = first
        self._window_hashed[rid] = k
        return k

    def import_window(self, request_id: str, hit_blocks: int) -> tuple[int, list[int]]:
        start = max(self._dropped.get(request_id, 0), hit_blocks)
        return start, [b.block_id for b in self._window.get(request_id, [])[start:]]

    def window_held(self, request_id: str, num_blocks: int) -> tuple[int, list[int]]:
        table = self._window.get(request_id, [])[:num_blocks]
        return self._dropped.get(request_id, 0), [b.block_id for b in table]

    def _drop(self, rid: str, table: list[KVBlock], before: int) -> None:
        """Give back the window blocks before ``before`` (no later query of the request reads them)."""
        done = self._dropped.get(rid, 0)
        if before <= done:
            return
        gone = [b for b in table[done:before] if b is not self.null_block]
        table[done:before] = [self.null_block] * (before - done)
        self.window_pool.free(gone)
        self._dropped[rid] = before

    def cache_computed_blocks(self, req: Request) -> None:
        super().cache_computed_blocks(req)
        if not self.enable_caching:
            return
        rid = req.request_id
        num_full = req.num_computed_tokens // self.block_size
        done = self._window_hashed.get(rid, 0)
        if num_full <= done:
            return
        tokens = req.all_token_ids  # super() extended req.block_hashes up to num_full
        table = self._window[rid]
        for i in range(done, num_full):
            if table[i] is not self.null_block:  # dropped only after it was cached
                self.window_pool.cache(table[i], req.block_hashes[i], self._key(req, tokens, i))
        self._window_hashed[rid] = num_full

    def free(self, req: Request) -> None:
        rid = req.request_id
        table = self._window.pop(rid, [])
        self.window_pool.free([b for b in reversed(table) if b is not self.null_block])
        self._dropped.pop(rid, None)
        self._window_hashed.pop(rid, None)
        super().free(req)
