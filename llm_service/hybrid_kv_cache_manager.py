"""KV blocks plus state-cache slots for hybrid models (pure Python): what the scheduler sees.

The scheduler talks to a ``KVCacheManager`` only (``allocate_slots``, ``free``, prefix lookups); this
one also hands a request a state slot when it is admitted (its first ``allocate_slots``) and takes it
back whenever its blocks go (finish, abort, preemption). So the state budget is accounted where the
blocks are: admission waits for a free slot as for free blocks, and a preempted request's states
are dropped and recomputed from token 0 (the scheduler resets ``num_computed_tokens``).

Prefix caching is off: a KV-block hit would skip tokens whose linear-attention states are not
kept, so every request computes its prompt from the start.
"""

from __future__ import annotations

from llm_service.block_pool import KVBlock
from llm_service.kv_cache_manager import KVCacheManager
from llm_service.sequence import Request
from llm_service.state_cache import StatePool


class HybridKVCacheManager(KVCacheManager):
    def __init__(self, num_blocks: int, block_size: int, num_state_slots: int) -> None:
        super().__init__(num_blocks, block_size, enable_caching=False)
        self.states = StatePool(num_state_slots)

    @property
    def num_free_state_slots(self) -> int:
        return self.states.num_free

    def allocate_slots(
        self, req: Request, num_new_tokens: int, computed: list[KVBlock] | None = None
    ) -> bool:
        if req.state_slot is not None:
            return super().allocate_slots(req, num_new_tokens, computed)
        if self.states.num_free == 0 or not super().allocate_slots(req, num_new_tokens, computed):
            return False
        req.state_slot = self.states.allocate(req.request_id)
        return True

    def free(self, req: Request) -> None:
        super().free(req)
        self.states.free(req.request_id)
        req.state_slot = None
