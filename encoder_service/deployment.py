"""The encoder side's Ray Serve replicas: ``PreprocessorServer`` (CPU pool) and ``EncoderPoolServer``.

Ray lives here; the logic they wrap (processing, runner, batching, cache books) does not import it.

EncoderPoolServer keeps a FIFO of items from every request it is sent and runs encoder steps that
never exceed ``max_num_encoder_input_tokens`` embeddings, so many small requests share one step
and one huge request cannot starve the rest for longer than a step. Its queue, in embeddings, is
what the encoder pool's request router balances on and what its autoscaling policy scales on.

The replica owns every embedding it puts (Ray has no ``ray.put(_owner=...)``), so its objects die
with it: ``OwnedEmbeddings`` keeps them alive while the shared cache index serves them and, on
graceful shutdown (Serve calls ``__del__``: scale-down, redeploy, ``serve.shutdown``), invalidates
their index entries so the index stops handing out refs that are about to be lost.
"""

from __future__ import annotations

import asyncio
import logging
from collections import deque
from collections.abc import Awaitable
from dataclasses import dataclass
from typing import Any

from encoder_service.owned_embeddings import OwnedEmbeddings
from encoder_service.types import EmbeddingMeta, EncodeBatch, EncodedItem, EncoderInput

logger = logging.getLogger("mmserve.encoder")


@dataclass
class _Queued:
    item: EncoderInput
    future: asyncio.Future[Any]


class EncoderPoolServer:
    """One replica = one TP group (leader here, ``mm_encoder_tp_size - 1`` worker actors)."""

    def __init__(
        self,
        model_dir: str,
        *,
        tp_size: int = 1,
        tp_mode: str = "weights",
        dtype: str = "float32",
        device: str = "auto",
        max_num_encoder_input_tokens: int = 8192,
        num_cpus_per_rank: float = 0.1,
        num_gpus_per_rank: float = 0.0,
        resources_per_rank: dict[str, float] | None = None,
        model_name: str = "",
        cache: Any = None,
    ) -> None:
        self._cache = cache  # EncoderCacheClient: invalidated on shutdown for the objects this replica owns
        self._owned = OwnedEmbeddings(cache)
        self._sweeper: asyncio.Task[None] | None = None
        self.max_num_encoder_input_tokens = max_num_encoder_input_tokens
        self.model_name = model_name
        if tp_size == 1:
            from encoder_service.runner import EncoderRunner

            self._runner: Any = EncoderRunner(model_dir, dtype=dtype, device=device, tp_mode=tp_mode)  # type: ignore[arg-type]
            self._group: Any = None
            self.hidden_size = self._runner.hidden_size
        else:
            from encoder_service.tp_group import EncoderTPGroup

            self._runner = None
            self._group = EncoderTPGroup(
                model_dir,
                tp_size=tp_size,
                tp_mode=tp_mode,  # type: ignore[arg-type]
                dtype=dtype,
                device=device,
                num_cpus_per_rank=num_cpus_per_rank,
                num_gpus_per_rank=num_gpus_per_rank,
                resources=resources_per_rank,
            )
            self.hidden_size = self._group.hidden_size
        self._queue: deque[_Queued] = deque()
        self._queued_embeds = 0
        self._wakeup: asyncio.Event | None = None
        self._task: asyncio.Task[None] | None = None
        self._metrics = _EncoderMetrics(model_name)

    async def encode(self, batch: EncodeBatch) -> list[EncodedItem]:
        """Embed ``batch.inputs``; returns refs into the object store, in order."""
        self._ensure_started()
        assert self._wakeup is not None
        loop = asyncio.get_running_loop()
        queued = [_Queued(item, loop.create_future()) for item in batch.inputs]
        for q in queued:
            if q.item.num_embeds > self.max_num_encoder_input_tokens:
                raise ValueError(
                    f"{q.item.modality} item {q.item.mm_hash[:12]} needs {q.item.num_embeds} embeddings, more than "
                    f"max_num_encoder_input_tokens={self.max_num_encoder_input_tokens}"
                )
        self._queue.extend(queued)
        self._queued_embeds += batch.num_embeds
        self._metrics.queued.set(self._queued_embeds)
        self._wakeup.set()
        return list(await asyncio.gather(*(q.future for q in queued)))

    def _ensure_started(self) -> None:
        if self._task is None or self._task.done():
            self._wakeup = asyncio.Event()
            self._task = asyncio.get_running_loop().create_task(self._run())
        if self._sweeper is None or self._sweeper.done():
            self._sweeper = asyncio.get_running_loop().create_task(self._owned.sweep_forever())

    def _next_step(self) -> list[_Queued]:
        """FIFO items up to the compute budget (the first item always goes, it was checked to fit)."""
        step: list[_Queued] = []
        total = 0
        while self._queue and (
            not step or total + self._queue[0].item.num_embeds <= self.max_num_encoder_input_tokens
        ):
            q = self._queue.popleft()
            if q.future.done():  # the caller was cancelled
                self._queued_embeds -= q.item.num_embeds
                continue
            step.append(q)
            total += q.item.num_embeds
        return step

    async def _encode(self, items: list[EncoderInput]) -> list[Any]:
        if self._group is not None:
            return list(await self._group.encode_async(items))
        return list(await asyncio.to_thread(self._runner.encode, items))

    async def _run(self) -> None:
        import ray

        assert self._wakeup is not None
        while True:
            step = self._next_step()
            if not step:
                self._wakeup.clear()
                await self._wakeup.wait()
                continue
            items = [q.item for q in step]
            try:
                outputs = await self._encode(items)
            except Exception as e:
                logger.exception("encoder step failed for %s", [i.mm_hash for i in items])
                outputs = [e] * len(items)
            for q, out in zip(step, outputs, strict=True):
                self._queued_embeds -= q.item.num_embeds
                if q.future.done():
                    continue
                if isinstance(out, Exception):
                    q.future.set_exception(out)
                    continue
                tensor = out.detach().contiguous().cpu()
                meta = EmbeddingMeta(
                    mm_hash=q.item.mm_hash,
                    modality=q.item.modality,
                    num_embeds=int(tensor.shape[0]),
                    hidden_size=int(tensor.shape[1]),
                    dtype=str(tensor.dtype).removeprefix("torch."),
                    grid_thw=q.item.grid_thw,
                )
                ref = ray.put(tensor)  # Ray 2.60 has no _owner=: this replica owns it
                self._owned.add(meta.mm_hash, ref)
                q.future.set_result(EncodedItem(meta, [ref]))
            self._metrics.items.inc(len(step))
            self._metrics.embeddings.inc(sum(i.num_embeds for i in items))
            self._metrics.queued.set(self._queued_embeds)

    async def invalidate_owned(self) -> int:
        """Drop the cache entries that hold this replica's objects; the number dropped. Never raises."""
        return await self._owned.invalidate_all()

    def __del__(self) -> Awaitable[int] | None:
        """Serve's graceful-shutdown hook: it awaits the coroutine returned here on the replica's loop.

        A plain ``def`` on purpose: the garbage collector also calls ``__del__``, where a coroutine
        would only warn. Outside a running event loop (GC, interpreter exit) it does nothing.
        """
        try:
            asyncio.get_running_loop()
        except RuntimeError:
            return None
        if getattr(self, "_cache", None) is None or not len(getattr(self, "_owned", ())):
            return None
        return self.invalidate_owned()

    def record_routing_stats(self) -> dict[str, Any]:
        return {"queued_embeddings": self._queued_embeds}

    def record_autoscaling_stats(self) -> dict[str, float]:
        return {"queued_embeddings": float(self._queued_embeds)}

    def stats(self) -> dict[str, Any]:
        return {"queued_embeddings": self._queued_embeds, "queued_items": len(self._queue)}


