"""Ray Serve custom autoscaling policies for the encoder and LLM pools (the thin Ray-facing half).

Wiring (Ray Serve 2.60):

- Each replica reports its own numbers: Serve calls ``record_autoscaling_stats(self) -> dict[str, float]``
  (sync or async) on the deployment class and pushes the samples every ``autoscaling_config.metrics_interval_s``
  (default 10 s; Ray 2.60 reads only this field, the ``RAY_SERVE_*_AUTOSCALING_METRIC_PUSH_INTERVAL_S``
  env vars it names as replacements are not wired up yet; stats timeout
  ``RAY_SERVE_RECORD_AUTOSCALING_STATS_TIMEOUT_S`` = 10 s). Values must be int or float, or Serve disables
  the replica's stats. Only deployments with an ``autoscaling_config`` push them.
  ``EncoderServer`` returns ``{ENCODER_QUEUED_EMBEDDINGS: ...}``; ``LLMServer`` returns
  ``{LLM_KV_USAGE: ..., LLM_NUM_RUNNING: ..., LLM_NUM_WAITING: ..., LLM_QUEUED_PROMPT_TOKENS: ...,
  LLM_TTFT_P90_MS: ...}``.
- The deployment's ``autoscaling_config.policy`` names a class below, e.g.
  ``{policy_function: "cluster.autoscaling_policy:EncoderQueuePolicy", policy_kwargs: {...}}``;
  ``cluster/app.py`` sets it from ``AppConfig`` (each pool's default unless the config names one).
  Serve builds it once with ``policy_kwargs`` and calls ``instance(ctx)`` every control-loop tick with an
  ``AutoscalingContext``; ``ctx.aggregated_metrics[name][replica_id]`` is each replica's value averaged
  over ``look_back_period_s``. Serve then applies ``upscale_delay_s`` / ``downscale_delay_s``, the
  up/downscaling factors and the min/max bounds to what we return.

Until replicas report the custom metrics (an old image, or the first seconds of a replica), each policy
falls back to Serve's own signal, ongoing requests against ``target_ongoing_requests``.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import TYPE_CHECKING

from cluster.autoscaling import (
    EncoderTargets,
    Hysteresis,
    LLMReplicaLoad,
    LLMTargets,
    PrefillTargets,
    ScalingBounds,
    desired_encoder_replicas,
    desired_llm_replicas,
    desired_prefill_replicas,
    desired_replicas,
    with_ttft,
)

if TYPE_CHECKING:
    from ray.serve._private.common import ReplicaID
    from ray.serve.config import AutoscalingContext

logger = logging.getLogger("ray.serve")  # the controller's log: logs/serve/controller_<pid>.log

ENCODER_QUEUED_EMBEDDINGS = "queued_embeddings"
LLM_KV_USAGE = "kv_usage"
LLM_NUM_RUNNING = "num_running"
LLM_NUM_WAITING = "num_waiting"
LLM_QUEUED_PROMPT_TOKENS = "queued_prompt_tokens"  # E/P/D's prefill replicas
LLM_TTFT_P90_MS = "ttft_p90_ms"  # their recent time to a first token (llm_service/recent_ttft.py)

ENCODER_POLICY = "cluster.autoscaling_policy:EncoderQueuePolicy"
LLM_POLICY = "cluster.autoscaling_policy:LLMLoadPolicy"
PREFILL_POLICY = "cluster.autoscaling_policy:PrefillQueuePolicy"


def _bounds(ctx: AutoscalingContext) -> ScalingBounds:
    lo = int(ctx.capacity_adjusted_min_replicas)
    return ScalingBounds(lo, max(1, lo, int(ctx.capacity_adjusted_max_replicas)))


def _metric(ctx: AutoscalingContext, name: str) -> dict[ReplicaID, float]:
    return dict((ctx.aggregated_metrics or {}).get(name) or {})


class _ChangeLog:
    """One line in the controller's log each time a policy starts asking for a different count."""

    def __init__(self) -> None:
        self.last: int | None = None

    def __call__(self, ctx: AutoscalingContext, n: int, why: str) -> None:
        if n != ctx.target_num_replicas and n != self.last:
            logger.info(
                "%s wants %d replicas (now %d): %s", ctx.deployment_name, n, ctx.target_num_replicas, why
            )
        self.last = n if n != ctx.target_num_replicas else None


def _ongoing_requests_fallback(ctx: AutoscalingContext, hysteresis: Hysteresis) -> int:
    target = ctx.config.target_ongoing_requests or 2.0
    return desired_replicas(
        ctx.current_num_replicas,
        ctx.total_num_requests,
        target,
        _bounds(ctx),
        hysteresis,
        hold=ctx.target_num_replicas,
    )


