"""An encoder replica's FIFO and the loop that runs it in steps (``EncoderSteps``); Ray's ``put`` of
each step's outputs (``stored_form``). ``serve/deployment.py``'s ``EncoderServer`` drives it.

Items from every request the replica is sent share one FIFO; a step never exceeds
``max_num_encoder_input_tokens`` embeddings, so many small requests share one step and one huge
request cannot starve the rest for longer than a step. On CPU a step also ends once it holds
``CPU_STEP_EMBEDS`` (encoder_queue.py says why); on a GPU, where batching pays, it fills the budget.
The FIFO's embeddings are what the encoder pool's request router balances on and what its
autoscaling policy scales on. The step policy is ``EncoderQueue``'s (pure); this module runs it.
"""

from __future__ import annotations

import asyncio
import contextvars
import logging
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING

from encoder_service.cache.cache_index import ref_id
from encoder_service.cache.owned_embeddings import OwnedEmbeddings
from encoder_service.encode.encoder_queue import EncoderQueue
from encoder_service.encode.recent_values import RecentValues, value_key
from encoder_service.preprocess import tracing
from encoder_service.serve.metrics import EncoderMetrics
from encoder_service.types import EmbeddingMeta, EncodeBatch, EncodedItem, EncoderInput
from mmcore.step_clock import StepClock

if TYPE_CHECKING:
    import numpy as np
    import torch
    from opentelemetry.context import Context

    from encoder_service.cache.cache_client import EncoderCacheClient
    from encoder_service.encode.runner import EncoderRunner, TPMode
    from encoder_service.encode.tp_group import EncoderTPGroup

logger = logging.getLogger("mmserve.encoder")

DRAIN_TIMEOUT_S = 25.0  # under Serve's graceful_shutdown_timeout_s (30 s by default)
# Steps end at this many embeddings on CPU: the tiny tower's throughput is flat from ~4 small images
# up (33.1k embeddings/s at 4, 33.5k at 16, 31.1k at 32; 20.6k at 1), and image c=32 TTFT fell.
CPU_STEP_EMBEDS = 256


@dataclass
class _Queued:
    item: EncoderInput
    request_id: str
    future: asyncio.Future[EncodedItem]
    queued_at: float = 0.0  # time.perf_counter() at its push on the FIFO
    trace: Context | None = None  # its request's trace context, if sampled (the step runs in another task)
    apart: bool = False  # its request's items go one step each (EncoderQueue's ``apart``)

    @property
    def num_embeds(self) -> int:
        return self.item.num_embeds


