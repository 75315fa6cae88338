"""A decode replica's host-memory copies of preempted imported requests' KV (E/P/D).

An imported request holding no embeddings for one of its items cannot recompute its prompt on a
decode replica (the decode pool never fetches media). Preempted, it is swapped instead, as SGLang's
decode side retracts a request to host memory: the scheduler names its blocks (``SwapOut``) and frees
them; before the step runs, and so before anything overwrites them, ``swap_out`` copies their KV (the
window group's still-read blocks, a hybrid's state slot) to host memory with the hand-off's own
reader; readmitted, the scheduler allocates blocks for every computed token and ``swap_in`` writes
the copy into them with the hand-off's writer. The request decodes on as if never preempted.

The copies have a budget of their own (``EngineConfig.kv_swap_space_mib``; by default the size of
the replica's KV cache, as vLLM's and SGLang's host pools are sized by a setting): the scheduler asks
``room`` before it swaps a request out, and one whose copy would pass the budget is not swapped but
ended with the retryable 503 ``kv_swap_full`` (``SwapSpaceFull``), its blocks freed, rather than
holding host memory without bound.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from llm_service.kv_handoff import KVBlocks
from llm_service.scheduler import SchedulerOutput, SwapOut

if TYPE_CHECKING:
    from llm_service.kv_cache_manager import KVCacheManager
    from llm_service.model_runner import ModelRunner


class SwapSpaceFull(RuntimeError):
    """A preempted request's KV copy would pass the swap budget: the request ends, its blocks freed;
    the client gets a 503 with Retry-After (its retry is prefilled again)."""

    status_code = 503
    code = "kv_swap_full"
    retry_after_s = 1


@dataclass(frozen=True)
class SwapSizes:
    """Host bytes of one block of every full-attention layer, of every sliding-window layer, and of
    one linear-attention state slot (``kv_io.swap_sizes``)."""

    block: int
    window_block: int = 0
    state: int = 0

    def of(self, out: SwapOut) -> int:
        state = self.state if out.state_slot is not None else 0
        return len(out.block_ids) * self.block + len(out.window_ids) * self.window_block + state


@dataclass
class SwapSpace:
    sizes: SwapSizes = field(default_factory=lambda: SwapSizes(0))
    budget_bytes: int | None = None  # None: no bound
    _held: dict[str, tuple[SwapOut, KVBlocks]] = field(default_factory=dict)
    _bytes: dict[str, int] = field(default_factory=dict)  # per request, reserved by ``room``
    held_bytes: int = 0  # host memory the copies take (or are about to: reserved this step)
    swapped_out: int = 0  # requests swapped out so far
    refused: int = 0  # requests whose copy would have passed the budget (ended: ``SwapSpaceFull``)

    def __len__(self) -> int:
        return len(self._held)

    def room(self, out: SwapOut) -> bool:
        """Reserve room for ``out``'s copy (the scheduler, before it swaps the request out); False,
        reserving nothing, when the copy would pass the budget."""
        n = self.sizes.of(out)
        if self.budget_bytes is not None and self.held_bytes + n > self.budget_bytes:
            self.refused += 1
            return False
        self._bytes[out.request.request_id] = n
        self.held_bytes += n
        return True

    def refusal(self, out: SwapOut) -> SwapSpaceFull:
        mib = 2**20
        budget = self.budget_bytes or 0
        return SwapSpaceFull(
            f"{out.request.request_id} was preempted on this decode replica and its KV copy "
            f"({self.sizes.of(out) / mib:.2f} MiB) would pass the swap space "
            f"({self.held_bytes / mib:.2f} of kv_swap_space_mib={budget / mib:g} MiB held); retry"
        )

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
            self.held_bytes -= self._bytes.pop(rid, 0)
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
        self.held_bytes -= self._bytes.pop(request_id, 0)
