"""``EngineLoop``: drives one engine on a worker thread, for async callers on the replica's loop.

The engine is not thread-safe, so every engine call happens on one worker thread: callers only
enqueue adds and aborts; the loop applies them between steps, runs ``step()``, and hands each
step's outputs to ``on_outputs`` (all of them at once: the output channels and metrics) and to the
per-request queues of ``stream()`` callers. Errors of one request (a rejected add) go to that
request only: its queue, or ``on_error`` for requests submitted without one.
"""

from __future__ import annotations

import asyncio
import logging
import threading
from collections.abc import AsyncIterator, Callable, Sequence
from dataclasses import dataclass
from typing import Protocol

from llm_service.multimodal import MultiModalInput
from llm_service.outputs import EngineStats, RequestOutput
from llm_service.sampling_params import SamplingParams
from llm_service.scheduler import WaitingBound
from mmcore.step_clock import StepClock

logger = logging.getLogger("mmserve.llm")

# request id, prompt, params, media, cache salt, handed off after its first token (a prefill replica's)
_Add = tuple[str, list[int], SamplingParams, list[MultiModalInput], str | None, bool]


@dataclass(frozen=True)
class _Supply:
    request_id: str
    mm_inputs: list[MultiModalInput]


@dataclass(frozen=True)
class _Call:
    """Any engine call made between steps on the engine's thread (``on_engine``); its answer or error
    goes to ``future`` on the caller's loop."""

    fn: Callable[..., object]
    args: tuple[object, ...]
    future: asyncio.Future[object]
    loop: asyncio.AbstractEventLoop


class SteppedEngine(Protocol):
    """What the loop drives: ``LLMEngine`` (tests drive fakes). Its ``take_parked`` and ``scheduler``,
    where it has them, are read too (``_step_once``)."""

    def add_request(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        sampling_params: SamplingParams,
        mm_inputs: Sequence[MultiModalInput] = (),
        cache_salt: str | None = None,
    ) -> None: ...

    def supply_embeddings(self, request_id: str, mm_inputs: Sequence[MultiModalInput]) -> None: ...

    def abort(self, request_id: str) -> None: ...

    def has_unfinished_requests(self) -> bool: ...

    def step(self) -> list[RequestOutput]: ...

    def stats(self) -> EngineStats: ...


OnOutputs = Callable[[list[RequestOutput]], None]
OnError = Callable[[str, BaseException], None]


