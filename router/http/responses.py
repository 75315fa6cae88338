"""``/v1/responses``: OpenAI's Responses API on the chat route's machinery, stateless.

The request's ``instructions`` and ``input`` items become chat messages
(router/protocol/response_input.py), normalised, prepared (media, encoder cache, template) and
generated exactly as a chat completion of the same messages; ``text.format`` goes through the
structured-outputs machinery as chat's ``response_format``. The answer is one ``message`` output
item with one ``output_text`` part, ``incomplete`` (``max_output_tokens``) when the length bound ended
it. Admission, deadline, disconnects, errors and metrics are the chat route's.
"""

from __future__ import annotations

import logging
import time
from collections.abc import AsyncGenerator, AsyncIterator
from dataclasses import dataclass
from typing import TYPE_CHECKING

from fastapi import Request
from fastapi.responses import JSONResponse, Response

from llm_service.outputs import RequestOutput
from llm_service.sampling_params import SamplingParams
from llm_service.tools.calls import ContentDelta, ToolEvent
from llm_service.tools.formats import ToolFormat
from llm_service.tools.reasoning import Lane, ReasoningDelta
from router.http.auth import effective_cache_salt
from router.http.chat import ChatService, ServedModel
from router.http.lifecycle import answer_admitted, chain, first_or_error, read_and_admit
from router.http.reasoning_answer import Thinking
from router.http.replay_log import failure_record, log_failure
from router.http.response_events import OutputItems
from router.http.sse import DONE, SSEResponse
from router.http.tool_answer import answer_decoder
from router.journey.deadline import Deadline
from router.journey.detokenizer import IncrementalDetokenizer
from router.journey.orchestrator import Orchestrator
from router.protocol.errors import APIError, bad_request, from_exception
from router.protocol.messages import NormalizedChat, normalize_messages
from router.protocol.response_input import chat_messages, in_responses_terms
from router.protocol.response_object import (
    IncompleteDetails,
    InputTokensDetails,
    OutputTokensDetails,
    ResponseObject,
    ResponseUsage,
    response_id,
)
from router.protocol.responses import ResponsesRequest
from router.protocol.sampling import fit_to_prompt, request_sampling_params
from router.protocol.tool_choice import answer_format, with_tool_choice
from router.protocol.tool_use import template_tools

if TYPE_CHECKING:
    from router.http.metrics import RequestMetrics

logger = logging.getLogger("mmserve.ingress")
Stream = AsyncGenerator[RequestOutput, None]


@dataclass(frozen=True)
class Asked:
    """A checked request in chat's terms: its model, its chat, its sampling parameters (before
    ``max_tokens`` is fitted to the prompt), and the format its answer's tool calls are parsed in."""

    model: ServedModel
    chat: NormalizedChat
    params: SamplingParams
    tool_format: ToolFormat | None
    thinking: Thinking | None = None  # the model's reasoning parser, if on


class TextOut:
    """The answer's text as it is generated, as tool-parser events (content alone without tools),
    its reasoning first as ``ReasoningDelta``s with a reasoning parser on."""

    def __init__(
        self, detok: IncrementalDetokenizer, tool_format: ToolFormat | None, thinking: Thinking | None = None
    ) -> None:
        self.detok = detok
        self.parser = tool_format.stream() if tool_format is not None else None
        self.reasoning = thinking.stream() if thinking is not None else None
        self.tokens = 0
        self.reasoning_tokens = 0  # the tokens generated inside the reasoning (its end marker not counted)
        self.last: RequestOutput | None = None

    @property
    def done(self) -> bool:
        return self.detok.stopped or (self.last is not None and self.last.finished)

    def add(self, out: RequestOutput) -> list[ToolEvent | ReasoningDelta]:
        self.last, self.tokens = out, self.tokens + len(out.new_token_ids)
        piece = self.detok.add(out.new_token_ids, final=out.finished)
        thought: list[ToolEvent | ReasoningDelta] = []
        if self.reasoning is not None:
            parts = self.reasoning.feed(piece) + (self.reasoning.finish() if self.done else [])
            thought = [ReasoningDelta(t) for lane, t in parts if lane is Lane.REASONING]
            if thought or self.reasoning.in_reasoning:
                self.reasoning_tokens += len(out.new_token_ids)
            piece = "".join(t for lane, t in parts if lane is Lane.CONTENT)
        if self.parser is None:
            return [*thought, ContentDelta(piece)]
        return thought + self.parser.feed(piece) + (self.parser.finish() if self.done else [])


