"""Continuous batching with chunked prefill and recompute preemption (pure Python).

Each step gives every running request its next tokens — the rest of its prompt (chunked to the
budget) or one decode token — then admits waiting requests FCFS while budget, ``max_num_seqs`` and
blocks allow. When a running request cannot get a block, the most recently admitted request is
preempted: its blocks go back to the pool and it returns to the front of the waiting queue, to be
recomputed later from whatever prefix the cache still holds. A decode replica's imported request
that holds no embeddings for an item (E/P/D: it could not recompute its prompt) is swapped instead,
as SGLang's decode side retracts to host memory: the step's ``swapped_out`` names its blocks, which
the engine copies out before the step runs (nothing has overwritten them yet); readmitted, its
blocks are allocated at once for every computed token (``swapped_in``: the engine writes them back)
and it decodes on. A chunk never ends inside a request's
bidirectional span (``chunk_size``): the chunk stops before it and the span goes whole into a later one.

A request may arrive before all its media items' embeddings (``Request.missing``: still encoding,
or sent without because their span was cached). It is computed up to the first item it lacks and
then waits, holding its KV blocks and its seat but no step's budget (``Request.blocked``); one that
cannot compute a single token when it reaches the queue's front is set aside (``parked``) so the
ones behind it go on. Either way it is reported once (``take_parked``) for its owner to fetch what
it lacks; each arrival (``unpark``) puts a parked one back at the front.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field

from llm_service.kv_cache_manager import KVCacheManager, cdiv
from llm_service.sequence import Request, RequestStatus
from mmcore.errors import Overloaded


@dataclass
class ScheduledChunk:
    """Compute tokens ``[start, start + num_tokens)`` of ``request``; sample iff it reaches the end."""

    request: Request
    start: int
    num_tokens: int
    block_table: list[int]
    window_table: list[int] | None = None  # the sliding-window layers' blocks, when they have their own
    samples: bool = field(init=False)

    def __post_init__(self) -> None:
        self.samples = self.start + self.num_tokens == self.request.num_tokens


@dataclass
class SwapOut:
    """A preempted request's KV to copy to host memory before the step runs: its computed tokens'
    blocks, the window group's still read from ``window_from`` (none without one), its state slot."""

    request: Request
    block_ids: list[int]
    window_from: int = 0
    window_ids: list[int] = field(default_factory=list)
    state_slot: int | None = None


@dataclass
class SchedulerOutput:
    chunks: list[ScheduledChunk] = field(default_factory=list)
    preempted: list[str] = field(default_factory=list)
    swapped_out: list[SwapOut] = field(default_factory=list)
    swapped_in: list[Request] = field(default_factory=list)  # blocks allocated: write their KV back
    swap_refused: list[SwapOut] = field(default_factory=list)  # past the swap budget: retired, to fail

    @property
    def num_tokens(self) -> int:
        return sum(c.num_tokens for c in self.chunks)


class WaitingQueueFull(Overloaded):
    """The engine's waiting queue is at its bound."""


@dataclass(frozen=True)
class WaitingBound:
    """How much may wait for admission to the running batch: requests and their prompt tokens.

    A request arriving at an empty queue is always taken (however long its prompt), so no valid
    request is refused forever.
    """

    max_requests: int | None = None
    max_tokens: int | None = None

    def check(self, num_waiting: int, waiting_tokens: int, new_tokens: int) -> None:
        if num_waiting == 0:
            return
        if self.max_requests is not None and num_waiting >= self.max_requests:
            raise WaitingQueueFull(
                f"{num_waiting} requests are waiting (max_waiting_requests={self.max_requests})"
            )
        if self.max_tokens is not None and waiting_tokens + new_tokens > self.max_tokens:
            raise WaitingQueueFull(
                f"{waiting_tokens} prompt tokens are waiting and this request adds {new_tokens} "
                f"(max_waiting_tokens={self.max_tokens})"
            )


