"""Autoscaling decisions for the encoder and LLM pools: pure logic, no Ray import.

Each pool scales on its own signal:

- **encoder pool**: embeddings waiting to be computed (``queued_embeddings`` reported by every
  ``EncoderServer`` replica), plus requests still queued at the callers' handles, against a target
  backlog per replica;
- **prefill pool** (E/P/D): prompt tokens still to compute (``queued_prompt_tokens``: waiting and
  partly prefilled prompts on every replica), plus requests queued at the handles, against a target
  backlog per replica (the time to a first token grows with it); and, given a ``target_ttft_ms``,
  its replicas' recent TTFT p90 (``ttft_p90_ms``): one replica more while it stays over the target,
  no fewer while it is near it (:func:`with_ttft`);
- **LLM pool** (and E/P/D's decode pool): its own load, the larger of KV-cache use (``kv_usage`` against ``target_kv_usage``)
  and requests per replica (``num_running + num_waiting`` against ``target_ongoing_requests``).

Every decision goes through :func:`desired_replicas`, which holds a deadband around the target so the
pool does not flap::

    load per replica / target:   0 ─── downscale_below ─── 1 ─── upscale_above ───▶
    decision:                    shrink to fit ─┤  hold  ├─ grow to fit

When it moves, it moves straight to ``ceil(total_load / target)`` replicas, so right after a move the
load per replica is at most the target: inside the deadband, never past ``upscale_above``.
The Ray adapter (``cluster/autoscaling_policy.py``) adds nothing but metric plumbing; Ray itself
applies ``upscale_delay_s`` / ``downscale_delay_s`` on top of these decisions.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import TypeVar

ReplicaKey = TypeVar("ReplicaKey")  # what names a replica (Ray's ReplicaID in the policy): only counted here


@dataclass(frozen=True)
class ScalingBounds:
    min_replicas: int
    max_replicas: int

    def __post_init__(self) -> None:
        if self.min_replicas < 0 or self.max_replicas < 1 or self.min_replicas > self.max_replicas:
            raise ValueError(
                f"need 0 <= min_replicas <= max_replicas and max_replicas >= 1, "
                f"got min={self.min_replicas} max={self.max_replicas}"
            )

    def clamp(self, n: int) -> int:
        return max(self.min_replicas, min(self.max_replicas, n))


@dataclass(frozen=True)
class Hysteresis:
    """Deadband around the target, as fractions of it: hold while ``downscale_below <= ratio <= upscale_above``."""

    upscale_above: float = 1.1
    downscale_below: float = 0.7

    def __post_init__(self) -> None:
        if not 0 < self.downscale_below <= 1 <= self.upscale_above:
            raise ValueError(
                f"need 0 < downscale_below <= 1 <= upscale_above, "
                f"got {self.downscale_below} and {self.upscale_above}"
            )


def desired_replicas(
    running: int,
    total_load: float,
    target_per_replica: float,
    bounds: ScalingBounds,
    hysteresis: Hysteresis = Hysteresis(),
    hold: int | None = None,
) -> int:
    """Replicas wanted for ``total_load`` (any unit) at ``target_per_replica`` of it per replica.

    ``running`` replicas carry the load now; ``hold`` is what to keep inside the deadband (the last
    decision, default ``running``). The result is clamped to ``bounds``.

    While a scale-up is still starting replicas (``hold > running``) the answer is never below
    ``hold``: the load per *running* replica says nothing about a pool that has not come up yet, and a
    lower answer held for Serve's downscale delay cancels a replica that has spent most of its start
    (on a busy 2-core host a start takes 20–45 s; one cancelled there took 47 s to start again). The
    pool shrinks, if it must, once what it asked for is running.
    """
    if target_per_replica <= 0:
        raise ValueError(f"target_per_replica must be > 0, got {target_per_replica}")
    total_load = max(0.0, total_load)
    keep = running if hold is None else hold
    fit = math.ceil(total_load / target_per_replica)
    if running <= 0:
        # Nothing to measure per replica: start enough for the load (at least one if there is any).
        return bounds.clamp(max(keep, fit))
    ratio = total_load / (target_per_replica * running)
    if ratio > hysteresis.upscale_above or ratio < hysteresis.downscale_below:
        return bounds.clamp(fit if keep <= running else max(fit, keep))
    return bounds.clamp(keep)


# ─── encoder pool ──────────────────────────────────────────────────────────────────────────────


@dataclass(frozen=True)
class EncoderTargets:
    """``target_queued_embeddings_per_replica``: the backlog one replica should carry (its batch
    budget ``max_num_encoder_input_tokens`` times a few batches is a good start).
    ``embeddings_per_handle_queued_request``: what a request still queued at a handle (not yet
    reached any replica, so not in ``queued_embeddings``) is assumed to cost."""

    target_queued_embeddings_per_replica: float = 8192.0
    embeddings_per_handle_queued_request: float = 1024.0

    def __post_init__(self) -> None:
        if self.target_queued_embeddings_per_replica <= 0:
            raise ValueError("target_queued_embeddings_per_replica must be > 0")
        if self.embeddings_per_handle_queued_request < 0:
            raise ValueError("embeddings_per_handle_queued_request must be >= 0")


def queue_backlog(queued: Iterable[float], handle_queued_requests: float, per_handle_request: float) -> float:
    """Work waiting in a pool: what its replicas report plus an estimate for requests still queued at
    handles (each assumed to cost ``per_handle_request``)."""
    return sum(max(0.0, q) for q in queued) + max(0.0, handle_queued_requests) * per_handle_request


def encoder_backlog(
    queued_embeddings: Iterable[float], handle_queued_requests: float, targets: EncoderTargets
) -> float:
    """Embeddings waiting in the pool: reported by replicas plus an estimate for handle queues."""
    return queue_backlog(
        queued_embeddings, handle_queued_requests, targets.embeddings_per_handle_queued_request
    )


def desired_encoder_replicas(
    running: int,
    queued_embeddings: Mapping[ReplicaKey, float],
    handle_queued_requests: float,
    targets: EncoderTargets,
    bounds: ScalingBounds,
    hysteresis: Hysteresis = Hysteresis(),
    hold: int | None = None,
) -> int:
    """``queued_embeddings``: replica id → embeddings waiting on that replica."""
    backlog = encoder_backlog(queued_embeddings.values(), handle_queued_requests, targets)
    return desired_replicas(
        running, backlog, targets.target_queued_embeddings_per_replica, bounds, hysteresis, hold
    )


# ─── LLM pool ──────────────────────────────────────────────────────────────────────────────────


@dataclass(frozen=True)
class LLMReplicaLoad:
    """What one LLMServer replica reports: KV blocks in use / total (0..1), running and waiting requests."""

    kv_usage: float = 0.0
    num_running: float = 0.0
    num_waiting: float = 0.0


@dataclass(frozen=True)
class LLMTargets:
    target_kv_usage: float = 0.8
    target_ongoing_requests: float = 16.0

    def __post_init__(self) -> None:
        if not 0 < self.target_kv_usage <= 1:
            raise ValueError(f"target_kv_usage must be in (0, 1], got {self.target_kv_usage}")
        if self.target_ongoing_requests <= 0:
            raise ValueError("target_ongoing_requests must be > 0")


def llm_pressure(load: LLMReplicaLoad, targets: LLMTargets) -> float:
    """One replica's load in units of its target (1.0 = exactly at target), on whichever
    resource is tighter: KV memory or request slots."""
    kv = max(0.0, load.kv_usage) / targets.target_kv_usage
    requests = max(0.0, load.num_running + load.num_waiting) / targets.target_ongoing_requests
    return max(kv, requests)


def desired_llm_replicas(
    running: int,
    loads: Mapping[ReplicaKey, LLMReplicaLoad],
    handle_queued_requests: float,
    targets: LLMTargets,
    bounds: ScalingBounds,
    hysteresis: Hysteresis = Hysteresis(),
    hold: int | None = None,
) -> int:
    """``loads``: replica id → its load; ``handle_queued_requests``: requests queued at the callers'
    handles, not on any replica yet. Replicas that have not reported yet (just started) are assumed as
    loaded as the mean of those that have, not idle, so a scale-up is not undone at once. With no
    report at all there is nothing to decide on: keep ``hold``."""
    if not loads:
        return bounds.clamp(running if hold is None else hold)
    mean = sum(llm_pressure(v, targets) for v in loads.values()) / len(loads)
    queued = max(0.0, handle_queued_requests) / targets.target_ongoing_requests
    total = mean * max(running, len(loads)) + queued
    return desired_replicas(running, total, 1.0, bounds, hysteresis, hold)


# ─── E/P/D's prefill pool ────────────────────────────────────────────────────────────────────────


@dataclass(frozen=True)
class PrefillTargets:
    """``target_queued_prompt_tokens_per_replica``: the prompt backlog one prefill replica should carry
    (a few steps of ``max_num_batched_tokens``: its time to a first token grows with it);
    ``prompt_tokens_per_handle_queued_request``: what a request still queued at a handle is assumed to cost."""

    target_queued_prompt_tokens_per_replica: float = 8192.0
    prompt_tokens_per_handle_queued_request: float = 1024.0

    def __post_init__(self) -> None:
        if self.target_queued_prompt_tokens_per_replica <= 0:
            raise ValueError("target_queued_prompt_tokens_per_replica must be > 0")
        if self.prompt_tokens_per_handle_queued_request < 0:
            raise ValueError("prompt_tokens_per_handle_queued_request must be >= 0")


def desired_prefill_replicas(
    running: int,
    queued_prompt_tokens: Mapping[ReplicaKey, float],
    handle_queued_requests: float,
    targets: PrefillTargets,
    bounds: ScalingBounds,
    hysteresis: Hysteresis = Hysteresis(),
    hold: int | None = None,
) -> int:
    """``queued_prompt_tokens``: replica id → prompt tokens it has still to compute."""
    backlog = queue_backlog(
        queued_prompt_tokens.values(), handle_queued_requests, targets.prompt_tokens_per_handle_queued_request
    )
    return desired_replicas(
        running, backlog, targets.target_queued_prompt_tokens_per_replica, bounds, hysteresis, hold
    )


def with_ttft(
    backlog_answer: int,
    running: int,
    ttft_p90_ms: Mapping[ReplicaKey, float],
    target_ttft_ms: float,
    bounds: ScalingBounds,
    hysteresis: Hysteresis = Hysteresis(),
    hold: int | None = None,
) -> int:
    """The prefill pool's count once its TTFT has its say over the backlog's answer. ``ttft_p90_ms``:
    replica id → its recent TTFT p90 (0 with no first token in its window); the slowest one counts,
    as a fraction of ``target_ttft_ms`` and with the backlog's deadband:

        ratio:    0 ─── downscale_below ─── 1 ─── upscale_above ───▶
        answer:   the backlog's ─┤ not below ``hold`` ├─ one more than running (or ``hold``), at least

    So the pool grows while its TTFT stays over the target, even with a short backlog, and shrinks
    only when both the backlog and the TTFT are under theirs. One replica at a time: TTFT is not
    proportional to the replicas (a lone long prompt's prefill takes what it takes), and a scale-up
    still starting (``hold > running``) adds none. No report, or no replica running: the backlog's."""
    if target_ttft_ms <= 0:
        raise ValueError(f"target_ttft_ms must be > 0, got {target_ttft_ms}")
    if not ttft_p90_ms or running <= 0:
        return backlog_answer
    ratio = max(max(ttft_p90_ms.values()), 0.0) / target_ttft_ms
    keep = running if hold is None else hold
    if ratio > hysteresis.upscale_above:
        return bounds.clamp(max(backlog_answer, keep, running + 1))
    if ratio >= hysteresis.downscale_below:
        return bounds.clamp(max(backlog_answer, keep))
    return backlog_answer
