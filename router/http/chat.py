"""The HTTP ingress: OpenAI-compatible routes on FastAPI, served by a Ray Serve deployment."""

from __future__ import annotations

import contextlib
import json
import logging
import time
import uuid
from collections.abc import AsyncGenerator, AsyncIterator
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from fastapi import Request
from fastapi.responses import JSONResponse, Response

from llm_service.outputs import RequestOutput
from router.http.auth import effective_cache_salt
from router.http.chat_choices import answer_choices
from router.http.json_limits import DEFAULT_MAX_JSON_VALUES
from router.http.lifecycle import answer_admitted, chain, first_or_error, read_and_admit, usage_of
from router.http.reasoning_answer import ReasoningDeltas, Thinking, answer_message
from router.http.replay_log import failure_record, log_failure
from router.http.request_body import read_body
from router.http.sse import DONE, ChunkRenderer, SSEResponse
from router.http.tool_answer import ToolDeltas, answer_decoder
from router.journey.deadline import Deadline
from router.journey.detokenizer import IncrementalDetokenizer
from router.journey.orchestrator import Orchestrator
from router.protocol.chat_output import (
    ChatCompletionChunk,
    ChatCompletionResponse,
    Choice,
    ChoiceLogprobs,
    Delta,
    ModelCard,
    ModelList,
    StreamChoice,
    TokenLogprobEntry,
    TopLogprob,
)
from router.protocol.errors import APIError, bad_request, from_exception
from router.protocol.messages import MessageLimits, NormalizedChat, normalize_messages
from router.protocol.openai import ChatCompletionRequest
from router.protocol.sampling import fit_to_prompt, request_sampling_params, requested_max_tokens
from router.protocol.template_kwargs import template_kwargs_for
from router.protocol.tool_choice import answer_format, with_tool_choice
from router.protocol.tool_use import template_tools
from router.routing.admission import AdmissionController, AdmissionLimits

if TYPE_CHECKING:
    from router.http.metrics import IngressMetrics

logger = logging.getLogger("mmserve.ingress")


@dataclass
class ServedModel:
    name: str
    orchestrator: Orchestrator
    limits: MessageLimits
    max_model_len: int
    modalities: list[str]
    tool_format: str = "hermes"  # how its answers write tool calls (llm_service/tools/formats.py)
    reasoning_format: str | None = None  # its reasoning parser (llm_service/tools/reasoning.py); None: off


def tools_for(req: ChatCompletionRequest, model: ServedModel) -> list[dict[str, Any]] | None:
    """The request's tools as the template takes them (checked), or a 400 naming ``tools`` when
    the model's chat template has no place for them (rather than a silent drop)."""
    tools = template_tools(req.tools, req.tool_choice)
    if tools and not model.orchestrator.template_takes_tools:
        raise bad_request(
            f"model {model.name!r} has a chat template without tool support; send no tools",
            code="tools_unsupported",
            param="tools",
        )
    return tools