class _BacklogPolicy:
    """Scale a pool on the work waiting in it, as its replicas report it under ``metric`` (plus requests
    still queued at handles); without reports, on ongoing requests."""

    metric: str
    what: str  # the reported work, for the log line
    desired: Callable[..., int]  # desired_encoder_replicas or desired_prefill_replicas
    targets: object
    hysteresis: Hysteresis

    def __init__(self) -> None:
        self._log = _ChangeLog()

    def __call__(self, ctx: AutoscalingContext) -> tuple[int, dict[str, object]]:
        queued = _metric(ctx, self.metric)
        if not queued:
            return _ongoing_requests_fallback(ctx, self.hysteresis), {}
        handles = ctx.total_queued_requests or 0.0
        n = type(self).desired(
            ctx.current_num_replicas,
            queued,
            handles,
            self.targets,
            _bounds(ctx),
            self.hysteresis,
            hold=ctx.target_num_replicas,
        )
        n, also = self._also(ctx, n)
        self._log(
            ctx,
            n,
            f"{sum(queued.values()):.0f} {self.what} on replicas, {handles:.1f} requests at handles{also}",
        )
        return n, {}

    def _also(self, ctx: AutoscalingContext, n: int) -> tuple[int, str]:
        """A second signal over the backlog's answer ``n`` (the prefill pool's TTFT): the count, and
        what it saw for the log line."""
        return n, ""


class EncoderQueuePolicy(_BacklogPolicy):
    """Scale the encoder pool on embeddings waiting to be computed."""

    metric, what, desired = ENCODER_QUEUED_EMBEDDINGS, "embeddings queued", desired_encoder_replicas

    def __init__(
        self,
        target_queued_embeddings_per_replica: float = 8192.0,
        embeddings_per_handle_queued_request: float = 1024.0,
        upscale_above: float = 1.1,
        downscale_below: float = 0.7,
    ) -> None:
        super().__init__()
        self.targets = EncoderTargets(
            target_queued_embeddings_per_replica, embeddings_per_handle_queued_request
        )
        self.hysteresis = Hysteresis(upscale_above, downscale_below)


class LLMLoadPolicy:
    """Scale the LLM pool on KV-cache use and running + waiting requests, whichever is tighter."""

    def __init__(
        self,
        target_kv_usage: float = 0.8,
        target_ongoing_requests: float = 16.0,
        upscale_above: float = 1.1,
        downscale_below: float = 0.7,
    ) -> None:
        self.targets = LLMTargets(target_kv_usage, target_ongoing_requests)
        self.hysteresis = Hysteresis(upscale_above, downscale_below)
        self._log = _ChangeLog()

    def __call__(self, ctx: AutoscalingContext) -> tuple[int, dict[str, object]]:
        kv = _metric(ctx, LLM_KV_USAGE)
        running = _metric(ctx, LLM_NUM_RUNNING)
        waiting = _metric(ctx, LLM_NUM_WAITING)
        replicas = set(kv) | set(running) | set(waiting)
        if not replicas:
            return _ongoing_requests_fallback(ctx, self.hysteresis), {}
        loads = {
            r: LLMReplicaLoad(kv.get(r, 0.0), running.get(r, 0.0), waiting.get(r, 0.0)) for r in replicas
        }
        n = desired_llm_replicas(
            ctx.current_num_replicas,
            loads,
            ctx.total_queued_requests or 0.0,
            self.targets,
            _bounds(ctx),
            self.hysteresis,
            hold=ctx.target_num_replicas,
        )
        self._log(
            ctx,
            n,
            f"KV use up to {max(v.kv_usage for v in loads.values()):.2f}, "
            f"{sum(v.num_running + v.num_waiting for v in loads.values()):.0f} requests running or waiting",
        )
        return n, {}


class PrefillQueuePolicy(_BacklogPolicy):
    """Scale E/P/D's prefill pool on prompt tokens still to compute (``queued_prompt_tokens``), and,
    given ``target_ttft_ms`` (0: not used), on its replicas' recent TTFT p90 (``ttft_p90_ms``): up
    while the slowest replica's stays over the target, down only when it and the backlog are under
    theirs (``cluster.autoscaling.with_ttft``)."""

    metric, what, desired = LLM_QUEUED_PROMPT_TOKENS, "prompt tokens to compute", desired_prefill_replicas

    def __init__(
        self,
        target_queued_prompt_tokens_per_replica: float = 8192.0,
        prompt_tokens_per_handle_queued_request: float = 1024.0,
        upscale_above: float = 1.1,
        downscale_below: float = 0.7,
        target_ttft_ms: float = 0.0,
    ) -> None:
        super().__init__()
        self.targets = PrefillTargets(
            target_queued_prompt_tokens_per_replica, prompt_tokens_per_handle_queued_request
        )
        self.hysteresis = Hysteresis(upscale_above, downscale_below)
        if target_ttft_ms < 0:
            raise ValueError(f"target_ttft_ms must be >= 0 (0: TTFT not used), got {target_ttft_ms}")
        self.target_ttft_ms = float(target_ttft_ms)

    def _also(self, ctx: AutoscalingContext, n: int) -> tuple[int, str]:
        ttft = _metric(ctx, LLM_TTFT_P90_MS)
        if not self.target_ttft_ms or not ttft:
            return n, ""
        n = with_ttft(
            n,
            ctx.current_num_replicas,
            ttft,
            self.target_ttft_ms,
            _bounds(ctx),
            self.hysteresis,
            hold=ctx.target_num_replicas,
        )
        return n, f", TTFT p90 up to {max(ttft.values()):.0f} ms (target {self.target_ttft_ms:.0f})"
