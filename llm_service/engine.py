"""LLMEngine: the loop an LLM replica runs — schedule, run the model, post-process."""

from __future__ import annotations

import dataclasses
import itertools
import threading
import time
from collections.abc import Sequence
from typing import TYPE_CHECKING, cast

from llm_service.config import EngineConfig
from llm_service.engine_handoff import EngineHandoffs
from llm_service.errors import RequestRejected
from llm_service.hybrid_kv_cache_manager import HybridKVCacheManager
from llm_service.kv_cache_manager import KVCacheManager
from llm_service.kv_io import swap_sizes
from llm_service.kv_swap import SwapSpace
from llm_service.model_runner import ModelRunner
from llm_service.multimodal import MultiModalInput
from llm_service.outputs import (
    EngineStats,
    GenerateOutput,
    GenerateRequest,
    RequestOutput,
    RequestTiming,
    TokenLogprob,
)
from llm_service.request_validation import validate_mm, validate_prompt, validate_token_ids
from llm_service.sampling_params import SamplingParams
from llm_service.scheduler import Scheduler
from llm_service.sequence import Request, RequestStatus
from llm_service.step_isolation import execute_isolating
from llm_service.structured.spec import StructuredSpec
from llm_service.window_kv_cache_manager import WindowKVCacheManager
from mmcore.errors import StillHeld

if TYPE_CHECKING:
    from llm_service.structured.grammars import GrammarBackend


