"""KV blocks plus state-cache slots for hybrid models (pure Python): what the scheduler sees.

The scheduler talks to a ``KVCacheManager`` only (``get_computed_blocks``, ``allocate_slots``,
``cache_computed_blocks``, ``free``); this one also

- hands a request a running state slot when it is admitted (its first ``allocate_slots``) and takes
  it back whenever its blocks go (finish, abort, preemption): admission waits for a free slot as for
  free blocks; a preempted request's states are dropped and recomputed on resume;
- takes **snapshots** of the linear layers' states at chosen block boundaries (``capture_points``),
  filed under the chained hash of the block ending there, and drops one when that block leaves the
  prefix cache (``BlockPool.on_evict``) or when the snapshot budget needs its slot (LRU);
- trims a prefix hit to the last cached block that has a snapshot: the request takes the KV blocks
  up to there and its first chunk reads that snapshot instead of zero states.

Snapshot policy (``capture_points``), per request:

    prompt      the last full block that an identical prompt can hit ((P-1) // bs) and the last
                full block of the prompt (P // bs): a resent prompt, or the next turn of a chat;
                and every ``interval`` blocks (long shared prefixes: a system prompt, a first image)
    generation  every block boundary, keeping only the request's latest one: where the turn ended
"""

from __future__ import annotations

from llm_service.block_pool import KVBlock
from llm_service.kv_cache_manager import KVCacheManager
from llm_service.sequence import Request
from llm_service.state_cache import SnapshotIndex, StateAssignment, StatePool

SNAPSHOT_INTERVAL_BLOCKS = 16


class HybridKVCacheManager(KVCacheManager):
    def __init__(
        self,
        num_blocks: int,
        block_size: int,
        num_state_slots: int,
        num_snapshot_slots: int = 0,
        snapshot_interval_blocks: int = SNAPSHOT_INTERVAL_BLOCKS,
    ) -> None:
        super().__init__(num_blocks, block_size, enable_caching=num_snapshot_slots > 0)
        self.states = StatePool(num_state_slots)
        self.snapshots = SnapshotIndex(num_snapshot_slots, base=num_state_slots)
        self.interval = snapshot_interval_blocks
        self.pool.on_evict = self.snapshots.drop
        self._restoring: dict[str, bytes] = {}  # request id -> the snapshot it restores (pinned)
        self._latest_generated: dict[str, bytes] = {}  # request id -> its latest generation snapshot

    @property
    def num_free_state_slots(self) -> int:
        return self.states.num_free

    def get_computed_blocks(self, req: Request) -> list[KVBlock]:
        """The cached prefix up to the last block whose end has a snapshot (none: no hit)."""
        hits = super().get_computed_blocks(req)
        for k in range(len(hits), 0, -1):
            if self.snapshots.lookup(req.block_hashes[k - 1]) is not None:
                return hits[:k]
        return []

    def allocate_slots(
        self, req: Request, num_new_tokens: int, computed: list[KVBlock] | None = None
    ) -> bool:
        if req.state is None:
            if self.states.num_free == 0 or not super().allocate_slots(req, num_new_tokens, computed):
                return False
            req.state = StateAssignment(self.states.allocate(req.request_id))
            if computed:
                restored = req.block_hashes[len(computed) - 1]
                req.state.restore_from = self.snapshots.pin(restored)
                self._restoring[req.request_id] = restored
        elif not super().allocate_slots(req, num_new_tokens, computed):
            return False
        start = len(computed) * self.block_size if computed else req.num_computed_tokens
        for pos in self.capture_points(req, start, num_new_tokens):
            if pos > req.num_prompt_tokens and (previous := self._latest_generated.pop(req.request_id, None)):
                self.snapshots.discard(previous)  # replaced by this one: its slot first, not an older one's
            slot = self.snapshots.reserve()
            if slot is not None:
                req.state.captures.append((pos, slot))
        return True

    def allocate_import(self, req: Request, num_tokens: int) -> int | None:
        """Blocks and a state slot for a request prefilled elsewhere (E/P/D's decode side): its states
        come with its KV, so any cached leading blocks are taken (no snapshot needed) and nothing is
        restored or captured here; the imported blocks are registered without snapshots (a later
        prefix hit here is trimmed to blocks with one, as for every hit)."""
        if self.states.num_free == 0:
            return None
        bs = self.block_size
        hits = KVCacheManager.get_computed_blocks(self, req)[: num_tokens // bs]
        if not KVCacheManager.allocate_slots(self, req, num_tokens - len(hits) * bs, hits):
            return None
        req.state = StateAssignment(self.states.allocate(req.request_id))
        end = num_tokens // bs * bs  # the prompt's last full block: a snapshot slot for the prefill side's
        if self.enable_caching and end > len(hits) * bs and (slot := self.snapshots.reserve()) is not None:
            req.state.captures.append((end, slot))  # filed by cache_computed_blocks, released by free
        return len(hits)

    def import_snapshot(self, req: Request) -> int | None:
        """The snapshot slot an import reserved for the prefill side's snapshot (None: none)."""
        return req.state.captures[0][1] if req.state is not None and req.state.captures else None

    def drop_import_snapshot(self, req: Request) -> None:
        """The prefill side sent no snapshot: give its reserved slot back before the blocks are filed."""
        if req.state is not None:
            for _, slot in req.state.captures:
                self.snapshots.release(slot)
            req.state.captures = []

    def hold_prompt_snapshot(self, req: Request) -> int | None:
        """A handed-off request's snapshot at its prompt's last full block, pinned until the request's
        blocks are freed (``free``): what a decode replica pulls with its state. None: none filed."""
        n = req.num_prompt_tokens // self.block_size
        if not self.enable_caching or n == 0 or req.request_id in self._restoring:
            return None
        block_hash = req.block_hashes[n - 1]
        if self.snapshots.lookup(block_hash) is None:
            return None
        self._restoring[req.request_id] = block_hash  # unpinned by free(), as a restore's is
        return self.snapshots.pin(block_hash)

    def capture_points(self, req: Request, start: int, num_new_tokens: int) -> list[int]:
        """Block boundaries in ``(start, start + num_new_tokens]`` to snapshot (the policy above)."""
        if not self.enable_caching:
            return []
        bs, prompt = self.block_size, req.num_prompt_tokens
        wanted = {(prompt - 1) // bs * bs, prompt // bs * bs}
        first = start // bs + 1
        out = []
        for b in range(first, (start + num_new_tokens) // bs + 1):
            pos = b * bs
            if pos in wanted or pos > prompt or (self.interval and b % self.interval == 0):
                out.append(pos)
        return out

    def cache_computed_blocks(self, req: Request) -> None:
        """After a step: register its blocks, file the snapshots it took, end a restore."""
        super().cache_computed_blocks(req)
        st = req.state
        if st is None:
            return
        if st.restore_from is not None:
            self.snapshots.unpin(self._restoring.pop(req.request_id))
            st.restore_from = None
        for pos, slot in st.captures:
            block_hash = req.block_hashes[pos // self.block_size - 1]
            self.snapshots.register(block_hash, slot)
            if pos > req.num_prompt_tokens:
                self._latest_generated[req.request_id] = block_hash
        st.captures = []

    def free(self, req: Request) -> None:
        super().free(req)
        self.states.free(req.request_id)
        self._latest_generated.pop(req.request_id, None)
        if (restored := self._restoring.pop(req.request_id, None)) is not None:
            self.snapshots.unpin(restored)
        if req.state is not None:
            for _, slot in req.state.captures:
                self.snapshots.release(slot)
        req.state = None
