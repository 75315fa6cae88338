"""The LLM pool's Ray Serve replica: one engine, an async step loop, token streams back to the router.

Ray lives here and nowhere else in llm_service. The engine is not thread-safe, so every engine call
happens on one worker thread: ``generate`` only enqueues work, the loop applies adds and aborts
between steps and fans each step's outputs out to per-request queues.
"""

from __future__ import annotations

import asyncio
import logging
import threading
from collections.abc import AsyncIterator, Callable, Sequence
from typing import Any

from llm_service.config import EngineConfig
from llm_service.multimodal import MultiModalInput
from llm_service.outputs import RequestOutput
from llm_service.request_spec import EmbeddingRef, LLMRequestSpec
from llm_service.sampling_params import SamplingParams

logger = logging.getLogger("mmserve.llm")


_Add = tuple[str, list[int], SamplingParams, list[MultiModalInput]]  # request id, prompt, params, media


class EngineLoop:
    """Drives an engine on one thread; async callers stream RequestOutputs per request id."""

    def __init__(self, engine: Any, on_outputs: Callable[[list[RequestOutput]], None] | None = None) -> None:
        self.engine = engine
        self._on_outputs = on_outputs or (lambda outs: None)  # every step's outputs, listened to or not
        self._lock = threading.Lock()
        # Adds and aborts (a bare request id) in arrival order: a stream cancelled before the loop
        # picked up its add must be added, then aborted, never the other way round.
        self._pending: list[_Add | str] = []
        self._queues: dict[str, asyncio.Queue[RequestOutput | BaseException]] = {}
        self._wakeup: asyncio.Event | None = None
        self._task: asyncio.Task[None] | None = None
        self.last_stats: Any = None

    def _ensure_started(self) -> None:
        if self._task is None or self._task.done():
            self._wakeup = asyncio.Event()
            self._task = asyncio.get_running_loop().create_task(self._run())

    async def stream(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        params: SamplingParams,
        mm_inputs: list[MultiModalInput],
    ) -> AsyncIterator[RequestOutput]:
        self._ensure_started()
        assert self._wakeup is not None
        queue: asyncio.Queue[RequestOutput | BaseException] = asyncio.Queue()
        if request_id in self._queues:
            raise ValueError(f"duplicate request id {request_id!r}")
        self._queues[request_id] = queue
        with self._lock:
            self._pending.append((request_id, prompt_token_ids, params, mm_inputs))
        self._wakeup.set()
        finished = False
        try:
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
                self._abort(request_id)

    def _abort(self, request_id: str) -> None:
        with self._lock:
            self._pending.append(request_id)
        if self._wakeup is not None:
            self._wakeup.set()

    def _step_once(self) -> tuple[list[RequestOutput], list[tuple[str, BaseException]]]:
        """Runs on the worker thread: apply queued adds/aborts, then one engine step."""
        with self._lock:
            pending, self._pending = self._pending, []
        errors: list[tuple[str, BaseException]] = []
        for op in pending:
            if isinstance(op, str):
                self.engine.abort(op)
                continue
            rid, ids, params, mm = op
            try:
                self.engine.add_request(rid, ids, params, mm)
            except Exception as e:  # RequestRejected and friends go back to that caller only
                errors.append((rid, e))
        outputs = self.engine.step() if self.engine.has_unfinished_requests() else []
        self.last_stats = self.engine.stats()
        return outputs, errors

    def _has_pending(self) -> bool:
        with self._lock:
            return bool(self._pending)

    async def _run(self) -> None:
        try:
            await self._loop_forever()
        except BaseException as e:  # the loop is gone: no stream may wait on it forever
            if not isinstance(e, asyncio.CancelledError):
                logger.exception("engine loop died")
            err = e if isinstance(e, Exception) else RuntimeError("engine loop stopped")
            for q in list(self._queues.values()):
                q.put_nowait(err)
            raise

    async def _loop_forever(self) -> None:
        assert self._wakeup is not None
        while True:
            if not self.engine.has_unfinished_requests() and not self._has_pending():
                await self._wakeup.wait()
                self._wakeup.clear()
                continue
            try:
                outputs, errors = await asyncio.to_thread(self._step_once)
            except Exception as e:  # an engine bug: fail every request rather than hang them
                logger.exception("engine step failed")
                for rid, fq in list(self._queues.items()):
                    fq.put_nowait(e)
                    self._abort(rid)
                continue
            for rid, err in errors:
                if (eq := self._queues.get(rid)) is not None:
                    eq.put_nowait(err)
            try:
                self._on_outputs(outputs)
            except Exception:  # metrics must never stop the loop that every stream waits on
                logger.exception("on_outputs callback failed")
            for out in outputs:
                if (oq := self._queues.get(out.request_id)) is not None:
                    oq.put_nowait(out)


