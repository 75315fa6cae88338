"""The encoder pool's Prometheus metrics (through Ray's metrics agent, scraped per node).

Per-stage latencies all go to one histogram family, ``mmserve_stage_seconds{model, pool, stage}``;
each (model, pool, stage) gets its own metric object with its labels set once, so an observation
builds no label map. ``MMSERVE_STAGE_METRICS=0`` (in the replicas' environment) turns them off:
nothing is timed then.
"""

from __future__ import annotations

import os
from typing import TYPE_CHECKING

from encoder_service.preprocess.stage_timing import CacheLookups, MediaStages, Stage

if TYPE_CHECKING:
    from ray.util.metrics import Counter, Histogram

STAGE_METRIC = "mmserve_stage_seconds"
STAGE_TAGS = ("model", "pool", "stage")
# 0.5 ms (a near-cache lookup) to 30 s (a slow fetch or a long video's encode)
STAGE_BUCKETS = [0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30]
STAGE_METRICS_ENV = "MMSERVE_STAGE_METRICS"
STEP_CPU_METRIC = "mmserve_step_cpu_seconds"
STEP_WALL_METRIC = "mmserve_step_wall_seconds"


def stage_metrics_on() -> bool:
    """Per-stage timings are on unless ``MMSERVE_STAGE_METRICS=0``."""
    return os.environ.get(STAGE_METRICS_ENV, "1").strip().lower() not in ("0", "false", "no", "off")


def stage_histogram(model: str, pool: str, stage: str) -> Histogram:
    """``mmserve_stage_seconds`` with its labels bound: ``.observe(seconds)``."""
    from ray.util.metrics import Histogram

    hist = Histogram(STAGE_METRIC, "time spent in one stage of a request", STAGE_BUCKETS, STAGE_TAGS)
    return hist.set_default_tags({"model": model, "pool": pool, "stage": stage})


def stage(model: str, pool: str, name: str) -> Stage:
    """A stage's observer: its histogram (None when stage metrics are off) and its spans."""
    return Stage(name, stage_histogram(model, pool, name) if stage_metrics_on() else None)


def media_stages(model: str, pool: str) -> MediaStages:
    """The preparing side's stages for ``model`` where ``pool`` ("ingress": the hit path, "encoder")
    runs them."""
    from ray.util.metrics import Counter

    def lookups(result: str) -> Counter:
        c = Counter(
            "mmserve_encoder_cache_lookups",
            "media items looked up in the encoder cache, by answer",
            ("model", "pool", "result"),
        )
        return c.set_default_tags({"model": model, "pool": pool, "result": result})

    on = stage_metrics_on()
    return MediaStages(
        fetch=stage(model, pool, "fetch"),
        media_decode=stage(model, pool, "media_decode"),
        preprocess=stage(model, pool, "preprocess"),
        cache_lookup=stage(model, pool, "cache_lookup"),
        cache_wait=stage(model, pool, "cache_wait"),
        lookups=CacheLookups(hit=lookups("hit"), miss=lookups("miss"), wait=lookups("wait")) if on else None,
    )


class EncoderMetrics:
    def __init__(self, model: str) -> None:
        from ray.serve import metrics

        tags = {"model": model}
        self.queued = metrics.Gauge("mmserve_encoder_queued_embeddings", "embeddings waiting", ("model",))
        self.queued.set_default_tags(dict(tags))
        self.items = metrics.Counter("mmserve_encoder_items", "media items encoded", ("model",))
        self.items.set_default_tags(dict(tags))
        self.embeddings = metrics.Counter("mmserve_encoder_embeddings", "embeddings computed", ("model",))
        self.embeddings.set_default_tags(dict(tags))
        # per item, from its push on the FIFO to the start of the step that encodes it
        self.encoder_queue = stage(model, "encoder", "encoder_queue")
        self.encode = stage(model, "encoder", "encode")  # per step (a span per item of the step)
        self.steps = StepCounters(model, "encoder")


class StepCounters:
    """``mmserve_step_cpu_seconds`` and ``mmserve_step_wall_seconds{model, pool}``: a pool's step
    thread's time in its steps, in its own CPU time and in wall time (mmcore/step_clock.py); their
    rates' ratio is the share of a core the steps got."""

    def __init__(self, model: str, pool: str) -> None:
        from ray.util.metrics import Counter

        tags = {"model": model, "pool": pool}
        self.cpu = Counter(
            STEP_CPU_METRIC, "CPU time of a pool's step thread in its steps", ("model", "pool")
        )
        self.cpu.set_default_tags(tags)
        self.wall = Counter(STEP_WALL_METRIC, "wall time of a pool's steps", ("model", "pool"))
        self.wall.set_default_tags(tags)

    def observe(self, wall_s: float, cpu_s: float) -> None:
        self.wall.inc(wall_s)
        if cpu_s > 0:
            self.cpu.inc(cpu_s)
