"""One chat request's journey through a model's pools, as seen from the ingress: two calls.

  text only:  tokenize (off the event loop when long) ──────────────▶ LLM submit ─┐
  media:      prepare (an EncoderServer replica: hash, look up,         ─▶ LLM submit ─┤
              process + encode misses next to the cache; refs back) ───────────────────┤
                                                   tokens ◀── output channel, one message per step

A prepared request holds nothing in the encoder cache: it holds its embeddings' refs itself (Ray
keeps the objects alive for it), and its reservations were committed before ``prepare`` returned.
If ``prepare`` fails or the client leaves during it, the request id's reservations are released on
every shard (final there: a reservation arriving later is refused). A ``prepare`` whose replica died
is sent again under a fresh attempt id (``router/journey/prepare_calls.py``: the hit path, the retries).

Lost embeddings (the encoder replica that owns them died): ``submit`` raises ``EmbeddingsLost``
before the request enters the engine; those entries are invalidated (only while they still hold the
refs we sent), the request is prepared again under a fresh request id (a miss now: re-encoded once),
and submitted again. A second loss is a 503.
"""

from __future__ import annotations

import asyncio
import functools
import json
import logging
from collections import OrderedDict
from collections.abc import AsyncGenerator, Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol, cast

from encoder_service.cache.cache_index import ref_id
from encoder_service.preprocess import tracing
from llm_service.embeddings import EmbeddingsLost
from llm_service.errors import RequestFailed
from llm_service.outputs import RequestOutput
from llm_service.request_spec import LLMRequestSpec, SubmitReply
from llm_service.sampling_params import SamplingParams
from mmcore.chat_template import (
    PROBE_TOOLS,
    template_takes_tools,
    template_variables,
    tool_result_modalities,
)
from mmcore.feature import MODALITIES, MediaFeature
from router.journey.llm_spec import request_spec
from router.journey.model_handles import ModelHandles
from router.journey.prepare_calls import Arrivals, PrepareCalls
from router.protocol.errors import bad_request, find_cause, lost_twice, replica_gone
from router.protocol.messages import NormalizedChat, NormalizedMessage, TextMessage, text_only_messages

logger = logging.getLogger("mmserve.router")

MAX_REPLAY_RECORDS = 4096
INLINE_TOKENIZE_CHARS = 16_384  # longer text-only prompts are templated and tokenized off the loop


@dataclass
class Prepared:
    """A request ready for the LLM: prompt ids, and its items' embedding refs. With overlap on,
    items still encoding come without refs (``MediaFeature.pending``) and ``arrivals`` yields them
    as their encodes commit (``attempt_id``: whose reservations to release if that fails)."""

    prompt_token_ids: list[int]
    mm_items: list[MediaFeature]
    arrivals: Arrivals | None = None
    attempt_id: str = ""


class ChatTokenizer(Protocol):
    """The model's tokenizer as the ingress uses it (a transformers tokenizer in production)."""

    def apply_chat_template(
        self,
        conversation: list[TextMessage],
        *,
        tools: list[dict[str, Any]] | None,
        add_generation_prompt: bool,
        tokenize: bool,
        **template_kwargs: Any,
    ) -> Sequence[int] | Mapping[str, Sequence[int]]: ...

    def decode(self, token_ids: list[int], *, skip_special_tokens: bool) -> str: ...

    def encode(self, text: str) -> list[int]: ...

    def __len__(self) -> int: ...


def chat_tokenizer(model_dir: str, chat_template: str | None = None) -> ChatTokenizer:
    """The model's tokenizer, rendering with ``chat_template`` (the model's override of its
    checkpoint's template, as the encoder's processor renders: ``Preprocessor(chat_template=)``).

    ``AutoTokenizer`` picks the class by the model's config; given none, it loads the model's own
    config class, and Gemma 4's imports transformers' video and image stack (torchvision,
    ``torch._dynamo``: ~2 CPU-s of an ingress start). It reads only ``model_type`` and
    ``tokenizer_class`` of it, so it gets a plain config carrying those two from ``config.json``."""
    from transformers import AutoTokenizer, PreTrainedConfig

    fields = json.loads((Path(model_dir) / "config.json").read_text())
    stand_in = type("TokenizerConfig", (PreTrainedConfig,), {"model_type": fields.get("model_type", "")})()
    if fields.get("tokenizer_class"):
        stand_in.tokenizer_class = fields["tokenizer_class"]
    tokenizer = AutoTokenizer.from_pretrained(model_dir, config=stand_in)
    if chat_template is not None:
        tokenizer.chat_template = chat_template
    return cast(ChatTokenizer, tokenizer)