class EngineLoop:
    """Drives an engine on one thread; async callers submit requests or stream them one by one."""

    def __init__(
        self,
        engine: SteppedEngine,
        on_outputs: OnOutputs | None = None,
        on_error: OnError | None = None,
        waiting_bound: WaitingBound | None = None,
        on_parked: Callable[[list[str]], None] | None = None,
    ) -> None:
        self.engine = engine
        # Requests the engine set aside for want of embeddings (LLMEngine.take_parked): the owner
        # fetches them and calls ``supply``.
        self._on_parked = on_parked or self._no_supplier
        self.waiting_bound = waiting_bound or WaitingBound()
        # Requests (and prompt tokens) not yet running: queued adds plus the scheduler's waiting
        # queue as of the last step. Written under the lock; read by ``check_capacity``.
        self._waiting = (0, 0)
        self.queued_prompt_tokens = 0  # waiting and partly prefilled prompts' tokens still to compute
        self._pending_adds = (0, 0)
        self._on_outputs = on_outputs or (lambda outs: None)  # every step's outputs, listened to or not
        self._on_error = on_error or (lambda rid, e: None)
        self._lock = threading.Lock()
        # Adds and aborts (a bare request id) in arrival order: a stream cancelled before the loop
        # picked up its add must be added, then aborted, never the other way round.
        self._pending: list[_Add | _Supply | _Call | str] = []
        self._queues: dict[str, asyncio.Queue[RequestOutput | BaseException]] = {}
        self._live: set[str] = set()  # submitted and not yet finished or aborted
        self._wakeup: asyncio.Event | None = None
        self._task: asyncio.Task[None] | None = None
        self.last_stats: EngineStats | None = None
        self.last_step_s: float | None = None  # the engine step behind the outputs last handed out
        self.step_clock = StepClock()  # every step's wall and CPU time (mmcore/step_clock.py)

    def check_capacity(self, num_prompt_tokens: int) -> None:
        """Raise ``WaitingQueueFull`` now if a request of this size would overflow the waiting bound."""
        with self._lock:
            n = self._waiting[0] + self._pending_adds[0]
            tokens = self._waiting[1] + self._pending_adds[1]
        self.waiting_bound.check(n, tokens, num_prompt_tokens)

    @property
    def task(self) -> asyncio.Task[None] | None:
        return self._task

    def _ensure_started(self) -> None:
        if self._task is None or self._task.done():
            self._wakeup = asyncio.Event()
            self._task = asyncio.get_running_loop().create_task(self._run())

    def submit(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        params: SamplingParams,
        mm_inputs: list[MultiModalInput],
        cache_salt: str | None = None,
        handoff: bool = False,
    ) -> None:
        """Queue a request; its outputs reach ``on_outputs``, a rejection ``on_error``. ``handoff``: it
        ends with its first token, its KV held for a decode replica (``LLMEngine.add_request``)."""
        self._ensure_started()
        assert self._wakeup is not None
        if request_id in self._live:
            raise ValueError(f"duplicate request id {request_id!r}")
        self._live.add(request_id)
        with self._lock:
            self._pending.append((request_id, prompt_token_ids, params, mm_inputs, cache_salt, handoff))
            n, tokens = self._pending_adds
            self._pending_adds = (n + 1, tokens + len(prompt_token_ids))
        self._wakeup.set()

    async def stream(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        params: SamplingParams,
        mm_inputs: list[MultiModalInput],
        cache_salt: str | None = None,
        handoff: bool = False,
    ) -> AsyncIterator[RequestOutput]:
        """Submit and yield this request's outputs; leaving early aborts it."""
        queue: asyncio.Queue[RequestOutput | BaseException] = asyncio.Queue()
        if request_id in self._queues:
            raise ValueError(f"duplicate request id {request_id!r}")
        self._queues[request_id] = queue
        finished = False
        try:
            self.submit(request_id, prompt_token_ids, params, mm_inputs, cache_salt, handoff)
            while True:
                item = await queue.get()
                if isinstance(item, BaseException):
                    finished = True
                    raise item
                yield item
                if item.finished:
                    finished = True
                    return
        finally:
            self._queues.pop(request_id, None)
            if not finished:  # the caller went away (disconnect, cancellation): free its KV blocks
                self.abort(request_id)

    def _no_supplier(self, request_ids: list[str]) -> None:
        """Nobody fetches for this loop: a parked request would wait forever, so it fails."""
        for rid in request_ids:
            self._error(rid, RuntimeError(f"request {rid} needs embeddings it was sent without"))
            with self._lock:
                self._pending.append(rid)

    def supply(self, request_id: str, mm_inputs: list[MultiModalInput]) -> None:
        """Embeddings for a request the engine parked (or was given without them); between steps."""
        if request_id not in self._live:
            return
        with self._lock:
            self._pending.append(_Supply(request_id, mm_inputs))
        if self._wakeup is not None:
            self._wakeup.set()

    async def on_engine(self, fn: Callable[..., object], *args: object) -> object:
        """``fn(*args)`` on the engine's thread between steps (the engine is not thread-safe); its answer,
        or what it raised. Not cancelled half-way: once queued it runs, whatever its caller does."""
        self._ensure_started()
        assert self._wakeup is not None
        loop = asyncio.get_running_loop()
        future: asyncio.Future[object] = loop.create_future()
        with self._lock:
            self._pending.append(_Call(fn, args, future, loop))
        self._wakeup.set()
        return await asyncio.shield(future)

    def track(self, request_id: str) -> None:
        """A request put in the engine by ``on_engine`` (an import): its outputs and aborts as a submit's."""
        self._live.add(request_id)

    def holds(self, request_id: str) -> bool:
        """Whether ``request_id`` was submitted (or imported) here and has not finished or been aborted."""
        return request_id in self._live

    def abort(self, request_id: str) -> None:
        if request_id not in self._live:
            return
        self._live.discard(request_id)
        with self._lock:
            self._pending.append(request_id)
        if self._wakeup is not None:
            self._wakeup.set()

    def _step_once(self) -> tuple[list[RequestOutput], list[tuple[str, BaseException]], list[str]]:
        """Runs on the worker thread: apply queued adds/supplies/aborts, then one engine step."""
        with self._lock:
            pending, self._pending = self._pending, []
            self._pending_adds = (0, 0)
        errors: list[tuple[str, BaseException]] = []
        for op in pending:
            if isinstance(op, str):
                self.engine.abort(op)
                continue
            if isinstance(op, _Call):
                _answer(op)
                continue
            if isinstance(op, _Supply):
                try:
                    self.engine.supply_embeddings(op.request_id, op.mm_inputs)
                except Exception as e:
                    self.engine.abort(op.request_id)
                    errors.append((op.request_id, e))
                continue
            rid, ids, params, mm, salt, handoff = op
            try:
                if handoff:  # (only then: engines under test take no such argument)
                    self.engine.add_request(rid, ids, params, mm, cache_salt=salt, handoff=True)  # type: ignore[call-arg]
                else:
                    self.engine.add_request(rid, ids, params, mm, cache_salt=salt)
            except Exception as e:  # RequestRejected and friends go back to that caller only
                errors.append((rid, e))
        if self.engine.has_unfinished_requests():
            outputs = self.step_clock.run(self.engine.step)
            self.last_step_s = self.step_clock.last_wall_s
        else:
            outputs, self.last_step_s = [], None
        take_parked = getattr(self.engine, "take_parked", None)
        parked = take_parked() if take_parked is not None else []
        if (take_failed := getattr(self.engine, "take_failed", None)) is not None:
            errors += take_failed()  # ended by the engine with a coded error (a swap past its budget)
        self.last_stats = self.engine.stats()
        scheduler = getattr(self.engine, "scheduler", None)
        waiting = [*getattr(scheduler, "waiting", ()), *getattr(scheduler, "parked", {}).values()]
        prefilling = [
            r for r in getattr(scheduler, "running", ()) if r.num_computed_tokens < r.num_prompt_tokens
        ]
        with self._lock:
            self._waiting = (len(waiting), sum(r.num_tokens - r.num_computed_tokens for r in waiting))
            self.queued_prompt_tokens = self._waiting[1] + sum(
                r.num_prompt_tokens - r.num_computed_tokens for r in prefilling
            )
        return outputs, errors, parked

    def _has_pending(self) -> bool:
        with self._lock:
            return bool(self._pending)

    async def _run(self) -> None:
        try:
            await self._loop_forever()
        except BaseException as e:  # the loop is gone: no request may wait on it forever
            if not isinstance(e, asyncio.CancelledError):
                logger.exception("engine loop died")
            err = e if isinstance(e, Exception) else RuntimeError("engine loop stopped")
            for rid in list(self._live):
                self._error(rid, err)
            raise

    def _error(self, rid: str, err: BaseException) -> None:
        self._live.discard(rid)
        if (q := self._queues.get(rid)) is not None:
            q.put_nowait(err)
        else:
            self._on_error(rid, err)

    async def _loop_forever(self) -> None:
        assert self._wakeup is not None
        while True:
            if not self.engine.has_unfinished_requests() and not self._has_pending():
                await self._wakeup.wait()
                self._wakeup.clear()
                continue
            try:
                outputs, errors, parked = await asyncio.to_thread(self._step_once)
            except Exception as e:  # an engine bug: fail every request rather than hang them
                logger.exception("engine step failed")
                for rid in list(self._live):
                    self._error(rid, e)
                    with self._lock:
                        self._pending.append(rid)
                continue
            for rid, err in errors:
                self._error(rid, err)
            if parked:
                try:
                    self._on_parked(parked)
                except Exception:
                    logger.exception("on_parked callback failed")
            for out in outputs:
                if out.finished:
                    self._live.discard(out.request_id)
            try:
                self._on_outputs(outputs)
            except Exception:  # metrics must never stop the loop that every stream waits on
                logger.exception("on_outputs callback failed")
            for out in outputs:
                if (oq := self._queues.get(out.request_id)) is not None:
                    oq.put_nowait(out)


def _answer(call: _Call) -> None:
    """Run an ``on_engine`` call on the engine's thread; hand its answer to the caller's loop."""

    def settle(ok: bool, value: object) -> None:
        if call.future.done():
            return
        if ok:
            call.future.set_result(value)
        else:
            assert isinstance(value, BaseException)
            call.future.set_exception(value)

    try:
        result = call.fn(*call.args)
    except Exception as e:
        call.loop.call_soon_threadsafe(settle, False, e)
    else:
        call.loop.call_soon_threadsafe(settle, True, result)