class ChatService:
    """Request handling independent of Serve (the deployment class below only wires it)."""

    def __init__(
        self,
        models: dict[str, ServedModel],
        max_request_bytes: int,
        metrics: IngressMetrics | None = None,
        admission: AdmissionController | None = None,
        *,
        max_json_values: int = DEFAULT_MAX_JSON_VALUES,
        request_timeout_s: float | None = None,
    ) -> None:
        self.models = models
        self.max_request_bytes = max_request_bytes
        self.max_json_values = max_json_values
        self.request_timeout_s = request_timeout_s
        self.metrics = metrics
        self.admission = admission or AdmissionController(AdmissionLimits())

    @property
    def body_limits(self) -> tuple[int, int]:
        """A request body's bounds: bytes, JSON values."""
        return self.max_request_bytes, self.max_json_values

    async def read_request(self, request: Request) -> ChatCompletionRequest:
        """The body, read as it arrives and parsed (no admission: the fuzz targets' path)."""
        return await read_body(request, ChatCompletionRequest, *self.body_limits)

    def model_for(self, name: str) -> ServedModel:
        model = self.models.get(name)
        if model is None:
            raise APIError(
                404, f"model {name!r} is not served here; see GET /v1/models", code="model_not_found"
            )
        return model

    async def chat(self, request: Request, tenant: str | None = None) -> Response:
        """One chat completion for ``tenant`` (router/http/auth.py; None: the server has no API keys)."""
        start = time.monotonic()
        deadline = Deadline(self.request_timeout_s)

        def ask(req: ChatCompletionRequest) -> tuple[tuple[ServedModel, NormalizedChat], int]:
            model = self.model_for(req.model)
            chat = normalize_messages(
                req.messages,
                model.limits,
                tenant,
                tools_for(req, model),
                tool_media=model.orchestrator.tool_result_modalities,
                template_kwargs=template_kwargs_for(
                    req.chat_template_kwargs, model.orchestrator.template_variables
                ),
            )
            unsupported = {m.modality for m in chat.media} - set(model.modalities)
            if unsupported:
                raise bad_request(
                    f"model {model.name!r} does not accept {', '.join(sorted(unsupported))} input",
                    code="unsupported_modality",
                )
            # Bounded work in flight, refused at once past it (router/routing/admission.py).
            return (model, chat), self.admission.cost(
                (m.modality for m in chat.media), chat.text_chars
            ) * req.n

        req, (model, chat), ticket = await read_and_admit(
            request, ChatCompletionRequest, self.body_limits, self.admission, deadline, ask
        )
        request_id = f"chatcmpl-{uuid.uuid4().hex}"
        orch = model.orchestrator

        async def answer() -> Response:
            salt = effective_cache_salt(tenant, req.cache_salt)
            return await deadline.run(self._answer(req, model, request_id, chat, start, deadline, salt))

        def failed(e: Exception) -> None:
            self._log_failure(orch, request_id, chat, e)
            orch.forget(request_id)

        return await answer_admitted(
            request,
            self.admission,
            ticket,
            (request_id, model.name),
            answer,
            failed,
            lambda: orch.forget(request_id),
        )

    async def _answer(
        self,
        req: ChatCompletionRequest,
        model: ServedModel,
        request_id: str,
        chat: NormalizedChat,
        start: float,
        deadline: Deadline,
        cache_salt: str | None = None,
    ) -> Response:
        orch = model.orchestrator
        # ``max_tokens`` is fitted to the prompt once it is prepared.
        base, requested = request_sampling_params(req), requested_max_tokens(req)
        base = with_tool_choice(base, req, model.tool_format)  # required / named: a grammar of calls
        thinking = Thinking.of(model.reasoning_format, chat.template_kwargs)
        if thinking is not None:
            thinking.check_grammar(base)
            if req.n > 1 and req.stream:
                raise bad_request("n > 1 streamed with a reasoning parser is not supported yet", param="n")
        timed = self.metrics.model(model.name) if self.metrics is not None else None
        with timed.prepare.timing() if timed is not None and chat.has_media else contextlib.nullcontext():
            prepared = await orch.prepare(request_id, chat, overlap=req.n == 1)
        params = fit_to_prompt(base, requested, len(prepared.prompt_token_ids), model.max_model_len)
        if req.n > 1:
            return await answer_choices(
                self, req, model, request_id, chat, prepared, params, start, deadline, cache_salt
            )
        stream = deadline.stream(orch.stream(request_id, prepared, params, cache_salt))
        decode = answer_decoder(
            orch, answer_format(req, model.tool_format), thinking.fmt.markers if thinking else ()
        )
        detok = IncrementalDetokenizer(decode, stop=req.stop_strings)
        first = await first_or_error(stream)
        first_at = time.monotonic()
        if timed is not None:
            timed.ttft.observe(first_at - start)
        times = (start, first_at)
        if req.stream:
            gen = self._sse(req, model, request_id, first, stream, detok, times, chat, thinking)
            return SSEResponse(gen, media_type="text/event-stream")
        response = await self._collect(req, model, request_id, first, stream, detok, times, thinking)
        orch.forget(request_id)
        return response

    def _log_failure(
        self, orch: Orchestrator, request_id: str, chat: NormalizedChat, e: BaseException
    ) -> None:
        api = from_exception(e) or APIError(500, "internal error", code="internal_error")
        record = failure_record(request_id, api.status_code, api.code, e, chat.media, orch.replay(request_id))
        log_failure(logger, record, e)

    def _logprobs(self, orch: Orchestrator, out: RequestOutput) -> ChoiceLogprobs | None:
        if out.new_logprobs is None:
            return None
        entries = []
        for lp in out.new_logprobs:
            tok = orch.decode([lp.token_id])
            top = [TopLogprob(token=orch.decode([t]), logprob=v) for t, v in lp.top]
            entries.append(TokenLogprobEntry(token=tok, logprob=lp.logprob, top_logprobs=top))
        return ChoiceLogprobs(content=entries)

    async def _collect(
        self,
        req: ChatCompletionRequest,
        model: ServedModel,
        request_id: str,
        first: RequestOutput,
        stream: AsyncGenerator[RequestOutput, None],
        detok: IncrementalDetokenizer,
        times: tuple[float, float],
        thinking: Thinking | None = None,
    ) -> JSONResponse:
        text: list[str] = []
        logprobs: list[TokenLogprobEntry] = []
        last = first
        completion_tokens = 0
        try:
            async for out in chain(first, stream):
                last = out
                completion_tokens += len(out.new_token_ids)
                text.append(detok.add(out.new_token_ids, final=out.finished))
                lp = self._logprobs(model.orchestrator, out)
                if lp and lp.content:
                    logprobs.extend(lp.content)
                if detok.stopped:
                    break
        finally:  # a stop string ends it early: the LLM stops now, not when the generator is collected
            await stream.aclose()
        finish: str | None = "stop" if detok.stopped else last.finish_reason
        message, finish = answer_message(
            "".join(text), finish, answer_format(req, model.tool_format), thinking
        )
        await model.orchestrator.settle(request_id)
        self._observe_done(model.name, times, completion_tokens)
        resp = ChatCompletionResponse(
            id=request_id,
            model=model.name,
            choices=[
                Choice(
                    message=message,
                    finish_reason=finish,
                    logprobs=ChoiceLogprobs(content=logprobs) if req.logprobs else None,
                )
            ],
            usage=usage_of(last, completion_tokens),
        )
        return JSONResponse(resp.model_dump(exclude_none=False))

    async def _sse(
        self,
        req: ChatCompletionRequest,
        model: ServedModel,
        request_id: str,
        first: RequestOutput,
        stream: AsyncGenerator[RequestOutput, None],
        detok: IncrementalDetokenizer,
        times: tuple[float, float],
        chat: NormalizedChat,
        thinking: Thinking | None = None,
    ) -> AsyncIterator[str]:
        def lp_chunk(delta: Delta, finish: str | None, logprobs: ChoiceLogprobs) -> str:
            c = ChatCompletionChunk(
                id=request_id,
                model=model.name,
                choices=[StreamChoice(delta=delta, finish_reason=finish, logprobs=logprobs)],
            )
            return f"data: {c.model_dump_json(exclude_none=True)}\n\n"

        events = ChunkRenderer(request_id, model.name)
        fmt = answer_format(req, model.tool_format)
        tools = ToolDeltas(fmt, events) if fmt is not None else None
        reasoning = ReasoningDeltas(thinking, events) if thinking is not None else None
        head = events.role()  # goes out with the first text: one write, not two
        tail = ""  # the last token's event: goes out with the usage and [DONE]
        completion_tokens = 0
        last = first
        try:
            async for out in chain(first, stream):
                last = out
                completion_tokens += len(out.new_token_ids)
                text = detok.add(out.new_token_ids, final=out.finished)
                finish = "stop" if detok.stopped else (out.finish_reason if out.finished else None)
                lp = self._logprobs(model.orchestrator, out) if req.logprobs else None
                if finish:  # a stop string ends it before the engine does: settle here too
                    await model.orchestrator.settle(request_id)
                thought = ""  # the reasoning's events, before the content's
                if reasoning is not None:
                    thought, text = reasoning.split(text, bool(finish))
                if not (text or finish or lp):
                    if thought:
                        yield head + thought
                        head = ""
                    continue
                if tools is not None:
                    event = tools.events(text, finish, lp.model_dump_json() if lp else "")
                elif lp is None:
                    event = events.delta(text, finish)
                else:
                    event = lp_chunk(Delta(content=text), finish, lp)
                event = thought + event
                if finish:
                    tail = event
                    break
                yield head + event
                head = ""
            if req.stream_options is not None and req.stream_options.include_usage:
                usage = ChatCompletionChunk(
                    id=request_id, model=model.name, choices=[], usage=usage_of(last, completion_tokens)
                )
                tail += f"data: {usage.model_dump_json()}\n\n"
            self._observe_done(model.name, times, completion_tokens)
            end = head + tail + DONE
        except Exception as e:  # after the 200 went out, errors travel in-band
            api = from_exception(e) or APIError(500, "internal error while generating", code="internal_error")
            self._log_failure(model.orchestrator, request_id, chat, e)
            end = f"{head}data: {json.dumps(api.body())}\n\n{DONE}"
        finally:
            model.orchestrator.forget(request_id)
            await stream.aclose()
        yield end

    def _observe_done(self, model: str, times: tuple[float, float], completion_tokens: int) -> None:
        """``times``: when the request came in and when its first output did."""
        if self.metrics is not None:
            self.metrics.model(model).done(*times, time.monotonic(), completion_tokens)

    def model_list(self) -> ModelList:
        return ModelList(data=[ModelCard(id=m.name, modalities=m.modalities) for m in self.models.values()])