class Orchestrator:
    def __init__(
        self,
        handles: ModelHandles,
        tokenizer: ChatTokenizer,
        block_size: int,
        max_model_len: int = 1 << 30,
        on_encoder_run: Callable[[int], None] | None = None,
        overlap_prefill: bool = False,
    ) -> None:
        self.handles = handles
        # submit a media request when its prompt is known, its items following as they are encoded
        self.overlap_prefill = overlap_prefill
        self._forwarders: dict[str, asyncio.Task[None]] = {}  # request id -> its arrivals' forwarding
        self.tokenizer = tokenizer
        self.block_size = block_size
        self.max_model_len = max_model_len
        self._on_encoder_run = on_encoder_run or (lambda n: None)
        self.calls = PrepareCalls(handles)  # the hit path or ``prepare``, with its retries
        self._messages: dict[
            str, list[NormalizedMessage]
        ] = {}  # request id -> normalised messages, while it may re-prepare
        # request id -> PreprocessedRequest.to_log(), until forget(); bounded, in case a response is
        # dropped before its body starts (then nothing calls forget()).
        self._replay: OrderedDict[str, dict[str, object]] = OrderedDict()

    @functools.cached_property
    def template_takes_tools(self) -> bool:
        """The model's chat template has a place for tool definitions (``tool_use.template_takes_tools``)."""
        return template_takes_tools(getattr(self.tokenizer, "chat_template", None))

    @functools.cached_property
    def template_variables(self) -> frozenset[str]:
        """The variables the model's chat template reads (``chat_template.template_variables``)."""
        return template_variables(getattr(self.tokenizer, "chat_template", None))

    @functools.cached_property
    def tool_result_modalities(self) -> frozenset[str]:
        """The media the chat template renders in a tool result (``chat_template.tool_result_modalities``)."""

        def render(messages: list[dict[str, object]]) -> str:
            return str(
                self.tokenizer.apply_chat_template(
                    cast(Any, messages), tools=PROBE_TOOLS, add_generation_prompt=True, tokenize=False
                )
            )

        return tool_result_modalities(render, MODALITIES)

    def _tokenize_sync(self, chat: NormalizedChat) -> list[int]:
        ids = self.tokenizer.apply_chat_template(
            text_only_messages(chat),
            tools=chat.tools,
            add_generation_prompt=True,
            tokenize=True,
            **chat.template_kwargs,
        )
        if isinstance(ids, dict) or hasattr(ids, "input_ids"):  # a BatchEncoding
            ids = cast(Mapping[str, Sequence[int]], ids)["input_ids"]
        return list(cast(Sequence[int], ids))

    async def tokenize_text_chat(self, chat: NormalizedChat) -> list[int]:
        """Short prompts inline (a thread hop costs more than they do); long ones on a worker thread."""
        if chat.text_chars <= INLINE_TOKENIZE_CHARS:
            return self._tokenize_sync(chat)
        return await asyncio.to_thread(self._tokenize_sync, chat)

    async def tokenize_prompt(self, text: str) -> list[int]:
        """A completion's prompt: the text's ids as the tokenizer gives them (its special tokens
        included, as vLLM's completions do), no chat template; long text on a worker thread."""
        if len(text) <= INLINE_TOKENIZE_CHARS:
            return list(self.tokenizer.encode(text))
        return list(await asyncio.to_thread(self.tokenizer.encode, text))

    def check_prompt_ids(self, token_ids: Sequence[int], param: str = "prompt") -> None:
        """A 400 naming ``param`` for an id the tokenizer does not know (it could not be echoed)."""
        vocab = len(self.tokenizer)
        bad = [t for t in token_ids if not 0 <= t < vocab]
        if bad:
            raise bad_request(
                f"token id {bad[0]} is outside the vocabulary [0, {vocab})", code="bad_prompt", param=param
            )

    async def prepare(self, request_id: str, chat: NormalizedChat, overlap: bool = True) -> Prepared:
        """Prompt ids and embedding refs. ``overlap=False``: every item's ref before the answer, even
        where the model's pool overlaps prefill with encoding (a prompt that several requests share)."""
        if not chat.has_media:
            return Prepared(await self.tokenize_text_chat(chat), [])
        self._messages[request_id] = chat.messages
        prepared = await self._prepare_media(request_id, request_id, self.overlap_prefill and overlap)
        if len(prepared.prompt_token_ids) >= self.max_model_len:
            if prepared.arrivals is not None:
                await prepared.arrivals.aclose()
            raise bad_request(
                f"the prompt has {len(prepared.prompt_token_ids)} tokens with its media expanded; "
                f"max_model_len is {self.max_model_len}",
                code="prompt_too_long",
                param="messages",
            )
        return prepared

    async def _prepare_media(self, request_id: str, attempt_id: str, overlap: bool = False) -> Prepared:
        """Prepared on a replica (or the hit path); ``overlap``: answered once the prompt is known
        (a re-preparation after a loss never overlaps)."""
        arrivals = None
        try:
            messages = self._messages[request_id]
            if overlap:
                pre, arrivals = await self.calls.call_overlapped(request_id, attempt_id, messages)
            else:
                pre = await self.calls.call(request_id, attempt_id, messages)
        except BaseException:
            self._messages.pop(request_id, None)
            raise
        self._replay[request_id] = pre.log
        while len(self._replay) > MAX_REPLAY_RECORDS:
            self._replay.popitem(last=False)
        if pre.num_encoded:
            self._on_encoder_run(pre.num_encoded)
        return Prepared(list(pre.prompt_token_ids), list(pre.items), arrivals, attempt_id)

    def hit_path_stats(self) -> dict[str, object]:
        return self.calls.stats()

    async def settle(self, request_id: str) -> None:
        """Finish what the request's answer must not go out before (``PrepareCalls.settle``)."""
        await self.calls.settle(request_id)

    def replay(self, request_id: str) -> dict[str, object] | None:
        """The preprocessed request's replay facts (mm_hashes, placeholders, metadata), if it got that far."""
        return self._replay.get(request_id)

    def fork(self, request_id: str, child_id: str) -> None:
        """``child_id`` answers the same prompt (another choice of ``n``): it may re-prepare the
        request's media after a loss as the request itself would. Forgotten like any request."""
        if (messages := self._messages.get(request_id)) is not None:
            self._messages[child_id] = messages

    def forget(self, request_id: str) -> None:
        """The request is over (answered or failed and logged): drop its replay facts."""
        self._replay.pop(request_id, None)
        self._messages.pop(request_id, None)
        # Still running, if at all: they leave the books when done; their failures are logged.

    def decode(self, token_ids: Iterable[int]) -> str:
        return str(self.tokenizer.decode(list(token_ids), skip_special_tokens=True))

    async def stream(
        self, request_id: str, prepared: Prepared, params: SamplingParams, cache_salt: str | None = None
    ) -> AsyncGenerator[RequestOutput, None]:
        """Submit to the LLM pool and yield the request's outputs. ``cache_salt`` enters the first KV
        block's hash: the replica's prefix cache and the router's affinity keys both see it."""
        try:
            outs, first = await self._started(request_id, prepared, params, cache_salt)
        finally:
            self._messages.pop(request_id, None)
            if (forwarder := self._forwarders.pop(request_id, None)) is not None:
                # Every item is in by the first output (else it failed), but the stream's end may
                # still be on its way: the forwarder is inside the stream until its cancel lands,
                # and closing a generator another task is running raises RuntimeError.
                forwarder.cancel()
                await asyncio.wait([forwarder])
            if prepared.arrivals is not None:
                await prepared.arrivals.aclose()
        try:
            out = first
            while out is not None:
                if out.finish_reason == "error":  # this request failed alone in an engine step
                    raise RequestFailed(request_id, out.error or "unknown error")
                if out.finished:
                    await self.settle(request_id)
                yield out
                out = await anext(outs, None)
        finally:  # a caller that stops early aborts the request on its replica now, not at GC
            await outs.aclose()

    async def _started(
        self, request_id: str, prepared: Prepared, params: SamplingParams, cache_salt: str | None
    ) -> tuple[AsyncGenerator[RequestOutput, None], RequestOutput | None]:
        """Submitted, and its first output (None: none came). The LLM replica does not fetch
        embeddings whose span its prefix cache holds; if they are evicted before the request runs,
        it fetches them then, and a loss then arrives here before any output: invalidated,
        re-encoded and submitted again, as a loss at submit is (a second one is a 503)."""
        for attempt in (1, 2):
            reply = await self._submit(request_id, prepared, params, cache_salt)
            outs = self.handles.llm.outputs(request_id, reply)
            if prepared.arrivals is not None and attempt == 1:
                self._forwarders[request_id] = asyncio.create_task(self._forward(request_id, prepared))
            try:
                return outs, await anext(outs, None)
            except BaseException as e:
                await outs.aclose()
                lost = find_cause(e, EmbeddingsLost, "mm_hashes")
                if lost is None:
                    raise
                if attempt == 2:
                    raise lost_twice(lost.mm_hashes) from e
                await self._invalidate(request_id, lost.mm_hashes, prepared.mm_items, attempt)
                prepared = await self._prepare_media(request_id, f"{request_id}#late")
        raise AssertionError("unreachable: the second attempt returns or raises")

    async def _forward(self, request_id: str, prepared: Prepared) -> None:
        """Hand the LLM replica each item of ``prepared`` as its encode commits. An encode that fails
        fails the request there with its error (a lost encoder replica as ``EmbeddingsLost``:
        ``_started`` prepares it again without overlap); the attempt's reservations are released."""
        assert prepared.arrivals is not None
        waiting = {m.mm_hash for m in prepared.mm_items if m.pending}
        try:
            async for items in prepared.arrivals:
                await self.handles.llm.arrived(request_id, items)
                waiting -= {it.mm_hash for it in items}
        except asyncio.CancelledError:
            raise
        except BaseException as e:
            await asyncio.shield(self.calls.release(prepared.attempt_id))
            error: BaseException = e
            if replica_gone(e):
                error = EmbeddingsLost(sorted(waiting), f"the encoder replica was lost ({type(e).__name__})")
            try:
                await self.handles.llm.arrived(request_id, [], error)
            except Exception:  # its replica is gone too (a node lost with both): fail it here
                # Its channel need not report the loss (seen under node loss: the request waited
                # out the client's whole deadline); the error ends the request as its replica would.
                logger.warning("could not fail %s on its LLM replica: failed here", request_id, exc_info=True)
                self.handles.llm.fail(request_id, error)

    async def _submit(
        self, request_id: str, prepared: Prepared, params: SamplingParams, cache_salt: str | None = None
    ) -> SubmitReply:
        """Submit, re-encoding lost embeddings once; returns where it went."""
        for attempt in (1, 2):
            try:
                return await self.handles.llm.submit(self._spec(request_id, prepared, params, cache_salt))
            except BaseException as e:
                lost = find_cause(e, EmbeddingsLost, "mm_hashes")
                if lost is None:
                    raise
                await self._invalidate(request_id, lost.mm_hashes, prepared.mm_items, attempt)
                if attempt == 2:
                    raise lost_twice(lost.mm_hashes) from e
                prepared = await self._prepare_media(request_id, f"{request_id}#retry")
        raise AssertionError("unreachable: the second attempt returns or raises")

    def _spec(
        self, request_id: str, prepared: Prepared, params: SamplingParams, cache_salt: str | None
    ) -> LLMRequestSpec:
        return request_spec(
            request_id,
            prepared.prompt_token_ids,
            prepared.mm_items,
            params,
            self.block_size,
            cache_salt=cache_salt,
            trace_headers=tracing.headers(),  # a sampled request's trace goes on to the LLM replica
        )

    async def _invalidate(
        self, request_id: str, lost: list[str], mm_items: list[MediaFeature], attempt: int
    ) -> None:
        """Drop the lost entries from the shared index, but only while they hold the refs we sent."""
        logger.warning(
            "request %s (attempt %d): embeddings lost for %s; invalidating", request_id, attempt, lost
        )
        sent = {m.mm_hash: ref_id(m.ref[0]) for m in mm_items if m.mm_hash in lost and m.ref}
        lost = [h for h in lost if h in sent] if any(m.pending for m in mm_items) else lost
        if not lost:  # never committed (its encode was cut off): nothing to invalidate
            return
        if self.handles.hit_path is not None:
            self.handles.hit_path.forget(lost)
        await self.handles.cache.invalidate(lost, sent)