class ResponsesService:
    """``/v1/responses`` over a ``ChatService``'s models, limits, admission and metrics."""

    def __init__(self, chat: ChatService) -> None:
        self.chat = chat

    async def respond(self, request: Request, tenant: str | None = None) -> Response:
        start = time.monotonic()
        chat = self.chat
        deadline = Deadline(chat.request_timeout_s)

        def ask(req: ResponsesRequest) -> tuple[Asked, int]:
            asked = self._validated(req, tenant)
            media = asked.chat.media
            return asked, chat.admission.cost((m.modality for m in media), asked.chat.text_chars)

        req, asked, ticket = await read_and_admit(
            request, ResponsesRequest, chat.body_limits, chat.admission, deadline, ask
        )
        request_id = response_id()
        orch = asked.model.orchestrator

        async def answer() -> Response:
            salt = effective_cache_salt(tenant, req.cache_salt)
            return await deadline.run(self._answer(req, asked, request_id, start, deadline, salt))

        def failed(e: Exception) -> None:
            _log_failure(orch, request_id, asked.chat, e)
            orch.forget(request_id)

        return await answer_admitted(
            request,
            chat.admission,
            ticket,
            (request_id, asked.model.name),
            answer,
            failed,
            lambda: orch.forget(request_id),
        )

    def _validated(self, req: ResponsesRequest, tenant: str | None) -> Asked:
        """Every 400 a request can earn before anything runs, and what it asks in chat's terms."""
        if (refused := req.refusal()) is not None:
            param, why = refused
            raise bad_request(why, code="unsupported_argument", param=param)
        model = self.chat.model_for(req.model)
        try:
            return self._in_chat_terms(req, model, tenant)
        except APIError as e:  # chat's checks name chat's fields: named here as this request has them
            raise in_responses_terms(e) from None

    def _in_chat_terms(self, req: ResponsesRequest, model: ServedModel, tenant: str | None) -> Asked:
        ask = req.tool_ask()
        tools = template_tools(ask.tools, ask.tool_choice)
        if tools and not model.orchestrator.template_takes_tools:
            raise bad_request(
                f"model {model.name!r} has a chat template without tool support; send no tools",
                code="tools_unsupported",
                param="tools",
            )
        messages, paths = chat_messages(req)
        chat = normalize_messages(
            messages,
            model.limits,
            tenant,
            tools,
            field="input",
            paths=paths,
            tool_media=model.orchestrator.tool_result_modalities,
        )
        unsupported = {m.modality for m in chat.media} - set(model.modalities)
        if unsupported:
            raise bad_request(
                f"model {model.name!r} does not accept {', '.join(sorted(unsupported))} input",
                code="unsupported_modality",
                param="input",
            )
        # the sampling fields', text.format's and tool_choice's 400s, before admission
        params = with_tool_choice(request_sampling_params(req), ask, model.tool_format)
        thinking = Thinking.of(model.reasoning_format, chat.template_kwargs)
        if thinking is not None:
            thinking.check_grammar(params)
        return Asked(model, chat, params, answer_format(ask, model.tool_format), thinking)

    async def _answer(
        self,
        req: ResponsesRequest,
        asked: Asked,
        request_id: str,
        start: float,
        deadline: Deadline,
        salt: str | None,
    ) -> Response:
        model, orch = asked.model, asked.model.orchestrator
        timed = self._timed(model)
        prepared = await orch.prepare(request_id, asked.chat)
        prompt_len = len(prepared.prompt_token_ids)
        params = fit_to_prompt(
            asked.params, req.max_output_tokens, prompt_len, model.max_model_len, "input", "max_output_tokens"
        )
        stream = deadline.stream(orch.stream(request_id, prepared, params, salt))
        # with tools, the format's markers survive decoding where they are special tokens (Gemma 4)
        thinking = asked.thinking
        decode = answer_decoder(orch, asked.tool_format, thinking.fmt.markers if thinking else ())
        text = TextOut(IncrementalDetokenizer(decode, stop=req.stop_strings), asked.tool_format, thinking)
        first = await first_or_error(stream)
        first_at = time.monotonic()
        if timed is not None:
            timed.ttft.observe(first_at - start)
        shell = _shell(req, model, request_id)
        if req.stream:
            body = self._sse(asked, shell, first, stream, text, (start, first_at))
            return SSEResponse(body, media_type="text/event-stream")
        items = OutputItems(render=False)
        try:
            async for out in chain(first, stream):
                items.feed(text.add(out))
                if text.done:
                    break
        finally:  # a stop string ends it early: the LLM stops now
            await stream.aclose()
        await orch.settle(request_id)
        orch.forget(request_id)
        self._observe_done(model, (start, first_at), text.tokens)
        final, _ = items.finished(_ended(shell, text))
        return JSONResponse(final.model_dump())

    async def _sse(
        self,
        asked: Asked,
        shell: ResponseObject,
        first: RequestOutput,
        stream: Stream,
        text: TextOut,
        times: tuple[float, float],
    ) -> AsyncIterator[str]:
        orch = asked.model.orchestrator
        items = OutputItems()
        head = items.started(shell)  # goes out with the first text: one write
        try:
            async for out in chain(first, stream):
                events = items.feed(text.add(out))
                if text.done:
                    head += events
                    break
                if events:
                    yield head + events
                    head = ""
            await orch.settle(shell.id)
            self._observe_done(asked.model, times, text.tokens)
            end = head + items.finished(_ended(shell, text))[1]
        except Exception as e:  # after the 200 went out, errors travel in-band
            api = from_exception(e) or APIError(500, "internal error while generating", code="internal_error")
            _log_failure(orch, shell.id, asked.chat, e)
            end = head + items.failed(shell, api)
        finally:
            orch.forget(shell.id)
            await stream.aclose()
        yield end + DONE

    def _timed(self, model: ServedModel) -> RequestMetrics | None:
        return self.chat.metrics.model(model.name) if self.chat.metrics is not None else None

    def _observe_done(self, model: ServedModel, times: tuple[float, float], output_tokens: int) -> None:
        if (timed := self._timed(model)) is not None:
            timed.done(*times, time.monotonic(), output_tokens)