class EmbeddingsLost(Exception):
    """Embeddings the request refers to are gone from the object store: their owner (the encoder
    replica that computed them) died, or the fetch timed out. Raised before the request reaches the
    engine, so it holds no KV blocks; the router invalidates ``mm_hashes`` and re-encodes them.
    """

    status_code = 503
    code = "embeddings_lost"

    def __init__(self, mm_hashes: Sequence[str], detail: str = "") -> None:
        self.mm_hashes = list(mm_hashes)
        self.detail = detail
        names = ", ".join(h[:16] for h in self.mm_hashes)
        super().__init__(f"embeddings of {len(self.mm_hashes)} item(s) are lost ({names}): {detail}")

    def __reduce__(self):  # type: ignore[no-untyped-def]  # keeps the fields across pickling (Ray)
        return (type(self), (self.mm_hashes, self.detail))


def is_lost_object(exc: BaseException) -> bool:
    """Ray's ways of saying an object cannot be fetched any more (OwnerDiedError, ObjectFreedError,
    ObjectFetchTimedOutError, ObjectReconstructionFailedError all subclass ObjectLostError)."""
    from ray.exceptions import ObjectLostError

    return isinstance(exc, ObjectLostError | TimeoutError)


async def resolve_embeddings(
    items: Sequence[EmbeddingRef], fetch: Callable[[Any], Any]
) -> list[MultiModalInput]:
    """Fetch each item's embeddings (from the object store) into MultiModalInputs.

    Raises ``EmbeddingsLost`` naming every item whose object is lost (not just the first one).
    """
    tensors = await asyncio.gather(*(fetch(it.ref[0]) for it in items), return_exceptions=True)
    errors = [t for t in tensors if isinstance(t, BaseException)]
    if other := [e for e in errors if not is_lost_object(e)]:
        raise other[0]
    if errors:
        lost = [it.mm_hash for it, t in zip(items, tensors, strict=True) if isinstance(t, BaseException)]
        raise EmbeddingsLost(list(dict.fromkeys(lost)), type(errors[0]).__name__) from errors[0]
    return [
        MultiModalInput(
            embeddings=t, offset=it.offset, mm_hash=it.mm_hash, modality=it.modality, grid_thw=it.grid_thw
        )
        for it, t in zip(items, tensors, strict=True)
    ]