class LLMEngine(EngineHandoffs):
    """Serves prompts whose media positions are filled by encoder embeddings; never runs an encoder."""

    def __init__(self, config: EngineConfig) -> None:
        self.config = config
        self.runner = ModelRunner(config)
        self.hidden_size: int = self.runner.text_config.hidden_size
        # Width of an item's embedding rows: hidden_size, or more when they carry DeepStack levels.
        self.mm_row_width: int = getattr(self.runner.model, "mm_row_width", self.hidden_size)
        self.vocab_size: int = self.runner.text_config.vocab_size
        self.eos_token_ids: tuple[int, ...] = self.runner.text_config.eos_token_ids
        self.kv = self._make_kv_manager()
        self.scheduler = Scheduler(self.kv, config.max_num_seqs, config.max_num_batched_tokens)
        self._ids = itertools.count()
        self._grammars: GrammarBackend | None = None
        self._grammars_lock = threading.Lock()
        self._importing: dict[str, Request] = {}  # decode side: blocks reserved, KV on its way
        self._imported: list[Request] = []  # admitted since the last step: their first token is due
        self._firsts: dict[str, RequestOutput] = {}  # their first outputs, as the prefill side gave them
        self._ended: list[RequestOutput] = []  # early imports whose first token ended them: to emit
        # decode side: preempted imports' KV in host memory, within its budget (llm_service/kv_swap.py)
        self.swap = self._make_swap_space()
        self.scheduler.swap_room = self.swap.room
        self._failed: list[tuple[str, BaseException]] = []  # ended by the engine with a coded error

    @property
    def grammars(self) -> GrammarBackend:
        """The structured-output backend (the tokenizer's vocabulary and compiled grammars), made on
        first use: requests without a grammar never load it."""
        with self._grammars_lock:
            if self._grammars is None:
                from llm_service.structured.grammars import GrammarBackend

                self._grammars = GrammarBackend.for_model(
                    self.config.model, self.vocab_size, self.eos_token_ids
                )
            return self._grammars

    async def prepare_structured(self, spec: StructuredSpec) -> None:
        """Compile ``spec``'s grammar off the event loop and the step (cached), before the request
        is queued; raises RequestRejected naming the request field if it cannot be compiled."""
        import asyncio

        backend = self._grammars
        if backend is None:
            backend = await asyncio.to_thread(lambda: self.grammars)
        await backend.compile_async(spec)

    def _make_swap_space(self) -> SwapSpace:
        r = self.runner
        sizes = swap_sizes(r)
        budget = self.config.kv_swap_space_mib
        if budget is None:  # the KV cache's own size
            window = r.num_window_blocks if r.window is not None else 0
            states = r.num_state_slots if r.linear_states is not None else 0
            total = r.num_blocks * sizes.block + window * sizes.window_block + states * sizes.state
        else:
            total = int(budget * 2**20)
        return SwapSpace(sizes, total)

    def take_failed(self) -> list[tuple[str, BaseException]]:
        """Requests the engine ended since the last call with a coded error for their caller (a swap
        past its budget: ``SwapSpaceFull``); their blocks are freed already."""
        out, self._failed = self._failed, []
        return out

    def _make_kv_manager(self) -> KVCacheManager:
        """Blocks for every model; for a hybrid one also its state-cache slots (``linear_states``)."""
        c, states = self.config, self.runner.linear_states
        if states is not None:
            r = self.runner
            return HybridKVCacheManager(
                r.num_blocks,
                c.block_size,
                r.num_state_slots,
                r.num_state_snapshots,
                c.snapshot_interval_blocks,
            )
        if (window := self.runner.window) is not None:
            return WindowKVCacheManager(
                self.runner.num_blocks,
                c.block_size,
                self.runner.num_window_blocks,
                window,
                c.enable_prefix_caching,
            )
        return KVCacheManager(self.runner.num_blocks, c.block_size, c.enable_prefix_caching)

    # ---- online primitives -------------------------------------------------------------------------
    def add_request(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        sampling_params: SamplingParams,
        mm_inputs: Sequence[MultiModalInput] = (),
        cache_salt: str | None = None,
        handoff: bool = False,
    ) -> None:
        """Queue a request; raise RequestRejected if it can never be served. ``cache_salt``: its
        prefix-cache blocks are shared only with requests of the same salt. ``handoff`` (a prefill
        replica's): it leaves with its first token (``finish_reason="handoff"``), its blocks held for
        a decode replica (``handoff_blocks``, ``release_handoff``)."""
        if handoff:
            self.scheduler.release_handoff(request_id)  # prefilled again: its earlier hand-off is void
        req = self._new_request(request_id, prompt_token_ids, sampling_params, mm_inputs, cache_salt)
        req.handoff = handoff
        self.scheduler.add_request(req)

    def _new_request(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        sampling_params: SamplingParams,
        mm_inputs: Sequence[MultiModalInput],
        cache_salt: str | None,
    ) -> Request:
        """A checked request, its runner state prepared (``RequestRejected`` if it can never be served)."""
        if request_id in self.scheduler.requests or request_id in self._importing:
            # an earlier attempt still here (a prefill copy pinned for its hand-off, say): retry later
            raise StillHeld(f"request id {request_id!r} is already in the engine")
        sampling_params.validate()
        validate_prompt(prompt_token_ids, sampling_params, self.config, self.vocab_size, self.kv)
        validate_token_ids(sampling_params, self.vocab_size)
        items = sorted(mm_inputs, key=lambda m: m.offset)
        self._validate_mm(len(prompt_token_ids), items)
        stop = set(sampling_params.stop_token_ids)
        if not sampling_params.ignore_eos or sampling_params.structured is not None:
            stop.update(self.eos_token_ids)  # a grammar ends with the model's stop token
        spec = sampling_params.structured
        grammar = None if spec is None else self.grammars.matcher(spec)
        req = Request(
            request_id=request_id,
            prompt_token_ids=list(prompt_token_ids),
            sampling_params=sampling_params,
            stop_token_ids=frozenset(stop),
            max_model_len=self.config.max_model_len,
            mm_spans=[(m.offset, m.length, m.mm_hash) for m in items],
            cache_salt=cache_salt,
            missing=[(m.offset, m.end) for m in items if m.embeddings is None],
        )
        self.runner.prepare_request(req, items, grammar)
        return req

    def take_parked(self) -> list[str]:
        """Requests held up since the last call by a media item they have no embeddings for: one sent
        without them whose span left the prefix cache, or one still being encoded. Their owner
        fetches or awaits them and calls ``supply_embeddings`` (reported once per request)."""
        return self.scheduler.take_parked()

    def supply_embeddings(self, request_id: str, mm_inputs: Sequence[MultiModalInput]) -> None:
        """Embeddings for some or all of the items a request was given without, in any order; it
        computes on up to the next item it still lacks. Unknown ids (aborted meanwhile) are ignored;
        raises RequestRejected for a bad shape."""
        req = self.scheduler.requests.get(request_id)
        if req is None:
            return
        self._validate_mm(req.num_prompt_tokens, sorted(mm_inputs, key=lambda m: m.offset))
        req.missing = self.runner.supply(req, list(mm_inputs))
        self.scheduler.unpark(request_id)

    def step(self) -> list[RequestOutput]:
        """One engine iteration; returns the requests that got a new token (finished ones included)
        and those whose computation failed in it (``finish_reason="error"``, see
        ``step_isolation.execute_isolating``)."""
        sched = self.scheduler.schedule()
        for refused in sched.swap_refused:  # retired by the scheduler, their blocks freed
            self.runner.release(refused.request.request_id)
            self._failed.append((refused.request.request_id, self.swap.refusal(refused)))
        self.swap.apply(sched, self.runner, self.kv)
        sampled, faults = execute_isolating(self.runner, sched)
        self.runner.accept_sampled(sampled)  # the grammars advance only once the step stands
        outputs = self._first_outputs()
        outputs += [self._fail(rid, msg) for rid, msg in faults.items()]
        now = time.monotonic()
        for req in self.scheduler.update(sched, sampled):
            rng_state = None
            if req.is_finished:
                if req.status is RequestStatus.HANDED_OFF:  # a seeded one's draws go on elsewhere
                    rng_state = self.runner.generator_state(req.request_id)
                self.runner.release(req.request_id)
            lp = req.output_logprobs[-1]  # the runner's TokenLogprob when asked for (execute)
            if len(req.output_token_ids) == 1:
                req.first_token_time = now
            outputs.append(
                RequestOutput(
                    request_id=req.request_id,
                    new_token_ids=[req.output_token_ids[-1]],
                    new_logprobs=[cast(TokenLogprob, lp)]
                    if req.sampling_params.logprobs is not None
                    else None,
                    finished=req.is_finished,
                    finish_reason=req.status.value if req.is_finished else None,
                    num_prompt_tokens=req.num_prompt_tokens,
                    num_cached_tokens=max(req.num_cached_tokens, 0),
                    timing=_timing(req, now) if req.is_finished else None,
                    prompt_logprobs=_prompt_logprobs(req) if len(req.output_token_ids) == 1 else None,
                    rng_state=rng_state,
                )
            )
        return outputs

    # ---- failure isolation (llm_service/step_isolation.py) -------------------------------------------
    def _fail(self, request_id: str, message: str) -> RequestOutput:
        """Retire a culprit (its KV blocks freed) and say so in its last output."""
        req = self.scheduler.abort(request_id, RequestStatus.FINISHED_ERROR)
        assert req is not None, f"failed request {request_id!r} is not in the engine"
        self.swap.drop(request_id)
        self.runner.release(request_id)
        return RequestOutput(
            request_id=request_id,
            new_token_ids=[],
            new_logprobs=None,
            finished=True,
            finish_reason=RequestStatus.FINISHED_ERROR.value,
            num_prompt_tokens=req.num_prompt_tokens,
            num_cached_tokens=max(req.num_cached_tokens, 0),
            error=message,
        )

    def abort(self, request_id: str) -> None:
        """Drop a request and free its blocks; unknown or finished ids are ignored. Emits no output."""
        self.scheduler.abort(request_id)
        self.cancel_import(request_id)
        self.swap.drop(request_id)
        self.runner.release(request_id)

    def _first_outputs(self) -> list[RequestOutput]:
        """The first output of each request imported since the last step, as the prefill side gave it
        (its first token, its logprobs and prompt logprobs when asked for, the prefill side's hit);
        and those of early imports whose first token ended them."""
        imported, self._imported = self._imported, []
        ended, self._ended = self._ended, []
        firsts = [(req, self._firsts.pop(req.request_id)) for req in imported]
        return ended + [
            dataclasses.replace(first, finished=False, finish_reason=None)
            for req, first in firsts
            if req.request_id in self.scheduler.requests
        ]

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished() or bool(self._imported) or bool(self._ended)

    def stats(self) -> EngineStats:
        return EngineStats(
            num_running=len(self.scheduler.running),
            num_waiting=len(self.scheduler.waiting) + len(self.scheduler.parked),
            num_free_blocks=self.kv.num_free_blocks,
            num_total_blocks=self.kv.num_total_blocks,
            kv_usage=self.kv.usage,
            prefix_hit_tokens=self.kv.prefix_hit_tokens,
            prefix_query_tokens=self.kv.prefix_query_tokens,
            num_preemptions=self.scheduler.num_preemptions,
            num_free_window_blocks=getattr(self.kv, "num_free_window_blocks", None),
            num_free_state_slots=getattr(self.kv, "num_free_state_slots", None),
        )

    # ---- offline -----------------------------------------------------------------------------------
    def generate(self, requests: Sequence[GenerateRequest]) -> list[GenerateOutput]:
        """Run ``requests`` to completion (batched together), results in input order."""
        ids = [f"generate-{next(self._ids)}" for _ in requests]
        if any(m.embeddings is None for r in requests for m in r.mm_inputs):
            raise RequestRejected("bad_mm_input", "generate() needs every media item's embeddings")
        for rid, r in zip(ids, requests, strict=True):
            self.add_request(rid, r.prompt_token_ids, r.sampling_params, r.mm_inputs)
        results: dict[str, GenerateOutput] = {
            rid: GenerateOutput([], [] if r.sampling_params.logprobs is not None else None, 0, 0, None)
            for rid, r in zip(ids, requests, strict=True)
        }
        pending = set(ids)
        while pending:
            for o in self.step():
                res = results.get(o.request_id)
                if res is None:
                    continue
                res.token_ids.extend(o.new_token_ids)
                if res.logprobs is not None and o.new_logprobs:
                    res.logprobs.extend(o.new_logprobs)
                res.num_prompt_tokens, res.num_cached_tokens = o.num_prompt_tokens, o.num_cached_tokens
                if o.prompt_logprobs is not None:
                    res.prompt_logprobs = o.prompt_logprobs
                if o.finished:
                    res.finish_reason, res.error = o.finish_reason, o.error
                    pending.discard(o.request_id)
        return [results[rid] for rid in ids]

    def _validate_mm(self, num_tokens: int, items: list[MultiModalInput]) -> None:
        """``request_validation.validate_mm`` against this model (items sorted by offset)."""
        r = self.runner
        validate_mm(num_tokens, items, self.mm_row_width, r.text_config, r.model.uses_mrope)


def _prompt_logprobs(req: Request) -> list[TokenLogprob] | None:
    """The prompt's logprobs (tokens 1..) the runner kept on its prefill, when asked for."""
    if req.sampling_params.prompt_logprobs is None:
        return None
    missing = [p for p in range(1, req.num_prompt_tokens) if p not in req.prompt_logprobs]
    assert not missing, f"request {req.request_id}: no prompt logprobs at {missing[:4]}"
    return [cast(TokenLogprob, req.prompt_logprobs[p]) for p in range(1, req.num_prompt_tokens)]


def _timing(req: Request, now: float) -> RequestTiming:
    return RequestTiming(
        queue=req.scheduled_time - req.arrival_time,
        prefill=req.first_token_time - req.scheduled_time,
        decode=now - req.first_token_time,
    )
