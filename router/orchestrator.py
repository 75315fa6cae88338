"""One chat request's journey through a model's pools, as seen from the ingress.

  text only:  tokenize ─────────────────────────────────────────────▶ LLM replica (prefix affinity)
  media:      preprocess ─▶ cache: hit / reserve+encode / wait ─▶ LLM replica ─▶ release pins

Pins on encoder-cache entries are taken before the LLM is called and released when its first
output arrives (the prefill consumed the embeddings), or when anything fails or the client leaves.

Lost embeddings (the encoder replica that owns them died): the LLM replica refuses the request
before it enters the engine with ``EmbeddingsLost``; those entries are invalidated, re-encoded once
under the same pins' request id, and the LLM is called again. A second loss is a 503.
"""

from __future__ import annotations

import asyncio
import logging
from collections import OrderedDict
from collections.abc import AsyncGenerator, Awaitable, Callable
from dataclasses import dataclass, replace
from typing import Any

from encoder_service.cache_index import ref_id
from encoder_service.deployment import EncodeBatch, EncodedItem
from encoder_service.types import EncoderInput, PreprocessedRequest
from llm_service.deployment import EmbeddingRef, EmbeddingsLost, LLMRequestSpec
from llm_service.outputs import RequestOutput
from llm_service.prefix_hash import compute_block_hashes
from llm_service.sampling_params import SamplingParams
from router.errors import APIError, bad_request, find_cause
from router.messages import NormalizedChat, text_only_messages

logger = logging.getLogger("mmserve.router")

MAX_REPLAY_RECORDS = 4096