class LLMServer:
    """Serve replica body (wrapped by ``serve.deployment`` in cluster/app.py)."""

    def __init__(
        self,
        engine_config: EngineConfig,
        model_name: str,
        engine_cls: Any = None,
        embedding_fetch_timeout_s: float = 60.0,
    ) -> None:
        if engine_cls is None:
            from llm_service.engine import LLMEngine

            engine_cls = LLMEngine
        self.model_name = model_name
        self.engine = engine_cls(engine_config)
        self._metrics = _LLMMetrics(model_name)
        self.loop = EngineLoop(self.engine, on_outputs=self._metrics.observe_step)
        self.embedding_fetch_timeout_s = embedding_fetch_timeout_s

    async def generate(self, spec: LLMRequestSpec) -> AsyncIterator[RequestOutput]:
        """Stream outputs; raises ``EmbeddingsLost`` before the engine sees the request if an
        embedding cannot be fetched (its encoder replica died, or the fetch took over the timeout)."""

        async def fetch(ref: Any) -> Any:
            return await asyncio.wait_for(ref, self.embedding_fetch_timeout_s)

        mm_inputs = await resolve_embeddings(spec.mm_items, fetch)
        async for out in self.loop.stream(
            spec.request_id, list(spec.prompt_token_ids), spec.sampling_params, mm_inputs
        ):
            yield out

    def stats(self) -> dict[str, Any]:
        s = self.loop.last_stats or self.engine.stats()
        return {
            "num_running": s.num_running,
            "num_waiting": s.num_waiting,
            "num_free_blocks": s.num_free_blocks,
            "num_total_blocks": s.num_total_blocks,
            "kv_usage": s.kv_usage,
            "prefix_hit_tokens": s.prefix_hit_tokens,
            "prefix_query_tokens": s.prefix_query_tokens,
            "num_preemptions": s.num_preemptions,
        }

    def record_routing_stats(self) -> dict[str, Any]:
        """Called by Serve's controller; read by router.request_routers.PrefixAffinityRouter."""
        stats = self.stats()
        self._metrics.export(stats)
        return stats

    def record_autoscaling_stats(self) -> dict[str, float]:
        """Custom autoscaling metrics read by cluster.autoscaling_policy.LLMLoadPolicy."""
        s = self.stats()
        return {
            "kv_usage": float(s["kv_usage"]),
            "num_running": float(s["num_running"]),
            "num_waiting": float(s["num_waiting"]),
        }

    def check_health(self) -> None:
        task = self.loop._task
        if task is not None and task.done():
            why = "cancelled" if task.cancelled() else repr(task.exception())
            raise RuntimeError(f"engine loop died: {why}")


class _LLMMetrics:
    """Prometheus metrics through Ray (scraped from each node's metrics port)."""

    def __init__(self, model: str) -> None:
        from ray.serve import metrics

        tags = {"model": model}
        self.kv_blocks_in_use = metrics.Gauge(
            "mmserve_kv_blocks_in_use", "KV blocks held by requests", ("model",)
        )
        self.kv_blocks_in_use.set_default_tags(dict(tags))
        self.running = metrics.Gauge(
            "mmserve_llm_running_requests", "requests in the running batch", ("model",)
        )
        self.running.set_default_tags(dict(tags))
        self.waiting = metrics.Gauge("mmserve_llm_waiting_requests", "requests waiting for KV", ("model",))
        self.waiting.set_default_tags(dict(tags))
        self.prefix_hit = metrics.Counter(
            "mmserve_prefix_cache_hit_tokens", "prompt tokens served from KV", ("model",)
        )
        self.prefix_hit.set_default_tags(dict(tags))
        self.prefix_query = metrics.Counter(
            "mmserve_prefix_cache_query_tokens", "prompt tokens looked up", ("model",)
        )
        self.prefix_query.set_default_tags(dict(tags))
        self.tokens = metrics.Counter("mmserve_generated_tokens", "generated tokens", ("model",))
        self.tokens.set_default_tags(dict(tags))

    def observe_step(self, outputs: list[RequestOutput]) -> None:
        """Tokens the engine generated, whether or not a caller still listens (an un-aborted request
        shows up here)."""
        n = sum(len(out.new_token_ids) for out in outputs)
        if n:
            self.tokens.inc(n)

    def export(self, stats: dict[str, Any]) -> None:
        self.kv_blocks_in_use.set(stats["num_total_blocks"] - stats["num_free_blocks"])
        self.running.set(stats["num_running"])
        self.waiting.set(stats["num_waiting"])
        last = getattr(self, "_last", {"prefix_hit_tokens": 0, "prefix_query_tokens": 0})
        hit = stats["prefix_hit_tokens"] - last["prefix_hit_tokens"]
        query = stats["prefix_query_tokens"] - last["prefix_query_tokens"]
        if hit > 0:
            self.prefix_hit.inc(hit)
        if query > 0:
            self.prefix_query.inc(query)
        self._last = stats
