"""E/P/D's pull overlapped with the prefill, chunk by chunk (``kv_pull_chunks``; the picture in
llm_service/kv_handoff.py is the plain hand-off's)::

  ingress ──prefill(spec)─────────▶ prefill replica: the request queued; answered at once
          ◀──KVHandoff(early)──────  (where it runs, how many blocks it will take)
  ingress ──submit(spec + KVHandoff)─▶ decode replica: blocks allocated for the whole prompt, then
          decode ──pull_kv_chunks(rid, from_block, window_from)──▶ prefill replica: the full blocks its
          decode ◀──KVBlocks──  chunks have computed since, read while the next chunk computes (again,
                                until the prompt is done; then the answer is a plain pull's: the last
                                blocks, the window's, the linear-attention state, and the first output)

So the decode replica is chosen and its blocks allocated while the prompt computes, and a long
prompt's blocks cross while its next chunks run: what is left for after the prefill is its last
chunk's blocks. The blocks read while the request still runs here hold one more reference each
until read (a preemption cannot hand them to another request meanwhile). A first token that ends
the request comes back with the last pull, no blocks, and the decode replica emits it as it is.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator
from typing import TYPE_CHECKING, Any

from llm_service.errors import RequestFailed
from llm_service.kv_handoff import KVBlocks, KVHandoff, KVTransferFailed
from llm_service.outputs import RequestOutput

if TYPE_CHECKING:
    from llm_service.request_spec import LLMRequestSpec
    from llm_service.serve.handoff import PrefillHandoffs

CHUNK_WAIT_S = 1.0  # a pull_kv_chunks call waits this long at most for a new block, then answers none


class EarlyHandoffs:
    """A prefill replica's hand-offs answered before their first token (``KVHandoff.early``)."""

    def __init__(self, handoffs: PrefillHandoffs) -> None:
        self.h = handoffs
        self._firsts: dict[str, asyncio.Future[RequestOutput]] = {}
        self._tasks: dict[str, asyncio.Task[None]] = {}  # waiting for their first output
        self._stepped: asyncio.Event | None = None  # set (and replaced) after every engine step

    def on_step(self) -> None:
        if self._stepped is not None:
            self._stepped.set()
            self._stepped = None

    async def answer(self, spec: LLMRequestSpec, outs: AsyncIterator[RequestOutput]) -> KVHandoff:
        """Where the request's KV will be: answered as soon as it is queued; its first output is kept
        for the last pull (``first``), or dropped at the hand-off's deadline if none comes."""
        rid, h = spec.request_id, self.h
        loop = asyncio.get_running_loop()
        future: asyncio.Future[RequestOutput] = loop.create_future()
        future.add_done_callback(lambda f: f.cancelled() or f.exception())
        self._firsts[rid] = future
        task = loop.create_task(self._first(rid, outs, future))
        self._tasks[rid] = task
        task.add_done_callback(lambda t: self._tasks.pop(rid, None) if self._tasks.get(rid) is t else None)
        n = len(spec.prompt_token_ids)
        blocks, window, states = h.engine.import_needs(n)
        return KVHandoff(
            rid,
            h.replica_id,
            RequestOutput(rid, [], None, False, None, n, 0),
            address=await h.address(),
            num_tokens=n,
            num_blocks=blocks,
            deadline_s=h.deadline_s,
            num_window_blocks=window,
            num_state_slots=states,
            early=True,
        )

    async def _first(
        self, rid: str, outs: AsyncIterator[RequestOutput], future: asyncio.Future[RequestOutput]
    ) -> None:
        """Wait for the first output; from then on the last pull has ``deadline_s`` to come, as a pin."""
        try:
            async with contextlib.aclosing(outs):  # type: ignore[type-var]
                async for first in outs:
                    if first.finish_reason == "error":
                        raise RequestFailed(first.request_id, first.error or "unknown error")
                    future.set_result(first)
                    return
            raise KVTransferFailed("the prefill ended without an output")
        except BaseException as e:
            if not future.done():
                future.set_exception(e if isinstance(e, Exception) else KVTransferFailed(repr(e)))
        finally:
            asyncio.get_running_loop().call_later(self.h.deadline_s, self._forget, rid, future)

    def _forget(self, request_id: str, future: asyncio.Future[RequestOutput]) -> None:
        if self._firsts.get(request_id) is future:
            del self._firsts[request_id]
            if not future.done():
                future.cancel()

    async def abandon(self, request_id: str) -> bool:
        """The ingress gave the hand-off up: a prefill still running is aborted (closing its stream
        aborts it in the engine), its first output forgotten. True if it held the request."""
        task, future = self._tasks.get(request_id), self._firsts.pop(request_id, None)
        if task is not None:
            task.cancel()
            await asyncio.wait([task])
        if future is not None and not future.done():
            future.cancel()
        return task is not None or future is not None

    def holds(self, request_id: str) -> bool:
        return request_id in self._firsts

    async def pull_chunks(
        self, request_id: str, from_block: int, window_from: int = 0
    ) -> tuple[KVBlocks | None, bool]:
        """The prompt's full blocks computed since ``from_block`` (waiting up to ``CHUNK_WAIT_S`` for
        one, else none), or, once the prefill is done, the last pull's answer (the rest, the window's
        blocks from ``window_from``, the state, the first output: ``PrefillHandoffs.pull``) and True."""
        h, future = self.h, self._firsts.get(request_id)
        if future is None:
            raise KVTransferFailed(f"{request_id}: no early hand-off on prefill replica {h.replica_id}")
        give_up = time.monotonic() + CHUNK_WAIT_S
        while True:
            if future.done():
                return await h.pull(request_id, from_block, window_from), True
            stepped = self._stepped = self._stepped or asyncio.Event()
            ids = await h.loop.on_engine(h.engine.pin_computed_blocks, request_id, from_block)
            if ids:  # None: not in the engine yet (queued on its loop), or just done (first output due)
                assert isinstance(ids, list)
                break
            left = give_up - time.monotonic()
            if left <= 0:
                return None, False
            waiter = asyncio.ensure_future(stepped.wait())
            either: set[asyncio.Future[Any]] = {waiter, future}
            await asyncio.wait(either, timeout=left, return_when=asyncio.FIRST_COMPLETED)
            waiter.cancel()
        try:
            return await h.read(request_id, ids, from_block), False
        finally:
            await h.loop.on_engine(h.engine.unpin_blocks, ids)

    async def first(self, request_id: str) -> RequestOutput:
        """The request's first output, for its last pull (raises what ended the prefill otherwise)."""
        future = self._firsts.get(request_id)
        if future is None:
            raise KVTransferFailed(f"{request_id}: no early hand-off on prefill replica {self.h.replica_id}")
        try:
            return await asyncio.shield(future)
        except asyncio.CancelledError:
            if not future.cancelled():
                raise  # this call's own cancellation
            raise KVTransferFailed(f"{request_id}: its hand-off passed its deadline") from None
        finally:
            if future.done():
                self._firsts.pop(request_id, None)
