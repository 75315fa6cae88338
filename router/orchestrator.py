"""One chat request's journey through a model's pools, as seen from the ingress: two calls.

  text only:  tokenize (off the event loop when long) ──────────────▶ LLM submit ─┐
  media:      prepare (an EncoderPool or Preprocessor replica: hash,  ─▶ LLM submit ─┤
              look up, process + encode misses next to the cache; refs back; or it    │
              submits the request itself: router/forwarding.py) ───────────────────────┤
                                                   tokens ◀── output channel, one message per step

A prepared request holds nothing in the encoder cache: it holds its embeddings' refs itself (Ray
keeps the objects alive for it), and its reservations were committed before ``prepare`` returned.
If ``prepare`` fails or the client leaves during it, the request id's reservations are released on
every shard (final there: a reservation arriving later is refused). A ``prepare`` whose replica died
is sent again under a fresh attempt id, up to ``PREPARE_ATTEMPTS`` times.

Lost embeddings (the encoder replica that owns them died): ``submit`` raises ``EmbeddingsLost``
before the request enters the engine; those entries are invalidated (only while they still hold the
refs we sent), the request is prepared again under a fresh request id (a miss now: re-encoded once),
and submitted again. A second loss is a 503.
"""

from __future__ import annotations

import asyncio
import functools
import logging
from collections import OrderedDict
from collections.abc import AsyncGenerator, Callable
from dataclasses import dataclass, replace
from typing import Any, Protocol

from encoder_service.cache_index import ref_id
from encoder_service.prepared import LookedUp, PreparedRequest
from llm_service.embeddings import EmbeddingsLost
from llm_service.errors import RequestFailed
from llm_service.outputs import RequestOutput
from llm_service.request_spec import EmbeddingRef, LLMRequestSpec, SubmitReply
from llm_service.sampling_params import SamplingParams
from router.direct_link import DirectLink
from router.errors import bad_request, find_cause, is_client_error, lost_twice, replica_gone
from router.forwarding import ForwardRequest, embedding_refs, request_spec
from router.llm_client import LLMClient
from router.messages import NormalizedChat, inline_media, text_only_messages

logger = logging.getLogger("mmserve.router")

MAX_REPLAY_RECORDS = 4096
PREPARE_ATTEMPTS = 3  # a replica that dies while preparing a request: prepared again on another
INLINE_TOKENIZE_CHARS = 16_384  # longer text-only prompts are templated and tokenized off the loop
HIT_PATH_MAX_CHARS = 4 << 20  # inline media past this is hashed by the preparing replica, off this loop
NEAR_SWEEP_S = 5.0  # how often the near cache's expired entries are released
SETTLE_TIMEOUT_S = 5.0  # the most a deferred uuid pointing may hold a request's last output


class PreprocessPool(Protocol):
    """The preprocessor pool as the router calls it (a Serve DeploymentHandle in production)."""

    @property
    def prepare(self) -> Any: ...


class CacheIndex(Protocol):
    """The shared encoder cache as the router uses it (encoder_service.cache_client.EncoderCacheClient)."""

    async def release(self, request_id: str, hashes: list[str] | None = None) -> None: ...

    async def invalidate(self, mm_hashes: list[str], ref_ids: dict[str, str] | None = None) -> list[str]: ...


class HitPath(Protocol):
    """Preparing at the ingress what the encoder cache holds whole (encoder_service.prepare.RequestPreparer)."""

    async def prepare_hits(
        self, request_id: str, messages: list[dict[str, Any]], deferred: list[asyncio.Task[None]]
    ) -> PreparedRequest | LookedUp: ...

    def remember(self, prepared: PreparedRequest, looked_up: LookedUp | None = None) -> None: ...

    def renewing(self, request_id: str, held: dict[str, str]) -> Any: ...

    def sweep(self) -> None: ...

    def forget(self, mm_hashes: list[str]) -> None: ...