class _EncoderMetrics:
    def __init__(self, model: str) -> None:
        from ray.serve import metrics

        tags = {"model": model}
        self.queued = metrics.Gauge("mmserve_encoder_queued_embeddings", "embeddings waiting", ("model",))
        self.queued.set_default_tags(dict(tags))
        self.items = metrics.Counter("mmserve_encoder_items", "media items encoded", ("model",))
        self.items.set_default_tags(dict(tags))
        self.embeddings = metrics.Counter("mmserve_encoder_embeddings", "embeddings computed", ("model",))
        self.embeddings.set_default_tags(dict(tags))


class PreprocessorServer:
    """CPU pool replica: fetch, decode, hash, look up the shared encoder cache, process the misses."""

    def __init__(
        self,
        model_dir: str,
        *,
        limits: Any,
        limit_mm_per_prompt: dict[str, int],
        processor_cache_bytes: int,
        cache_name_prefix: str,
        cache_num_shards: int,
        cache_capacity: int,
        model_name: str = "",
    ) -> None:
        from encoder_service.cache_index import create_cache_index
        from encoder_service.processing import Preprocessor

        self.preprocessor = Preprocessor(
            model_dir, limits, limit_mm_per_prompt, processor_cache_bytes, model_id=model_name or None
        )
        self.cache = create_cache_index(
            cache_num_shards, cache_capacity, cache_name_prefix, detached=True, namespace="mmserve"
        )

    async def preprocess(self, messages: list[dict[str, Any]], use_cache: bool = True) -> Any:
        lookup = self.cache.lookup_meta if use_cache else None
        return await self.preprocessor.preprocess(messages, lookup)

    def stats(self) -> dict[str, Any]:
        return {
            "processor_calls": self.preprocessor.num_processor_calls,
            "processor_cache": self.preprocessor.processor_cache.stats(),
        }
