"""The LLM replica's Prometheus metrics (through Ray's metrics agent, scraped per node).

Per-stage latencies go to ``mmserve_stage_seconds{model, pool="llm", stage}`` (the family the
encoder pool and the ingress use too), each stage's metric object bound to its labels once:
``llm_queue``, ``prefill`` and ``decode`` once per finished request, ``engine_step`` once per step.
``MMSERVE_STAGE_METRICS=0`` (in the replicas' environment) turns them off.
"""

from __future__ import annotations

import os
from typing import TYPE_CHECKING

from llm_service.outputs import EngineStats, RequestOutput

if TYPE_CHECKING:
    from ray.util.metrics import Histogram

STAGE_METRIC = "mmserve_stage_seconds"  # the same family as encoder_service.serve.metrics'
STAGE_BUCKETS = [0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30]


def stage_metrics_on() -> bool:
    return os.environ.get("MMSERVE_STAGE_METRICS", "1").strip().lower() not in ("0", "false", "no", "off")


def _stage(model: str, stage: str) -> Histogram:
    from ray.util.metrics import Histogram

    hist = Histogram(
        STAGE_METRIC, "time spent in one stage of a request", STAGE_BUCKETS, ("model", "pool", "stage")
    )
    return hist.set_default_tags({"model": model, "pool": "llm", "stage": stage})


class LLMMetrics:
    """Prometheus metrics through Ray (scraped from each node's metrics port)."""

    def __init__(self, model: str) -> None:
        from ray.serve import metrics

        tags = {"model": model}
        self._last: EngineStats | None = None  # what ``export`` counted up to
        self.kv_blocks_in_use = metrics.Gauge(
            "mmserve_kv_blocks_in_use", "KV blocks held by requests", ("model",)
        )
        self.kv_blocks_in_use.set_default_tags(dict(tags))
        self.kv_usage = metrics.Gauge(
            "mmserve_kv_usage", "fraction of KV blocks held by requests", ("model",)
        )
        self.kv_usage.set_default_tags(dict(tags))
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
        # the engine step thread's time in its steps, CPU and wall (mmcore/step_clock.py): the share
        # of a core the steps got. The same families as the encoder pool's (pool="encoder"), so the
        # same label keys: ray.util.metrics, not ray.serve.metrics (which adds the replica's tags).
        from ray.util.metrics import Counter

        step_tags = {"model": model, "pool": "llm"}
        self.step_cpu = Counter(
            "mmserve_step_cpu_seconds", "CPU time of a pool's step thread in its steps", ("model", "pool")
        )
        self.step_cpu.set_default_tags(step_tags)
        self.step_wall = Counter(
            "mmserve_step_wall_seconds", "wall time of a pool's steps", ("model", "pool")
        )
        self.step_wall.set_default_tags(step_tags)
        self.stages = stage_metrics_on()
        if self.stages:
            self.llm_queue = _stage(model, "llm_queue")
            self.prefill = _stage(model, "prefill")
            self.decode = _stage(model, "decode")
            self.engine_step = _stage(model, "engine_step")

    def observe_step(
        self, outputs: list[RequestOutput], step_s: float | None = None, step_cpu_s: float | None = None
    ) -> None:
        """Tokens the engine generated, whether or not a caller still listens (an un-aborted request
        shows up here); the step's time (wall, and CPU of its thread) and each finished request's stages."""
        n = 0
        for out in outputs:
            n += len(out.new_token_ids)
            if out.timing is not None and self.stages:
                self.llm_queue.observe(out.timing.queue)
                self.prefill.observe(out.timing.prefill)
                self.decode.observe(out.timing.decode)
        if n:
            self.tokens.inc(n)
        if step_s is not None and self.stages:
            self.engine_step.observe(step_s)
        if step_s is not None:  # a step ran: its clock's last CPU time is this step's
            self.step_wall.inc(step_s)
            if step_cpu_s:
                self.step_cpu.inc(step_cpu_s)

    def export(self, stats: EngineStats) -> None:
        self.kv_blocks_in_use.set(stats.num_total_blocks - stats.num_free_blocks)
        self.kv_usage.set(stats.kv_usage)
        self.running.set(stats.num_running)
        self.waiting.set(stats.num_waiting)
        last = self._last
        hit = stats.prefix_hit_tokens - (0 if last is None else last.prefix_hit_tokens)
        query = stats.prefix_query_tokens - (0 if last is None else last.prefix_query_tokens)
        if hit > 0:
            self.prefix_hit.inc(hit)
        if query > 0:
            self.prefix_query.inc(query)
        self._last = stats
