"""``/v1/completions``: OpenAI's legacy text completions over the chat route's machinery.

Each prompt of the request (router/protocol/completions.py) is tokenized here, with no chat
template, and becomes its own engine request; ``n`` > 1 answers each prompt as chat does
(router/http/choices.py: the first choice alone until its first token, then the others on its
cached blocks). Choices come in prompt order, ``index = prompt_index * n + i``. ``echo`` puts the
prompt's text first; with ``logprobs`` the engine also scores the prompt (``prompt_logprobs``).
Admission, deadline, disconnects, errors and metrics are the chat route's.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncGenerator, AsyncIterator, Awaitable, Callable, Sequence
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING

from fastapi import Request
from fastapi.responses import JSONResponse, Response

from llm_service.outputs import RequestOutput
from llm_service.sampling_params import SamplingParams
from router.http.auth import effective_cache_salt
from router.http.chat import ChatService, ServedModel
from router.http.choices import (
    ChoiceState,
    child_ids,
    child_params,
    close_all,
    collect,
    first_outputs,
    stream_events,
)
from router.http.completion_events import CompletionEvents, Echo, completion_logprobs, entries, entry, joined
from router.http.lifecycle import answer_admitted, first_or_error, read_and_admit
from router.http.replay_log import failure_record, log_failure
from router.http.sse import DONE, SSEResponse
from router.journey.deadline import Deadline
from router.journey.detokenizer import IncrementalDetokenizer
from router.journey.orchestrator import Orchestrator, Prepared
from router.protocol.chat_output import ChoiceLogprobs, PromptTokensDetails, Usage
from router.protocol.completions import (
    CompletionChoice,
    CompletionChunk,
    CompletionRequest,
    CompletionResponse,
    completion_id,
)
from router.protocol.errors import APIError, bad_request, from_exception
from router.protocol.sampling import fit_to_prompt, request_sampling_params

if TYPE_CHECKING:
    from router.http.metrics import RequestMetrics

logger = logging.getLogger("mmserve.ingress")

DEFAULT_MAX_TOKENS = 16  # OpenAI's and vLLM's for completions (chat's is the context's room)
Stream = AsyncGenerator[RequestOutput, None]


@dataclass
class PromptRun:
    """One prompt's choices, started: engine request ids, first outputs and the streams after them."""

    ids: list[str]
    firsts: list[RequestOutput]
    streams: list[Stream]
    echo: Echo