class EncoderSteps:
    """One replica's tower (a runner here, or a TP group of actors) fed by its FIFO. Each step's
    outputs are put in the object store as one object, owned by this replica (``owned``: kept alive
    while the cache index serves them), the small ones kept for sending inline (``recent``), and
    committed to the shared cache (``cache``) under their requests' reservations."""

    def __init__(
        self,
        model_dir: str,
        *,
        tp_size: int,
        tp_mode: TPMode,
        dtype: str,
        device: str,
        max_num_encoder_input_tokens: int,
        num_cpus_per_rank: float,
        num_gpus_per_rank: float,
        resources_per_rank: dict[str, float] | None,
        cache: EncoderCacheClient | None,
        max_queued_embeddings: int | None,
        step_embeds: int | None,
        metrics: EncoderMetrics,
    ) -> None:
        self._cache = cache  # EncoderCacheClient: outputs are committed to it
        self.owned = OwnedEmbeddings(cache)
        self.recent = RecentValues()  # small outputs' values, for the requests forwarded from here
        self._sweeper: asyncio.Task[None] | None = None
        self._metrics = metrics
        # The tower's steps run on a thread of their own: on the loop's default executor a step could
        # queue behind every item waiting to be preprocessed (a burst of 32 four-image requests puts
        # 128 there). On the tiny model's 4-image c=32 load no difference showed outside the noise.
        self._step_thread = ThreadPoolExecutor(max_workers=1, thread_name_prefix="encoder-step")
        self.step_clock = StepClock()  # its steps' wall and CPU time: the share of a core they got
        if tp_size == 1:
            from encoder_service.encode.runner import EncoderRunner

            self.runner: EncoderRunner | None = EncoderRunner(
                model_dir, dtype=dtype, device=device, tp_mode=tp_mode
            )
            self._group: EncoderTPGroup | None = None
            self.hidden_size = self.runner.hidden_size
        else:
            from encoder_service.encode.tp_group import EncoderTPGroup

            self.runner = None
            self._group = EncoderTPGroup(
                model_dir,
                tp_size=tp_size,
                tp_mode=tp_mode,
                dtype=dtype,
                device=device,
                num_cpus_per_rank=num_cpus_per_rank,
                num_gpus_per_rank=num_gpus_per_rank,
                resources=resources_per_rank,
            )
            self.hidden_size = self._group.hidden_size
        from encoder_service.families import row_units

        self.row_units = row_units(model_dir, None)  # what the cache charges per embedding
        on_gpu = num_gpus_per_rank > 0 or (self.runner is not None and self.runner.device.type != "cpu")
        self._queue: EncoderQueue[_Queued] = EncoderQueue(
            max_num_encoder_input_tokens,
            lambda q: q.future.done(),
            max_queued_embeddings,
            step_embeds=step_embeds or (None if on_gpu else CPU_STEP_EMBEDS),
            apart=lambda q: q.request_id if q.apart else None,
        )
        self._wakeup: asyncio.Event | None = None
        self._task: asyncio.Task[None] | None = None
        self._commits: set[asyncio.Task[None]] = set()  # index commits in flight

    @property
    def queued_embeds(self) -> int:
        return self._queue.queued_embeds

    @property
    def queued_items(self) -> int:
        return len(self._queue)

    def submit(self, batch: EncodeBatch, *, apart: bool = False) -> list[asyncio.Future[EncodedItem]]:
        """``batch``'s items on the FIFO, one future per input, each done when its own step is (a request's items go on
        the FIFO in prompt order, so its first item is ready first). Raises ``EncoderQueueFull``
        before queueing any; cancelling a future takes its item off the FIFO if not yet stepped.
        ``apart``: the items go one step each (a request handed on item by item: overlap prefill)."""
        self._ensure_started()
        assert self._wakeup is not None
        loop = asyncio.get_running_loop()
        queued = [_Queued(item, batch.request_id, loop.create_future(), apart=apart) for item in batch.inputs]
        for q in queued:
            self._queue.check(q, f"{q.item.modality} item {q.item.mm_hash[:12]}")
        self._queue.admit(queued)
        now, trace = time.perf_counter(), tracing.current()
        for q in queued:
            q.queued_at, q.trace = now, trace
            self._queue.push(q)
        self._metrics.queued.set(self.queued_embeds)
        self._wakeup.set()
        return [q.future for q in queued]

    def _ensure_started(self) -> None:
        if self._task is None or self._task.done():
            self._wakeup = asyncio.Event()
            # in a context of its own, not the first caller's: no request's trace is the loop's
            self._task = asyncio.get_running_loop().create_task(self._run(), context=contextvars.Context())
        if self._sweeper is None or self._sweeper.done():
            self._sweeper = asyncio.get_running_loop().create_task(self.owned.sweep_forever())

    async def _encode(self, items: list[EncoderInput]) -> list[torch.Tensor]:
        if self._group is not None:
            return list(await self._group.encode_async(items))
        assert self.runner is not None  # one or the other (__init__)
        loop = asyncio.get_running_loop()
        outputs = await loop.run_in_executor(
            self._step_thread, self.step_clock.run, self.runner.encode, items
        )
        self._metrics.steps.observe(self.step_clock.last_wall_s, self.step_clock.last_cpu_s)
        return list(outputs)

    async def _run(self) -> None:
        assert self._wakeup is not None
        while True:
            step = self._queue.next_step()
            if not step:
                self._wakeup.clear()
                await self._wakeup.wait()
                continue
            try:
                await self._run_step(step)
            except Exception as e:  # a failing step fails its own items only; the loop goes on
                logger.exception("encoder step failed for %s", [q.item.mm_hash for q in step])
                for q in step:
                    if not q.future.done():
                        q.future.set_exception(e)
            finally:
                self._queue.done(step)
                self._metrics.queued.set(self.queued_embeds)

    async def _run_step(self, step: list[_Queued]) -> None:
        import ray

        items = [q.item for q in step]
        start = time.perf_counter()
        # Each item's wait ends and the step's span begins at ``start`` (``ago``), not whenever their
        # observation runs: the observations in between cannot put a request's spans out of order.
        for q in step:
            waited, ago = start - q.queued_at, time.perf_counter() - start
            self._metrics.encoder_queue.observe(waited, ago=ago, mm_hash=q.item.mm_hash, parent=q.trace)
        outputs = await self._encode(items)
        end = time.perf_counter()
        took = end - start
        self._metrics.encode.observe(took)  # the loop's own context: no span
        for q in step:  # the step's span in each traced request's trace
            if q.trace is not None:
                tracing.stage_span(
                    "encode", took, ago=time.perf_counter() - end, mm_hash=q.item.mm_hash, parent=q.trace
                )
        tensors = [out.detach().contiguous().cpu() for out in outputs]
        stored = [stored_form(t) for t in tensors]
        # One object per step, every item a part of it (a put costs its caller and the raylet about
        # as much as a 4-image request's tower does); an item alone is the object itself.
        ref = ray.put(stored if len(stored) > 1 else stored[0])  # Ray has no _owner=: this replica owns it
        done: list[tuple[_Queued, EncodedItem]] = []
        for i, (q, tensor) in enumerate(zip(step, tensors, strict=True)):
            part = i if len(stored) > 1 else None
            meta = EmbeddingMeta.of(
                q.item.mm_hash,
                q.item.modality,
                replace(q.item.facts, num_embeds=int(tensor.shape[0])),
                hidden_size=int(tensor.shape[1]),
                dtype=str(tensor.dtype).removeprefix("torch."),
                units=self.row_units,
                part=part,
            )
            self.owned.add(meta.mm_hash, ref)
            self.recent.put(value_key(ref_id(ref), part), stored[i], tensor.numel() * tensor.element_size())
            done.append((q, EncodedItem(meta, [ref])))
        if self._cache is not None:  # the callers' reservations become committed entries
            self._commit_soon([(e.meta, e.ref[0], q.request_id) for q, e in done])
        for q, e in done:  # the callers hold the refs: they need not wait for the index
            if not q.future.done():
                q.future.set_result(e)
        self._metrics.items.inc(len(step))
        self._metrics.embeddings.inc(sum(i.num_embeds for i in items))

    def _commit_soon(self, commits: list[tuple[EmbeddingMeta, object, str | None]]) -> None:
        """Commit a step's outputs without holding up its callers or the next step.

        Sent before the callers resume (the task starts before their futures' callbacks run), so a
        lookup a caller makes afterwards reaches the shard after it. A commit that fails leaves the
        reservations to their lease: a waiter takes the item over when it ends.
        """

        cache = self._cache
        assert cache is not None  # called only with a cache (_run_step)

        async def commit() -> None:
            try:
                await cache.commit_many(commits)
            except Exception:
                logger.exception(
                    "committing %s to the encoder cache failed", [m.mm_hash for m, _, _ in commits]
                )

        task = asyncio.get_running_loop().create_task(commit())
        self._commits.add(task)
        task.add_done_callback(self._commits.discard)

    async def drain(self, timeout_s: float = DRAIN_TIMEOUT_S) -> bool:
        """Wait until every queued item is computed (their callers are waiting) and its index commit
        has landed; False on timeout."""
        deadline = asyncio.get_running_loop().time() + timeout_s
        while self._queue.queued_embeds > 0 and self._task is not None and not self._task.done():
            if asyncio.get_running_loop().time() > deadline:
                logger.warning("encoder drain timed out with %d embeddings queued", self.queued_embeds)
                return False
            await asyncio.sleep(0.05)
        if self._commits:  # entries of this replica's last steps still on their way to the index
            _, pending = await asyncio.wait(
                set(self._commits), timeout=max(0.0, deadline - asyncio.get_running_loop().time())
            )
            if pending:
                logger.warning("encoder drain timed out with %d index commits in flight", len(pending))
                return False
        return True

    def check_health(self) -> None:
        task = self._task
        if task is not None and task.done():
            why = "cancelled" if task.cancelled() else repr(task.exception())
            raise RuntimeError(f"encoder loop died: {why}")


def stored_form(tensor: torch.Tensor) -> np.ndarray | tuple[str, np.ndarray]:
    """What the object store holds for one item's embeddings: a numpy array, which Ray stores as one
    out-of-band buffer and hands back zero-copy (a torch tensor is pickled through ``torch.save``:
    measured 1.06 vs 0.67 CPU-ms a put and 0.18 vs 0.07 a get, 64 x 128 float32). A dtype numpy
    lacks (bfloat16) goes as its bits in a same-width integer array beside its name.
    ``llm_service.embeddings.from_stored`` reads it back."""
    import torch

    if tensor.dtype == torch.bfloat16:
        return ("bfloat16", tensor.view(torch.int16).numpy())
    return tensor.numpy()
