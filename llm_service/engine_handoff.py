"""``LLMEngine``'s E/P/D methods (a mixin): the prefill side's hand-off of a request's blocks, the
decode side's import of them (llm_service/kv_handoff.py has the picture), and the pull overlapped with
the prefill (llm_service/serve/early_handoff.py). They run on the engine's thread, as every engine call."""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Sequence
from typing import TYPE_CHECKING

from llm_service.hybrid_kv_cache_manager import HybridKVCacheManager
from llm_service.kv_cache_manager import KVCacheManager, cdiv
from llm_service.kv_handoff import HeldKV, ImportSlots, KVTransferFailed
from llm_service.window_kv_cache_manager import WindowKVCacheManager
from mmcore.errors import Overloaded

if TYPE_CHECKING:
    from llm_service.config import EngineConfig
    from llm_service.model_runner import ModelRunner
    from llm_service.multimodal import MultiModalInput
    from llm_service.outputs import EngineStats, RequestOutput
    from llm_service.sampling_params import SamplingParams
    from llm_service.scheduler import Scheduler
    from llm_service.sequence import Request


class EngineHandoffs:
    """What ``LLMEngine`` holds for these (set in its ``__init__``)."""

    config: EngineConfig
    kv: KVCacheManager
    scheduler: Scheduler
    runner: ModelRunner
    _importing: dict[str, Request]  # decode side: blocks reserved, KV on its way
    _imported: list[Request]  # admitted since the last step: their first token is due
    _firsts: dict[str, RequestOutput]  # their first outputs, as the prefill side gave them
    _ended: list[RequestOutput]  # early imports whose first token ended them: to emit

    if TYPE_CHECKING:

        def _new_request(
            self,
            request_id: str,
            prompt_token_ids: list[int],
            sampling_params: SamplingParams,
            mm_inputs: Sequence[MultiModalInput],
            cache_salt: str | None,
        ) -> Request: ...

        def stats(self) -> EngineStats: ...

    # ---- E/P/D: the prefill side's hand-off, the decode side's import (llm_service/kv_handoff.py) ------
    def handoff_blocks(self, request_id: str) -> list[int]:
        """The blocks holding a handed-off request's prompt (its last one may be partial)."""
        req = self.scheduler.handed_off[request_id]
        return self.kv.block_table(request_id)[: cdiv(req.num_computed_tokens, self.config.block_size)]

    def handoff_kv(self, request_id: str) -> HeldKV:
        """What a handed-off request holds for its pull: its blocks, its window group's, its state slot."""
        req = self.scheduler.handed_off[request_id]
        blocks = self.handoff_blocks(request_id)
        first, window = self.kv.window_held(request_id, len(blocks))
        if not isinstance(self.kv, HybridKVCacheManager) or req.state is None:
            return HeldKV(blocks, window, first)
        return HeldKV(blocks, window, first, req.state.slot, self.kv.hold_prompt_snapshot(req))

    def handoff_hashes(self, request_id: str) -> list[bytes]:
        """The chained hashes of a handed-off request's full prompt blocks (empty without prefix caching)."""
        req = self.scheduler.handed_off[request_id]
        return list(req.block_hashes[: req.num_prompt_tokens // self.config.block_size])

    def release_handoff(self, request_id: str) -> None:
        """Free a handed-off request's blocks (pulled, or past its deadline): they stay cached here."""
        self.scheduler.release_handoff(request_id)

    def reserve_import(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        sampling_params: SamplingParams,
        mm_inputs: Sequence[MultiModalInput],
        cache_salt: str | None,
        first: RequestOutput | None,
        block_hashes: Sequence[bytes] = (),
    ) -> ImportSlots:
        """Blocks for a request prefilled elsewhere, whose first token is ``first``: the leading full
        blocks this prefix cache holds, and new ones for the rest (``ImportSlots``). Its items need
        no embeddings (their positions are never computed here). ``block_hashes``: the prefill side's
        chained hashes of the full blocks, which must equal this side's (the same tokens, items and
        salt), else ``KVTransferFailed``. Raises ``RequestRejected`` as ``add_request`` does,
        ``Overloaded`` when the pool is short of blocks (or of state slots)."""
        req = self._new_request(request_id, prompt_token_ids, sampling_params, mm_inputs, cache_salt)
        req.imported = True
        if first is not None:
            try:
                self._take_first(req, first)
            except ValueError as e:  # its generator state does not fit this replica's generator
                self.runner.release(request_id)
                raise KVTransferFailed(str(e)) from e
        hits = self.kv.allocate_import(req, req.num_prompt_tokens)
        if hits is None:
            self.runner.release(request_id)
            raise Overloaded(
                f"{request_id} needs up to {cdiv(req.num_prompt_tokens, self.config.block_size)} KV "
                f"blocks (and its window blocks or a state slot, where the model has them); "
                f"free: {self._free_for_import()}"
            )
        self._importing[request_id] = req
        self.check_import_hashes(request_id, block_hashes)
        window_from, window_ids = self.kv.import_window(request_id, hits)
        slots = ImportSlots(hits, self.kv.block_table(request_id)[hits:], window_from, window_ids)
        if isinstance(self.kv, HybridKVCacheManager) and req.state is not None:
            slots = dataclasses.replace(
                slots, state_slot=req.state.slot, snapshot_slot=self.kv.import_snapshot(req)
            )
        return slots

    def check_import_hashes(self, request_id: str, block_hashes: Sequence[bytes]) -> None:
        """The prefill side's chained hashes of the prompt's full blocks equal this side's (the same
        tokens, items and salt), else the import is cancelled (its blocks freed) and
        ``KVTransferFailed`` raised. Checked at the reservation (``KVHandoff.block_hashes``), or, for
        an early hand-off, whose answer came before the prefill side had hashed anything, with its last
        pull (``KVBlocks.block_hashes``) before the blocks are registered under this side's hashes."""
        req = self._importing.get(request_id)
        if req is None or not self.kv.enable_caching or not block_hashes:
            return
        # an early import hashed its prompt without its first token: its last full block is hashed
        # once that token is in (``admit_import``), so it may have one hash fewer than the prefill side
        n = min(len(req.block_hashes), len(block_hashes))
        if len(req.block_hashes) < len(block_hashes) - 1 or req.block_hashes[:n] != list(block_hashes[:n]):
            self.cancel_import(request_id)
            raise KVTransferFailed(f"{request_id}: the prefill side's block hashes differ from this side's")

    def _free_for_import(self) -> str:
        """What this replica has free of what an import takes (the refusal's message)."""
        s = self.stats()
        free = [f"{s.num_free_blocks} KV blocks"]
        if s.num_free_window_blocks is not None:
            free.append(f"{s.num_free_window_blocks} window blocks")
        if s.num_free_state_slots is not None:
            free.append(f"{s.num_free_state_slots} state slots")
        return ", ".join(free)

    def _take_first(self, req: Request, first: RequestOutput) -> None:
        """The prefill side's first output of an import: its token appended, emitted by a later step;
        a seeded request's generator resumes where the prefill side's left it (``ValueError`` if its
        state does not fit this replica's generator: nothing taken)."""
        if first.rng_state is not None:
            self.runner.resume_generator(req.request_id, first.rng_state)
            first = dataclasses.replace(first, rng_state=None)  # not sent on to the client
        token = first.new_token_ids[0]
        req.append_output(token, first.new_logprobs[0] if first.new_logprobs else None)
        self.runner.accept_sampled({req.request_id: (token, None)})
        req.num_cached_tokens = first.num_cached_tokens  # the prefill side's hit: what saved compute
        self._firsts[req.request_id] = first

    def admit_import(
        self, request_id: str, snapshot: bool = False, first: RequestOutput | None = None
    ) -> None:
        """Its KV is in its blocks: register them under their chained hashes and run it from its first
        token (emitted by the next ``step``). ``snapshot``: a hybrid's pulled KV held the prefill
        side's snapshot, filed with the blocks. ``first``: an early hand-off's first output, which
        came with the last pull (one that ended the request is emitted as it is, the blocks freed).
        Unknown ids (aborted meanwhile) are ignored."""
        req = self._importing.get(request_id)
        if req is None:
            return
        if first is not None and first.finished:
            self.cancel_import(request_id)
            self._ended.append(first)
            return
        if first is not None:
            try:
                self._take_first(req, first)
            except ValueError as e:  # a clean failure of this request (its output says why), no crash
                self.cancel_import(request_id)
                self._ended.append(_failed(first, f"KV hand-off failed: {e}"))
                return
        del self._importing[request_id]
        if not snapshot and isinstance(self.kv, HybridKVCacheManager):
            self.kv.drop_import_snapshot(req)
        req.num_computed_tokens = req.num_prompt_tokens
        self.kv.cache_computed_blocks(req)
        req.scheduled_time = req.first_token_time = time.monotonic()
        self.scheduler.add_running(req)
        self._imported.append(req)

    def cancel_import(self, request_id: str) -> None:
        """Free the blocks reserved for an import that failed (or was aborted); unknown ids are ignored."""
        req = self._importing.pop(request_id, None)
        if req is not None:
            self._firsts.pop(request_id, None)
            self.kv.free(req)
            self.runner.release(request_id)

    # ---- E/P/D, the pull overlapped with the prefill (``KVHandoff.early``) ------------------------
    def import_needs(self, num_tokens: int) -> tuple[int, int, int]:
        """What an import of a ``num_tokens``-token prompt takes: (blocks, window blocks, state slots)."""
        n = cdiv(num_tokens, self.config.block_size)
        window = (
            n - self.kv.first_window_block(num_tokens) if isinstance(self.kv, WindowKVCacheManager) else 0
        )
        return n, window, int(isinstance(self.kv, HybridKVCacheManager))

    def pin_computed_blocks(self, request_id: str, from_block: int) -> list[int] | None:
        """A request still prefilling here: its computed full blocks from ``from_block`` on, each given
        one more reference (``unpin_blocks`` after reading them: a preemption cannot hand them to
        another request meanwhile); [] while none is new. None: it is no longer prefilling here."""
        req = self.scheduler.requests.get(request_id)
        if req is None or req.output_token_ids:
            return None
        table = self.kv.block_table(request_id)
        ids = table[from_block : min(req.num_computed_tokens // self.config.block_size, len(table))]
        self.kv.pool.touch([self.kv.pool.blocks[i] for i in ids])
        return ids

    def unpin_blocks(self, block_ids: list[int]) -> None:
        self.kv.pool.free([self.kv.pool.blocks[i] for i in block_ids])


def _failed(first: RequestOutput, message: str) -> RequestOutput:
    """An import that could not go on: its last output, a failure naming why."""
    return dataclasses.replace(
        first,
        new_token_ids=[],
        new_logprobs=None,
        finished=True,
        finish_reason="error",
        error=message,
        prompt_logprobs=None,
        rng_state=None,
    )
