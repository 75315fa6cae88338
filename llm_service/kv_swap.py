"""A decode replica's host-memory copies of preempted imported requests' KV (E/P/D).

An imported request holding no embeddings for one of its items cannot recompute its prompt on a
decode replica (the decode pool never fetches media). Preempted, it is swapped instead, as SGLang's
decode side retracts a request to host memory: the scheduler names its blocks (``SwapOut``) and frees
them; before the step runs, and so before anything overwrites them, ``swap_out`` copies their KV (the
window group's still-read blocks, a hybrid's state slot) to host memory with the hand-off's own
reader; readmitted, the scheduler allocates blocks for every computed token and ``swap_in`` writes
the copy into them with the hand-off's writer. The request decodes on as if never preempted.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from llm_service.kv_handoff import KVBlocks
from llm_service.scheduler import SchedulerOutput, SwapOut

if TYPE_CHECKING:
    from llm_service.kv_cache_manager import KVCacheManager
    from llm_service.model_runner import ModelRunner


@dataclass
class SwapSpace:
    _held: dict[str, tuple[SwapOut, KVBlocks]] = field(default_factory=dict)
    swapped_out: int = 0  # requests swapped out so far

    def __len__(self) -> int:
        return len(self._held)

    def apply(self, sched: SchedulerOutput, runner: ModelRunner, kv: KVCacheManager) -> None:
        """The step's swaps, before it runs: copies out, then copies back in."""
        for out in sched.swapped_out:
            blocks = runner.read_kv_blocks(
                out.request.request_id, out.block_ids, 0, out.window_ids, out.window_from, out.state_slot
            )
            self._held[out.request.request_id] = (out, blocks)
            self.swapped_out += 1
        for req in sched.swapped_in:
            out, blocks = self._held.pop(req.request_id)
            rid = req.request_id
            window = kv.window_table(rid)
            window_ids = window[out.window_from : out.window_from + len(out.window_ids)] if window else []
            runner.write_kv_blocks(
                kv.block_table(rid)[: len(out.block_ids)],
                blocks,
                window_ids,
                req.state.slot if req.state is not None else None,
            )

    def drop(self, request_id: str) -> None:
        """The request left the engine while swapped out (aborted): its copy goes."""
        self._held.pop(request_id, None)