def _shell(req: ResponsesRequest, model: ServedModel, request_id: str) -> ResponseObject:
    """The response as it starts: the request's echoed settings, no output yet."""
    return ResponseObject(
        id=request_id,
        status="in_progress",
        model=model.name,
        instructions=req.instructions,
        max_output_tokens=req.max_output_tokens,
        temperature=req.temperature,
        top_p=req.top_p,
        text=req.text.model_dump(by_alias=True, exclude_none=True)
        if req.text
        else {"format": {"type": "text"}},
        metadata=req.metadata or {},
        user=req.user,
        parallel_tool_calls=req.parallel_tool_calls is not False,
        tools=req.tools or [],
        tool_choice=req.tool_choice or "auto",
    )


def _ended(shell: ResponseObject, text: TextOut) -> ResponseObject:
    """The response once generating ended: incomplete when the length bound cut it, with usage."""
    cut = not text.detok.stopped and text.last is not None and text.last.finish_reason == "length"
    last = text.last
    assert last is not None, "a response ends after at least one output"
    usage = ResponseUsage(
        input_tokens=last.num_prompt_tokens,
        input_tokens_details=InputTokensDetails(cached_tokens=last.num_cached_tokens),
        output_tokens=text.tokens,
        output_tokens_details=OutputTokensDetails(reasoning_tokens=text.reasoning_tokens),
        total_tokens=last.num_prompt_tokens + text.tokens,
    )
    return shell.model_copy(
        update={
            "status": "incomplete" if cut else "completed",
            "incomplete_details": IncompleteDetails(reason="max_output_tokens") if cut else None,
            "usage": usage,
        }
    )


def _log_failure(orch: Orchestrator, request_id: str, normalized: NormalizedChat, e: BaseException) -> None:
    api = from_exception(e) or APIError(500, "internal error", code="internal_error")
    record = failure_record(
        request_id, api.status_code, api.code, e, normalized.media, orch.replay(request_id)
    )
    log_failure(logger, record, e)