@dataclass
class ModelHandles:
    preprocess: PreprocessPool
    llm: LLMClient
    cache: CacheIndex
    hit_path: HitPath | None = None  # None: every media request goes to ``prepare``
    forward: bool = False  # the preparing replicas submit to the LLM pool themselves (forwarding.py)
    prepare_link: DirectLink | None = None  # ``prepare`` as frames to the pool's one replica (direct_link.py)

    async def prepare(self, *args: Any, via_link: bool = True) -> PreparedRequest:
        """One ``prepare`` call to the preparing pool: over the direct link if there is one and it is
        up; a retry (``via_link=False``) goes through Serve, which waits for a live replica."""
        if via_link and self.prepare_link is not None and self.prepare_link.usable():
            prepared: PreparedRequest = await self.prepare_link.call("prepare", *args)
            return prepared
        return await self.preprocess.prepare.remote(*args)  # type: ignore[no-any-return]


@dataclass
class Prepared:
    """A request ready for the LLM: prompt ids, and its items' embedding refs."""

    prompt_token_ids: list[int]
    mm_items: list[EmbeddingRef]
    forwarded_to: SubmitReply | None = None  # submitted already, by the replica that prepared it


class Orchestrator:
    def __init__(
        self,
        handles: ModelHandles,
        tokenizer: Any,
        block_size: int,
        max_model_len: int = 1 << 30,
        on_encoder_run: Callable[[int], None] | None = None,
    ) -> None:
        self.h = handles
        self.tokenizer = tokenizer
        self.block_size = block_size
        self.max_model_len = max_model_len
        self._on_encoder_run = on_encoder_run or (lambda n: None)
        self.hit_path_served = 0  # media requests prepared at the ingress alone (all cache hits)
        self._messages: dict[str, Any] = {}  # request id -> normalised messages, while it may re-prepare
        self._deferred: dict[str, list[asyncio.Task[None]]] = {}  # work to finish before answering
        self._forwarded: dict[str, SubmitReply] = {}  # submitted by a preparing replica, not adopted yet
        self._sweeper: asyncio.Task[None] | None = None  # the near cache's expiry (_ensure_sweeper)
        # request id -> PreprocessedRequest.to_log(), until forget(); bounded, in case a response is
        # dropped before its body starts (then nothing calls forget()).
        self._replay: OrderedDict[str, dict[str, Any]] = OrderedDict()

    def _tokenize_sync(self, chat: NormalizedChat) -> list[int]:
        ids = self.tokenizer.apply_chat_template(
            text_only_messages(chat), add_generation_prompt=True, tokenize=True
        )
        if isinstance(ids, dict) or hasattr(ids, "input_ids"):
            ids = ids["input_ids"]
        return list(ids)

    async def tokenize_text_chat(self, chat: NormalizedChat) -> list[int]:
        """Short prompts inline (a thread hop costs more than they do); long ones on a worker thread."""
        if chat.text_chars <= INLINE_TOKENIZE_CHARS:
            return self._tokenize_sync(chat)
        return await asyncio.to_thread(self._tokenize_sync, chat)

    async def prepare(
        self, request_id: str, chat: NormalizedChat, forward: ForwardRequest | None = None
    ) -> Prepared:
        """Prompt ids and embedding refs. With ``forward`` (and ``ModelHandles.forward``), a request
        the hit path does not serve is submitted by the replica that prepares it (``forwarded_to``)."""
        if not chat.has_media:
            return Prepared(await self.tokenize_text_chat(chat), [])
        self._messages[request_id] = chat.messages
        if forward is not None and self.h.forward:
            forward = replace(forward, request_id=request_id, ingress_id=self.h.llm.ingress_id)
        else:
            forward = None
        prepared = await self._prepare_media(request_id, request_id, forward)
        if len(prepared.prompt_token_ids) >= self.max_model_len:
            raise bad_request(
                f"the prompt has {len(prepared.prompt_token_ids)} tokens with its media expanded; "
                f"max_model_len is {self.max_model_len}",
                code="prompt_too_long",
                param="messages",
            )
        return prepared

    async def _prepare_media(
        self, request_id: str, attempt_id: str, forward: ForwardRequest | None = None
    ) -> Prepared:
        pre = await self._prepare_call(request_id, attempt_id, forward)
        self._replay[request_id] = pre.log
        while len(self._replay) > MAX_REPLAY_RECORDS:
            self._replay.popitem(last=False)
        if pre.num_encoded:
            self._on_encoder_run(pre.num_encoded)
        forwarded_to = SubmitReply(*pre.forwarded_to) if pre.forwarded_to else None
        if forwarded_to is not None:
            self._forwarded[request_id] = forwarded_to
        return Prepared(list(pre.prompt_token_ids), embedding_refs(pre), forwarded_to)

    async def _prepare_call(
        self, request_id: str, attempt_id: str, forward: ForwardRequest | None = None
    ) -> PreparedRequest:
        """One ``prepare`` call, sent again (under a fresh attempt id) while the replica preparing it
        dies: Serve routes the next to a live replica or to the dead one's successor. The first
        attempt tries the hit path here first (``hit_path``): a request whose every item the
        encoder cache holds makes no call but the lookup. Only the first call may ``forward``: a
        retry's replica must not submit what a dead one may have submitted already."""
        messages = self._messages[request_id]
        use_hit_path = self.h.hit_path is not None and inline_media(messages, HIT_PATH_MAX_CHARS)
        if use_hit_path:
            self._ensure_sweeper()
        for attempt in range(1, PREPARE_ATTEMPTS + 1):
            aid = attempt_id if attempt == 1 else f"{attempt_id}#p{attempt}"
            from_hit_path = expected = False
            try:
                looked_up = None
                if use_hit_path and attempt == 1 and self.h.hit_path is not None:
                    from_hit_path = True
                    deferred: list[asyncio.Task[None]] = []
                    try:
                        got = await self.h.hit_path.prepare_hits(aid, messages, deferred)
                    finally:
                        self._defer(request_id, deferred)
                    if isinstance(got, PreparedRequest):
                        self.hit_path_served += 1
                        return got
                    looked_up, from_hit_path = got, False
                fwd = forward if attempt == 1 else None
                args: tuple[Any, ...] = (looked_up, fwd) if fwd else (looked_up,) if looked_up else ()
                if fwd is not None:  # its outputs may come before the answer
                    self.h.llm.expect(request_id)
                    expected = True
                if looked_up is None:
                    pre: PreparedRequest = await self.h.prepare(aid, messages, *args, via_link=attempt == 1)
                else:  # its reservations are ours until the replica takes them: renewed meanwhile
                    assert self.h.hit_path is not None
                    held = {h: kind for h, (kind, _) in looked_up.found.items()}
                    async with self.h.hit_path.renewing(aid, held):
                        pre = await self.h.prepare(aid, messages, *args, via_link=attempt == 1)
                if fwd is not None and pre.forwarded_to is None:  # we submit it ourselves
                    self.h.llm.unexpect(request_id)
                if self.h.hit_path is not None:
                    self.h.hit_path.remember(pre, looked_up)
                return pre
            except BaseException as e:
                # The replica may still be running (a cancel need not reach it): release on every
                # shard. Final there: its later reservations are refused. Anything it forwarded
                # reaches no reader now: aborted as an orphan when its outputs come.
                if expected:
                    self.h.llm.unexpect(request_id)
                await asyncio.shield(self._release(aid))
                # The hit path failing on our side (a cache shard restarting) costs the shortcut,
                # not the request: the next attempt prepares it on a replica.
                retry = replica_gone(e) or (from_hit_path and not is_client_error(e))
                if attempt == PREPARE_ATTEMPTS or isinstance(e, asyncio.CancelledError) or not retry:
                    self._messages.pop(request_id, None)
                    raise
                if from_hit_path:
                    logger.warning("hit path failed for %s (%r); preparing it on a replica", request_id, e)
                    continue
                logger.warning(
                    "replica preparing %s lost (%s); preparing it again", request_id, type(e).__name__
                )
                await asyncio.sleep(0.2 * attempt)
        raise AssertionError("unreachable: the last attempt returns or raises")

    async def _release(self, attempt_id: str) -> None:
        try:
            await self.h.cache.release(attempt_id)
        except Exception:  # never let cleanup mask the original error
            logger.exception("releasing the encoder-cache reservations of %s failed", attempt_id)

    def hit_path_stats(self) -> dict[str, Any]:
        near = getattr(self.h.hit_path, "near", None)
        return {"hit_path_served": self.hit_path_served, "near_cache": near.stats() if near else None}

    def _ensure_sweeper(self) -> None:
        """Every ``NEAR_SWEEP_S``, the hit path's near cache lets go of its expired entries."""
        if self._sweeper is not None and not self._sweeper.done():
            return

        async def sweep_forever() -> None:
            while True:
                await asyncio.sleep(NEAR_SWEEP_S)
                if self.h.hit_path is not None:
                    self.h.hit_path.sweep()

        self._sweeper = asyncio.get_running_loop().create_task(sweep_forever())

    def _defer(self, request_id: str, tasks: list[asyncio.Task[None]]) -> None:
        """Work the hit path started that nothing waits on (pointing uuids at bytes): awaited before
        the request's last output goes out, so a client that saw the answer finds it done."""
        for task in tasks:
            task.add_done_callback(_log_failure)
            task.add_done_callback(functools.partial(self._undefer, request_id))
            self._deferred.setdefault(request_id, []).append(task)

    def _undefer(self, request_id: str, task: asyncio.Task[None]) -> None:
        """A finished task leaves the books (bounded even for a response dropped before its body)."""
        tasks = self._deferred.get(request_id)
        if tasks is not None and task in tasks:
            tasks.remove(task)
            if not tasks:
                del self._deferred[request_id]

    async def settle(self, request_id: str) -> None:
        """Finish what the request's answer must not go out before (its uuid pointing); the ingress
        calls it before any chunk that carries a finish reason."""
        tasks = list(self._deferred.get(request_id, ()))
        if tasks:  # failures are logged by _log_failure; one that hangs does not hold the answer
            _, pending = await asyncio.wait(tasks, timeout=SETTLE_TIMEOUT_S)
            if pending:
                logger.warning(
                    "request %s answered with %d uuid pointing(s) unfinished", request_id, len(pending)
                )

    def replay(self, request_id: str) -> dict[str, Any] | None:
        """The preprocessed request's replay facts (mm_hashes, placeholders, metadata), if it got that far."""
        return self._replay.get(request_id)

    def forget(self, request_id: str) -> None:
        """The request is over (answered or failed and logged): drop its replay facts."""
        self._replay.pop(request_id, None)
        self._messages.pop(request_id, None)
        if (forwarded_to := self._forwarded.pop(request_id, None)) is not None:  # never adopted
            self.h.llm.unexpect(request_id, forwarded_to)  # aborted where it went
        # Still running, if at all: they leave the books when done; their failures are logged.

    def decode(self, token_ids: Any) -> str:
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
            if attempt == 1 and prepared.forwarded_to is not None:
                self._forwarded.pop(request_id, None)
                spec = self._spec(request_id, prepared, params, cache_salt)
                reply = self.h.llm.adopt(spec, prepared.forwarded_to)
            else:
                reply = await self._submit(request_id, prepared, params, cache_salt)
            outs = self.h.llm.outputs(request_id, reply)
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

    async def _submit(
        self, request_id: str, prepared: Prepared, params: SamplingParams, cache_salt: str | None = None
    ) -> SubmitReply:
        """Submit, re-encoding lost embeddings once; returns where it went."""
        for attempt in (1, 2):
            try:
                return await self.h.llm.submit(self._spec(request_id, prepared, params, cache_salt))
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
        )

    async def _invalidate(
        self, request_id: str, lost: list[str], mm_items: list[EmbeddingRef], attempt: int
    ) -> None:
        """Drop the lost entries from the shared index, but only while they hold the refs we sent."""
        logger.warning(
            "request %s (attempt %d): embeddings lost for %s; invalidating", request_id, attempt, lost
        )
        sent = {m.mm_hash: ref_id(m.ref[0]) for m in mm_items if m.mm_hash in lost}
        if self.h.hit_path is not None:
            self.h.hit_path.forget(lost)
        await self.h.cache.invalidate(lost, sent)


def _log_failure(task: asyncio.Task[None]) -> None:
    if not task.cancelled() and (e := task.exception()) is not None:
        logger.warning("pointing media uuids at their bytes failed: %r", e)