class CompletionService:
    """``/v1/completions`` over a ``ChatService``'s models, limits, admission and metrics."""

    def __init__(self, chat: ChatService) -> None:
        self.chat = chat

    async def complete(self, request: Request, tenant: str | None = None) -> Response:
        start = time.monotonic()
        chat = self.chat
        deadline = Deadline(chat.request_timeout_s)

        def ask(req: CompletionRequest) -> tuple[ServedModel, int]:
            if req.suffix is not None:
                raise bad_request(
                    "suffix is not supported (no fill-in-the-middle on this server)",
                    code="unsupported_argument",
                    param="suffix",
                )
            model = chat.model_for(req.model)
            cost = sum(chat.admission.cost((), len(p) if isinstance(p, str) else 0) for p in req.prompts)
            return model, cost * req.n

        req, model, ticket = await read_and_admit(
            request, CompletionRequest, chat.body_limits, chat.admission, deadline, ask
        )
        request_id = completion_id()

        async def answer() -> Response:
            salt = effective_cache_salt(tenant, req.cache_salt)
            return await deadline.run(self._answer(req, model, request_id, start, deadline, salt))

        return await answer_admitted(
            request,
            chat.admission,
            ticket,
            (request_id, model.name),
            answer,
            lambda e: _log_failure(request_id, e),
        )

    async def _prompt_ids(self, orch: Orchestrator, req: CompletionRequest) -> list[list[int]]:
        ids = []
        for p in req.prompts:
            if isinstance(p, str):
                ids.append(await orch.tokenize_prompt(p))
            else:
                orch.check_prompt_ids(p)
                ids.append(p)
        return ids

    def _params(self, req: CompletionRequest, model: ServedModel, prompt: list[int]) -> SamplingParams:
        base = request_sampling_params(req)
        params = fit_to_prompt(base, req.max_tokens, len(prompt), model.max_model_len, "prompt")
        if req.max_tokens is None:
            params = replace(
                params, max_tokens=min(params.max_tokens, max(DEFAULT_MAX_TOKENS, req.min_tokens))
            )
        if req.echo and req.logprobs is not None:
            params = replace(params, prompt_logprobs=req.logprobs)
        return params

    async def _answer(
        self,
        req: CompletionRequest,
        model: ServedModel,
        request_id: str,
        start: float,
        deadline: Deadline,
        salt: str | None,
    ) -> Response:
        orch = model.orchestrator
        prompts = await self._prompt_ids(orch, req)
        params = [self._params(req, model, p) for p in prompts]  # every 400 before anything runs
        texts = [p if isinstance(p, str) else None for p in req.prompts]  # echoed as given
        many = len(prompts) > 1
        tasks = [
            asyncio.ensure_future(
                self._start(
                    orch,
                    f"{request_id}-p{i}" if many else request_id,
                    prompt,
                    p,
                    req,
                    texts[i],
                    deadline,
                    salt,
                )
            )
            for i, (prompt, p) in enumerate(zip(prompts, params, strict=True))
        ]
        try:
            started = await asyncio.gather(*tasks, return_exceptions=True)
        except BaseException:  # the client left, or the deadline passed: no prompt goes on
            for t in tasks:
                t.cancel()
            await _close(orch, await asyncio.gather(*tasks, return_exceptions=True))
            raise
        failed = [r for r in started if isinstance(r, BaseException)]
        if failed:
            await _close(orch, started)
            raise failed[0]
        runs = [r for r in started if isinstance(r, PromptRun)]
        first_at = time.monotonic()
        if (timed := self._timed(model)) is not None:
            timed.ttft.observe(first_at - start)
        return await self._respond(req, model, request_id, runs, (start, first_at))

    async def _start(
        self,
        orch: Orchestrator,
        rid: str,
        prompt: list[int],
        params: SamplingParams,
        req: CompletionRequest,
        text: str | None,
        deadline: Deadline,
        salt: str | None,
    ) -> PromptRun:
        """One prompt's choices, running: the first alone until its first output, then the others."""
        ids = [rid, *child_ids(rid, req.n)]
        prepared = Prepared(prompt, [])
        first_stream = deadline.stream(orch.stream(rid, prepared, params, salt))
        first = await first_or_error(first_stream)
        rest = [
            # the echo's logprobs come from the first choice: the others read the cached prompt
            deadline.stream(
                orch.stream(cid, prepared, replace(child_params(params, i), prompt_logprobs=None), salt)
            )
            for i, cid in enumerate(ids[1:], start=1)
        ]
        try:
            firsts = [first, *await first_outputs(rest)]
        except BaseException:
            await first_stream.aclose()
            raise
        echo = Echo()
        if req.echo:
            echo = Echo(text if text is not None else orch.decode(prompt))
            if req.logprobs is not None:
                scored = tuple(entry(orch, lp) for lp in first.prompt_logprobs or [])
                echo = replace(echo, first_token=orch.decode(prompt[:1]), scored=scored)
        return PromptRun(ids, firsts, [first_stream, *rest], echo)

    async def _respond(
        self,
        req: CompletionRequest,
        model: ServedModel,
        request_id: str,
        runs: list[PromptRun],
        times: tuple[float, float],
    ) -> Response:
        orch = model.orchestrator
        ids = [rid for r in runs for rid in r.ids]
        firsts = [f for r in runs for f in r.firsts]
        streams = [s for r in runs for s in r.streams]
        states = [
            ChoiceState(i, IncrementalDetokenizer(orch.decode, stop=req.stop_strings))
            for i in range(len(ids))
        ]
        echoes = [r.echo for r in runs for _ in r.ids]

        def lp(out: RequestOutput) -> ChoiceLogprobs | None:
            return entries(orch, out) if req.logprobs is not None else None

        async def settle(i: int) -> None:
            await orch.settle(ids[i])

        if req.stream:
            events = CompletionEvents(request_id, model.name, echoes, req.logprobs is not None)
            body = self._sse(req, model, request_id, runs, states, lp, settle, events, times)
            return SSEResponse(body, media_type="text/event-stream")
        try:
            await collect(states, firsts, streams, lp, settle)
        finally:
            for rid in ids:
                orch.forget(rid)
        choices = []
        for s, echo in zip(states, echoes, strict=True):
            logprobs = None
            if req.logprobs is not None:
                logprobs = completion_logprobs(s.logprobs, len(echo.text))
                if echo.text:
                    logprobs = joined(echo.logprobs(), logprobs)
            text = echo.text + "".join(s.text)
            choices.append(
                CompletionChoice(index=s.index, text=text, logprobs=logprobs, finish_reason=s.finish)
            )
        usage = _usage(runs, states)
        self._observe_done(model, times, usage.completion_tokens)
        resp = CompletionResponse(id=request_id, model=model.name, choices=choices, usage=usage)
        return JSONResponse(resp.model_dump())

    async def _sse(
        self,
        req: CompletionRequest,
        model: ServedModel,
        request_id: str,
        runs: list[PromptRun],
        states: list[ChoiceState],
        lp: Callable[[RequestOutput], ChoiceLogprobs | None],
        settle: Callable[[int], Awaitable[None]],
        events: CompletionEvents,
        times: tuple[float, float],
    ) -> AsyncIterator[str]:
        failed: list[BaseException] = []

        def on_error(e: BaseException) -> None:
            failed.append(e)
            _log_failure(request_id, e)

        firsts = [f for r in runs for f in r.firsts]
        streams = [s for r in runs for s in r.streams]
        tail = ""
        try:
            async for event in stream_events(
                request_id, model.name, states, firsts, streams, lp, settle, on_error, events
            ):
                yield event
            usage = _usage(runs, states)
            if not failed and req.stream_options is not None and req.stream_options.include_usage:
                chunk = CompletionChunk(id=request_id, model=model.name, choices=[], usage=usage)
                tail = f"data: {chunk.model_dump_json()}\n\n"
            if not failed:
                self._observe_done(model, times, usage.completion_tokens)
        finally:
            for r in runs:
                for rid in r.ids:
                    model.orchestrator.forget(rid)
        yield tail + DONE

    def _timed(self, model: ServedModel) -> RequestMetrics | None:
        return self.chat.metrics.model(model.name) if self.chat.metrics is not None else None

    def _observe_done(self, model: ServedModel, times: tuple[float, float], completion_tokens: int) -> None:
        if (timed := self._timed(model)) is not None:
            timed.done(*times, time.monotonic(), completion_tokens)


def _usage(runs: list[PromptRun], states: list[ChoiceState]) -> Usage:
    """Each prompt counted once (its first choice's numbers), every choice's completion tokens."""
    prompt = sum(r.firsts[0].num_prompt_tokens for r in runs)
    cached = sum(r.firsts[0].num_cached_tokens for r in runs)
    completion = sum(s.completion_tokens for s in states)
    return Usage(
        prompt_tokens=prompt,
        completion_tokens=completion,
        total_tokens=prompt + completion,
        prompt_tokens_details=PromptTokensDetails(cached_tokens=cached),
    )


async def _close(orch: Orchestrator, started: Sequence[PromptRun | BaseException]) -> None:
    """Stop the prompts that did start (their requests aborted on their replicas)."""
    for run in started:
        if isinstance(run, PromptRun):
            await close_all(run.streams)
            for rid in run.ids:
                orch.forget(rid)


def _log_failure(request_id: str, e: BaseException) -> None:
    api = from_exception(e) or APIError(500, "internal error", code="internal_error")
    log_failure(logger, failure_record(request_id, api.status_code, api.code, e, [], None), e)