@dataclass
class ModelHandles:
    preprocess: Any  # DeploymentHandle of PreprocessorServer
    encoder: Any  # DeploymentHandle of EncoderPoolServer
    llm: Any  # DeploymentHandle of LLMServer
    cache: Any  # encoder_service.cache_index.EncoderCacheClient


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
        self._messages: dict[str, Any] = {}  # request id -> normalised messages, while pins are held
        # request id -> PreprocessedRequest.to_log(), until forget(); bounded, in case a response is
        # dropped before its body starts (then nothing calls forget()).
        self._replay: OrderedDict[str, dict[str, Any]] = OrderedDict()

    def tokenize_text_chat(self, chat: NormalizedChat) -> list[int]:
        ids = self.tokenizer.apply_chat_template(
            text_only_messages(chat), add_generation_prompt=True, tokenize=True
        )
        if isinstance(ids, dict) or hasattr(ids, "input_ids"):
            ids = ids["input_ids"]
        return list(ids)

    async def prepare(
        self, request_id: str, chat: NormalizedChat
    ) -> tuple[list[int], list[EmbeddingRef], Any]:
        """Prompt ids and embedding refs for the LLM; the returned release() must be called once."""
        if not chat.has_media:
            return self.tokenize_text_chat(chat), [], _noop
        self._messages[request_id] = chat.messages
        try:
            pre: PreprocessedRequest = await self.h.preprocess.preprocess.remote(chat.messages)
        except BaseException:
            self._messages.pop(request_id, None)
            raise
        self._replay[request_id] = pre.to_log()
        while len(self._replay) > MAX_REPLAY_RECORDS:
            self._replay.popitem(last=False)
        if len(pre.prompt_token_ids) >= self.max_model_len:
            self._messages.pop(request_id, None)
            raise bad_request(
                f"the prompt has {len(pre.prompt_token_ids)} tokens with its media expanded; "
                f"max_model_len is {self.max_model_len}",
                code="prompt_too_long",
                param="messages",
            )
        try:
            refs = await self._embeddings_for(request_id, pre)
        except BaseException:
            await self._release(request_id)
            raise
        return pre.prompt_token_ids, refs, lambda: self._release(request_id)

    async def _embeddings_for(self, request_id: str, pre: PreprocessedRequest) -> list[EmbeddingRef]:
        """Each distinct item concurrently: a cache hit (pinned), or reserve + encode + commit.

        Items are sent to the encoder one call each, as soon as they are reserved: the encoder replica
        batches across calls under its budget, and no request holds a reservation while it waits
        for another request's item (which could deadlock two requests on each other's images).
        """
        firsts: dict[str, Any] = {}
        for item in pre.items:
            firsts.setdefault(item.mm_hash, item)
        tasks = [asyncio.ensure_future(self._one_item(request_id, pre, it)) for it in firsts.values()]
        try:
            results = await asyncio.gather(*tasks)
        except BaseException:  # one item failed (or the client left): stop encoding the others
            for t in tasks:
                t.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
            raise
        found = dict(zip(firsts, results, strict=True))
        return [
            EmbeddingRef(
                ref=[found[it.mm_hash][1]],
                offset=it.placeholder.offset,
                length=it.placeholder.length,
                mm_hash=it.mm_hash,
                modality=it.modality,
                grid_thw=it.grid_thw,
            )
            for it in pre.items
        ]

    async def _one_item(self, request_id: str, pre: PreprocessedRequest, item: Any) -> tuple[Any, Any]:
        cache = self.h.cache
        kind, payload = await cache.get_or_reserve(request_id, item.mm_hash, item.num_embeds)
        if kind == "hit":
            return payload
        enc = item.encoder_input
        if enc is None:  # evicted after the preprocessor saw it as a hit: process it now
            enc = await self._reprocess(request_id, item.index)
        encoded: list[EncodedItem] = await self.h.encoder.encode.remote(EncodeBatch(request_id, [enc]))
        self._on_encoder_run(len(encoded))
        out = encoded[0]
        await cache.commit(out.meta.mm_hash, out.meta, out.ref[0], request_id)
        return out.meta, out.ref[0]

    async def _reprocess(self, request_id: str, index: int) -> EncoderInput:
        pre = await self.h.preprocess.preprocess.remote(self._messages[request_id], use_cache=False)
        enc = pre.items[index].encoder_input
        assert enc is not None
        return enc

    async def _release(self, request_id: str) -> None:
        self._messages.pop(request_id, None)
        try:
            await self.h.cache.release(request_id)
        except Exception:  # never let cleanup mask the original error
            logger.exception("releasing encoder-cache pins of %s failed", request_id)

    def replay(self, request_id: str) -> dict[str, Any] | None:
        """The preprocessed request's replay facts (mm_hashes, placeholders, metadata), if it got that far."""
        return self._replay.get(request_id)

    def forget(self, request_id: str) -> None:
        """The request is over (answered or failed and logged): drop its replay facts."""
        self._replay.pop(request_id, None)

    def decode(self, token_ids: Any) -> str:
        return str(self.tokenizer.decode(list(token_ids), skip_special_tokens=True))

    async def stream_prepared(
        self,
        request_id: str,
        prompt_ids: list[int],
        mm_items: list[EmbeddingRef],
        params: SamplingParams,
        release: Callable[[], Awaitable[None]],
    ) -> AsyncGenerator[RequestOutput, None]:
        """Stream the LLM's outputs; pins are released at the first output or on any exit."""
        released = False
        stream = None
        try:
            stream, first = await self._first_output(request_id, prompt_ids, mm_items, params)
            if first is None:
                return
            released = True
            await release()
            yield first
            async for out in stream:
                yield out
        finally:
            if stream is not None:
                stream.cancel()
            if not released:
                await release()

    async def _first_output(
        self, request_id: str, prompt_ids: list[int], mm_items: list[EmbeddingRef], params: SamplingParams
    ) -> tuple[Any, RequestOutput | None]:
        """Call the LLM and wait for its first output, re-encoding lost embeddings once."""
        hashes = compute_block_hashes(
            prompt_ids, [(m.offset, m.length, m.mm_hash) for m in mm_items], self.block_size
        )
        for attempt in (1, 2):
            spec = LLMRequestSpec(request_id, prompt_ids, params, mm_items, hashes)
            stream = self.h.llm.options(stream=True).generate.remote(spec)
            try:
                return stream, await stream.__anext__()
            except StopAsyncIteration:
                return stream, None
            except BaseException as e:
                stream.cancel()
                lost = find_cause(e, EmbeddingsLost, "mm_hashes")
                if lost is None:
                    raise
                await self._invalidate(request_id, lost.mm_hashes, mm_items, attempt)
                if attempt == 2:
                    raise _lost_twice(lost.mm_hashes) from e
                mm_items = await self._reencode(request_id, mm_items, lost.mm_hashes)
        raise AssertionError("unreachable: the second attempt returns or raises")

    async def _invalidate(
        self, request_id: str, lost: list[str], mm_items: list[EmbeddingRef], attempt: int
    ) -> None:
        """Drop the lost entries from the shared index, but only while they hold the refs we sent."""
        logger.warning(
            "request %s (attempt %d): embeddings lost for %s; invalidating", request_id, attempt, lost
        )
        sent = {m.mm_hash: ref_id(m.ref[0]) for m in mm_items if m.mm_hash in lost}
        await self.h.cache.invalidate(lost, sent)

    async def _reencode(
        self, request_id: str, mm_items: list[EmbeddingRef], lost: list[str]
    ) -> list[EmbeddingRef]:
        """Fresh refs for the lost items; the others keep theirs (and their pins).

        A new preprocess pass gives the lost items their encoder inputs back (the index no longer
        lists them; the processor cache may still hold their tensors, else they are processed
        again); each is then a cache hit (someone re-encoded it already) or reserved and encoded.
        """
        pre: PreprocessedRequest = await self.h.preprocess.preprocess.remote(self._messages[request_id])
        firsts: dict[str, Any] = {}
        for item in pre.items:
            firsts.setdefault(item.mm_hash, item)
        wanted = list(dict.fromkeys(lost))
        found = await asyncio.gather(*(self._one_item(request_id, pre, firsts[h]) for h in wanted))
        fresh = {h: ref for h, (_, ref) in zip(wanted, found, strict=True)}
        return [replace(m, ref=[fresh[m.mm_hash]]) if m.mm_hash in fresh else m for m in mm_items]


def _lost_twice(mm_hashes: list[str]) -> APIError:
    return APIError(
        503,
        f"the embeddings of {len(mm_hashes)} media item(s) were lost twice while serving this request "
        "(encoder replicas are restarting or scaling down); retry shortly",
        code="embeddings_lost",
        retry_after_s=1,
    )


async def _noop() -> None:
    await asyncio.sleep(0)
