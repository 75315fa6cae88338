"""``/v1/responses``: OpenAI's Responses API on the chat route's machinery, stateless.

The request's ``instructions`` and ``input`` items become chat messages
(router/protocol/response_input.py), normalised, prepared (media, encoder cache, template) and
generated exactly as a chat completion of the same messages; ``text.format`` goes through the
structured-outputs machinery as chat's ``response_format``. The answer is one ``message`` output
item with one ``output_text`` part, ``incomplete`` (``max_output_tokens``) when the length bound ended
it. Admission, deadline, disconnects, errors and metrics are the chat route's.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncGenerator, AsyncIterator
from typing import TYPE_CHECKING

from fastapi import Request
from fastapi.responses import JSONResponse, Response

from llm_service.outputs import RequestOutput
from router.http import tracing
from router.http.auth import effective_cache_salt
from router.http.chat import ChatService, ServedModel
from router.http.lifecycle import cancel_on_disconnect, chain, first_or_error, hand_over
from router.http.replay_log import failure_record, log_failure
from router.http.request_body import read_body
from router.http.response_events import ResponseEvents
from router.http.sse import DONE, SSEResponse
from router.journey.deadline import Deadline
from router.journey.detokenizer import IncrementalDetokenizer
from router.journey.orchestrator import Orchestrator
from router.protocol.errors import APIError, bad_request, from_exception
from router.protocol.messages import NormalizedChat, normalize_messages
from router.protocol.response_input import chat_messages
from router.protocol.responses import (
    IncompleteDetails,
    InputTokensDetails,
    OutputMessage,
    OutputTextPart,
    ResponseObject,
    ResponsesRequest,
    ResponseUsage,
    message_id,
    response_id,
)
from router.protocol.sampling import fit_to_prompt, request_sampling_params
from router.routing.admission import BodyLease

if TYPE_CHECKING:
    from router.http.metrics import RequestMetrics

logger = logging.getLogger("mmserve.ingress")
Stream = AsyncGenerator[RequestOutput, None]


class ResponsesService:
    """``/v1/responses`` over a ``ChatService``'s models, limits, admission and metrics."""

    def __init__(self, chat: ChatService) -> None:
        self.chat = chat

    async def respond(self, request: Request, tenant: str | None = None) -> Response:
        start = time.monotonic()
        chat = self.chat
        deadline = Deadline(chat.request_timeout_s)
        lease = BodyLease()  # the body's bytes in the admission's budget: the ticket takes it over
        try:
            req = await deadline.run(
                read_body(
                    request,
                    ResponsesRequest,
                    chat.max_request_bytes,
                    chat.max_json_values,
                    lambda n: chat.admission.reserve_body(lease, n),
                )
            )
            model, normalized = self._validated(req, tenant)
            cost = chat.admission.cost((m.modality for m in normalized.media), normalized.text_chars)
            ticket = chat.admission.admit(cost, body=lease)
        except BaseException:  # refused, bad input, or the client left while sending
            chat.admission.release_body(lease)
            raise
        request_id = response_id()
        orch = model.orchestrator
        span, traced = tracing.start_request_span(request.headers, request_id, model.name)
        watcher = asyncio.ensure_future(cancel_on_disconnect(request, asyncio.current_task()))
        response: Response | None = None
        error: BaseException | None = None
        try:
            salt = effective_cache_salt(tenant, req.cache_salt)
            response = await deadline.run(
                self._answer(req, model, request_id, normalized, start, deadline, salt)
            )
            return response
        except Exception as e:
            error = e
            _log_failure(orch, request_id, normalized, e)
            orch.forget(request_id)
            raise
        except BaseException:  # the client left: nothing failed on our side
            orch.forget(request_id)
            raise
        finally:  # a streamed response watches for the disconnect itself from here on
            watcher.cancel()
            hand_over(response, chat.admission, ticket, (span, traced), error)

    def _validated(self, req: ResponsesRequest, tenant: str | None) -> tuple[ServedModel, NormalizedChat]:
        """Every 400 a request can earn before anything runs, and the chat it maps onto."""
        if (refused := req.refusal()) is not None:
            param, why = refused
            raise bad_request(why, code="unsupported_argument", param=param)
        if req.tools:
            raise bad_request(
                "function tools are not supported yet", code="unsupported_argument", param="tools"
            )
        model = self.chat.model_for(req.model)
        messages, paths = chat_messages(req)
        normalized = normalize_messages(messages, model.limits, tenant, field="input", paths=paths)
        unsupported = {m.modality for m in normalized.media} - set(model.modalities)
        if unsupported:
            raise bad_request(
                f"model {model.name!r} does not accept {', '.join(sorted(unsupported))} input",
                code="unsupported_modality",
                param="input",
            )
        request_sampling_params(req)  # the sampling fields' and text.format's 400s, before admission
        return model, normalized

    async def _answer(
        self,
        req: ResponsesRequest,
        model: ServedModel,
        request_id: str,
        normalized: NormalizedChat,
        start: float,
        deadline: Deadline,
        salt: str | None,
    ) -> Response:
        orch = model.orchestrator
        base = request_sampling_params(req)
        timed = self._timed(model)
        prepared = await orch.prepare(request_id, normalized)
        params = fit_to_prompt(
            base,
            req.max_output_tokens,
            len(prepared.prompt_token_ids),
            model.max_model_len,
            "input",
            "max_output_tokens",
        )
        stream = deadline.stream(orch.stream(request_id, prepared, params, salt))
        detok = IncrementalDetokenizer(orch.decode, stop=req.stop_strings)
        first = await first_or_error(stream)
        first_at = time.monotonic()
        if timed is not None:
            timed.ttft.observe(first_at - start)
        shell = _shell(req, model, request_id)
        item = OutputMessage(id=message_id(), status="in_progress", content=[OutputTextPart(text="")])
        if req.stream:
            body = self._sse(model, shell, item, first, stream, detok, (start, first_at), normalized)
            return SSEResponse(body, media_type="text/event-stream")
        text: list[str] = []
        tokens, last = 0, first
        try:
            async for out in chain(first, stream):
                last, tokens = out, tokens + len(out.new_token_ids)
                text.append(detok.add(out.new_token_ids, final=out.finished))
                if detok.stopped:
                    break
        finally:  # a stop string ends it early: the LLM stops now
            await stream.aclose()
        await orch.settle(request_id)
        orch.forget(request_id)
        self._observe_done(model, (start, first_at), tokens)
        done = _finished(shell, item, "".join(text), _length_cut(detok, last), last, tokens)
        return JSONResponse(done.model_dump())

    async def _sse(
        self,
        model: ServedModel,
        shell: ResponseObject,
        item: OutputMessage,
        first: RequestOutput,
        stream: Stream,
        detok: IncrementalDetokenizer,
        times: tuple[float, float],
        normalized: NormalizedChat,
    ) -> AsyncIterator[str]:
        orch = model.orchestrator
        events = ResponseEvents()
        head = events.head(shell, item)  # goes out with the first text: one write
        text: list[str] = []
        tokens, last = 0, first
        try:
            async for out in chain(first, stream):
                last, tokens = out, tokens + len(out.new_token_ids)
                piece = detok.add(out.new_token_ids, final=out.finished)
                if piece:
                    text.append(piece)
                    yield head + events.delta(item, piece)
                    head = ""
                if detok.stopped or out.finished:
                    break
            await orch.settle(shell.id)
            self._observe_done(model, times, tokens)
            done = _finished(shell, item, "".join(text), _length_cut(detok, last), last, tokens)
            end = head + events.tail(done)
        except Exception as e:  # after the 200 went out, errors travel in-band
            api = from_exception(e) or APIError(500, "internal error while generating", code="internal_error")
            _log_failure(orch, shell.id, normalized, e)
            end = head + events.failed(shell, api)
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
    )


def _length_cut(detok: IncrementalDetokenizer, last: RequestOutput) -> bool:
    return not detok.stopped and last.finish_reason == "length"


def _finished(
    shell: ResponseObject, item: OutputMessage, text: str, cut: bool, last: RequestOutput, tokens: int
) -> ResponseObject:
    status = "incomplete" if cut else "completed"
    message = item.model_copy(update={"status": status, "content": [OutputTextPart(text=text)]})
    usage = ResponseUsage(
        input_tokens=last.num_prompt_tokens,
        input_tokens_details=InputTokensDetails(cached_tokens=last.num_cached_tokens),
        output_tokens=tokens,
        total_tokens=last.num_prompt_tokens + tokens,
    )
    return shell.model_copy(
        update={
            "status": status,
            "incomplete_details": IncompleteDetails(reason="max_output_tokens") if cut else None,
            "output": [message],
            "usage": usage,
        }
    )


def _log_failure(orch: Orchestrator, request_id: str, normalized: NormalizedChat, e: BaseException) -> None:
    api = from_exception(e) or APIError(500, "internal error", code="internal_error")
    record = failure_record(
        request_id, api.status_code, api.code, e, normalized.media, orch.replay(request_id)
    )
    log_failure(logger, record, e)