def chunk_size(req: Request, start: int, budget: int) -> int:
    """How many of ``req``'s tokens from ``start`` to compute under ``budget``: all that remain, or as
    many as fit, ended before a bidirectional span (``req.attention_spans``) it would cut in two —
    an image whose tokens attend each other both ways is computed in one chunk. 0: not this step."""
    n = min(req.num_tokens - start, budget)
    end = start + n
    for offset, length in req.attention_spans:
        if offset < end < offset + length:
            return max(offset - start, 0)
    return n


class Scheduler:
    def __init__(self, kv: KVCacheManager, max_num_seqs: int, max_num_batched_tokens: int) -> None:
        self.kv = kv
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []  # in admission order: the last one is preempted first
        self.requests: dict[str, Request] = {}
        self.num_preemptions = 0
        # Requests at the queue's front that could not compute a token for want of embeddings: out
        # of the queue until ``unpark``. ``newly_parked``: requests held up by a missing item (here
        # or blocked while running) that the engine has not reported yet.
        self.parked: dict[str, Request] = {}
        self.newly_parked: list[str] = []
        # Prefill replicas (E/P/D): requests that left with their first token, their blocks still held
        # for a decode replica's pull (``release_handoff``)
        self.handed_off: dict[str, Request] = {}
        # Decode replicas (E/P/D): room for a swap's host copy, reserved (llm_service/kv_swap.py's budget)
        self.swap_room: Callable[[SwapOut], bool] = lambda _: True

    def add_request(self, req: Request) -> None:
        self.requests[req.request_id] = req
        self.waiting.append(req)

    def add_running(self, req: Request) -> None:
        """A request whose prompt's KV is already in its blocks (imported from a prefill replica): it
        joins the running batch at once, its next step a decode."""
        req.status = RequestStatus.RUNNING
        self.requests[req.request_id] = req
        self.running.append(req)

    def release_handoff(self, request_id: str) -> None:
        """Free a handed-off request's blocks (pulled, or its pin's deadline passed); they stay in the
        prefix cache. Unknown ids are ignored."""
        req = self.handed_off.pop(request_id, None)
        if req is not None:
            self.kv.free(req)

    def has_unfinished(self) -> bool:
        """Work for a step: a queued request, or a running one not waiting for embeddings."""
        return bool(self.waiting) or any(not r.blocked for r in self.running)

    def take_parked(self) -> list[str]:
        """Requests held up by missing embeddings since the last call (to be fetched and supplied)."""
        out, self.newly_parked = self.newly_parked, []
        return out

    def unpark(self, request_id: str) -> None:
        """Embeddings arrived for it (``Request.missing`` updated by the caller): a parked request goes
        first in the queue again (it had reached the front); a running one just goes on."""
        req = self.parked.pop(request_id, None)
        if req is not None:
            self.waiting.appendleft(req)

    def abort(
        self, request_id: str, status: RequestStatus = RequestStatus.FINISHED_ABORTED
    ) -> Request | None:
        """Retire a request wherever it is and free its blocks; ``status`` says why (abort or error)."""
        req = self.requests.pop(request_id, None)
        if req is None:
            req = self.handed_off.pop(request_id, None)
            if req is not None:
                self.kv.free(req)
            return req
        if req in self.running:
            self.running.remove(req)
        elif req in self.waiting:
            self.waiting.remove(req)
        self.parked.pop(request_id, None)
        self.kv.free(req)
        req.status = status
        return req

    def schedule(self) -> SchedulerOutput:
        out = SchedulerOutput()
        budget = self.max_num_batched_tokens
        i = 0
        while i < len(self.running) and budget > 0:
            req = self.running[i]
            start = req.num_computed_tokens
            n = chunk_size(req, start, min(budget, req.ready_end(start) - start))
            if n == 0:  # blocked on an item's embeddings, or its next tokens start a bidirectional
                i += 1  # span the budget left cannot hold
                continue
            while not self.kv.allocate_slots(req, n):
                victim = self.running.pop()
                self._preempt(victim, out)
                out.preempted.append(victim.request_id)
                if victim is req:
                    break
            else:
                out.chunks.append(self._chunk(req, req.num_computed_tokens, n))
                budget -= n
                i += 1
                continue
            break  # ``req`` itself was preempted: everything after it is gone too
        if out.preempted:
            return out
        while self.waiting and budget > 0 and len(self.running) < self.max_num_seqs:
            req = self.waiting[0]
            if req.swapped:
                n = chunk_size(req, req.num_computed_tokens, budget)
                if n == 0 or not self.kv.allocate_swap_in(req, n):
                    break
                self.waiting.popleft()
                req.status, req.swapped = RequestStatus.RUNNING, False
                self.running.append(req)
                out.swapped_in.append(req)
                out.chunks.append(self._chunk(req, req.num_computed_tokens, n))
                budget -= n
                continue
            hits = self.kv.get_computed_blocks(req)
            if req.sampling_params.prompt_logprobs is not None:  # cached positions have no logits
                hits = hits[:0]
            num_computed = len(hits) * self.kv.block_size
            ready = req.ready_end(num_computed)
            if ready < req.num_tokens:  # it lacks the embeddings of an item it must compute
                self._report(req)
                if ready == num_computed:  # not a token it can compute: set aside
                    self.waiting.popleft()
                    self.parked[req.request_id] = req
                    continue
            n = chunk_size(req, num_computed, min(budget, ready - num_computed))
            if n == 0 or not self.kv.allocate_slots(req, n, hits):
                break
            self.waiting.popleft()
            self.kv.record_prefix_query(req.num_tokens, num_computed)
            req.status = RequestStatus.RUNNING
            req.num_computed_tokens = num_computed
            if req.num_cached_tokens < 0:  # its first admission (a preempted one was admitted before)
                req.num_cached_tokens = num_computed
                req.scheduled_time = time.monotonic()
            self.running.append(req)
            out.chunks.append(self._chunk(req, num_computed, n))
            budget -= n
        return out

    def update(self, out: SchedulerOutput, sampled: dict[str, tuple[int, object]]) -> list[Request]:
        """Advance computed counts, append sampled tokens, retire finished requests.

        Returns the requests that received a token this step (finished ones included).
        """
        touched = []
        for chunk in out.chunks:
            req = chunk.request
            if req.is_finished:  # aborted between schedule() and update()
                continue
            req.num_computed_tokens = chunk.start + chunk.num_tokens
            self.kv.cache_computed_blocks(req)
            if req.request_id in sampled:
                token_id, logprob = sampled[req.request_id]
                req.append_output(token_id, logprob)
                touched.append(req)
                if req.is_finished:
                    self.running.remove(req)
                    self.requests.pop(req.request_id, None)
                    if req.status is RequestStatus.HANDED_OFF:  # held for its pull
                        self.handed_off[req.request_id] = req
                    else:
                        self.kv.free(req)
        return touched

    def _chunk(self, req: Request, start: int, n: int) -> ScheduledChunk:
        rid = req.request_id
        return ScheduledChunk(req, start, n, self.kv.block_table(rid), self.kv.window_table(rid))

    def _report(self, req: Request) -> None:
        if not req.missing_reported:
            req.missing_reported = True
            self.newly_parked.append(req.request_id)

    def _preempt(self, req: Request, out: SchedulerOutput) -> None:
        if req.imported and req.missing:  # no embeddings to recompute its prompt with: swap it
            swap = self._swap_out(req)
            if not self.swap_room(swap):  # its copy would pass the swap budget: it ends (the engine
                out.swap_refused.append(swap)  # fails it, retryable), its blocks freed
                self.requests.pop(req.request_id, None)
                self.kv.free(req)
                req.status = RequestStatus.FINISHED_ERROR
                return
            out.swapped_out.append(swap)
            req.swapped = True
        else:
            req.num_computed_tokens = 0
        self.kv.free(req)
        req.status = RequestStatus.WAITING
        req.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.appendleft(req)

    def _swap_out(self, req: Request) -> SwapOut:
        rid, computed = req.request_id, req.num_computed_tokens
        blocks = self.kv.block_table(rid)[: cdiv(computed, self.kv.block_size)]
        window = self.kv.window_table(rid)
        if window is None:
            return SwapOut(req, blocks, state_slot=req.state.slot if req.state else None)
        first = self.kv.first_window_block(computed)
        return SwapOut(req, blocks, first, window[first : len(blocks)])
