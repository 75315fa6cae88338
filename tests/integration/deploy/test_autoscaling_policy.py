"""The Ray adapter, driven with Ray Serve's own AutoscalingContext and AutoscalingConfig (no cluster)."""

from __future__ import annotations

from typing import Any

import pytest
from ray.serve._private.common import DeploymentID
from ray.serve.config import AutoscalingConfig, AutoscalingContext

from cluster.autoscaling_policy import (
    ENCODER_POLICY,
    ENCODER_QUEUED_EMBEDDINGS,
    LLM_KV_USAGE,
    LLM_NUM_RUNNING,
    LLM_NUM_WAITING,
    LLM_POLICY,
    EncoderQueuePolicy,
    LLMLoadPolicy,
)


def _ctx(
    metrics: dict[str, dict[str, float]] | None,
    *,
    running: int,
    target: int | None = None,
    ongoing: float = 0.0,
    queued: float = 0.0,
    lo: int = 1,
    hi: int = 8,
) -> AutoscalingContext:
    config = AutoscalingConfig(min_replicas=lo, max_replicas=hi, target_ongoing_requests=4)
    return AutoscalingContext(
        deployment_id=DeploymentID(name="EncoderServer-m", app_name="mmserve"),
        deployment_name="EncoderServer-m",
        app_name="mmserve",
        current_num_replicas=running,
        target_num_replicas=running if target is None else target,
        running_replicas=[],
        total_num_requests=ongoing,
        total_queued_requests=queued,
        aggregated_metrics=metrics,
        raw_metrics=None,
        capacity_adjusted_min_replicas=lo,
        capacity_adjusted_max_replicas=hi,
        policy_state={},
        last_scale_up_time=None,
        last_scale_down_time=None,
        current_time=0.0,
        config=config,
    )


def test_policy_import_paths_resolve_through_serve_config() -> None:
    for path, cls in [(ENCODER_POLICY, EncoderQueuePolicy), (LLM_POLICY, LLMLoadPolicy)]:
        cfg = AutoscalingConfig(policy={"policy_function": path, "policy_kwargs": {}})
        assert cfg.policy.get_policy() is cls


def test_encoder_policy_reads_queued_embeddings() -> None:
    policy = EncoderQueuePolicy(target_queued_embeddings_per_replica=1000)
    metrics = {ENCODER_QUEUED_EMBEDDINGS: {"r1": 2500.0, "r2": 2400.0}}
    n, state = policy(_ctx(metrics, running=2))
    assert (n, state) == (5, {})  # 4900 / 1000 -> 5
    # bounded by the capacity-adjusted max
    n, _ = policy(_ctx(metrics, running=2, hi=3))
    assert n == 3


def test_prefill_policy_reads_queued_prompt_tokens() -> None:
    from cluster.autoscaling_policy import LLM_QUEUED_PROMPT_TOKENS, PrefillQueuePolicy

    policy = PrefillQueuePolicy(target_queued_prompt_tokens_per_replica=4000)
    n, state = policy(_ctx({LLM_QUEUED_PROMPT_TOKENS: {"r1": 9000.0, "r2": 6000.0}}, running=2))
    assert (n, state) == (4, {})  # 15000 / 4000 -> 4
    assert policy(_ctx(None, running=2, ongoing=20))[0] == 5  # no reports: ongoing requests


def test_prefill_policy_adds_a_replica_while_ttft_stays_over_its_target() -> None:
    from cluster.autoscaling_policy import LLM_QUEUED_PROMPT_TOKENS, LLM_TTFT_P90_MS, PrefillQueuePolicy

    short = {"r1": 1000.0, "r2": 1000.0}  # 2,000 tokens: one replica's worth of the 4,000 target
    slow = {LLM_QUEUED_PROMPT_TOKENS: short, LLM_TTFT_P90_MS: {"r1": 2500.0, "r2": 400.0}}
    fast = {LLM_QUEUED_PROMPT_TOKENS: short, LLM_TTFT_P90_MS: {"r1": 300.0, "r2": 200.0}}
    near = {LLM_QUEUED_PROMPT_TOKENS: short, LLM_TTFT_P90_MS: {"r1": 900.0, "r2": 200.0}}
    policy = PrefillQueuePolicy(target_queued_prompt_tokens_per_replica=4000, target_ttft_ms=1000)
    assert policy(_ctx(slow, running=2))[0] == 3  # over 1.1 x target: one more
    assert policy(_ctx(near, running=2))[0] == 2  # near it: the backlog (-> 1) may not shrink the pool
    assert policy(_ctx(fast, running=2))[0] == 1  # both under: down
    # without a target (the default) TTFT is not read: the backlog alone
    assert PrefillQueuePolicy(target_queued_prompt_tokens_per_replica=4000)(_ctx(slow, running=2))[0] == 1
    with pytest.raises(ValueError, match="target_ttft_ms"):
        PrefillQueuePolicy(target_ttft_ms=-1)


def test_encoder_policy_falls_back_to_ongoing_requests_without_custom_metrics() -> None:
    policy = EncoderQueuePolicy()
    # 20 ongoing requests, target 4 per replica, 2 running -> 5
    n, _ = policy(_ctx(None, running=2, ongoing=20))
    assert n == 5
    n, _ = policy(_ctx({"something_else": {"r1": 1.0}}, running=2, ongoing=8))
    assert n == 2


def test_llm_policy_combines_kv_and_requests() -> None:
    policy = LLMLoadPolicy(target_kv_usage=0.5, target_ongoing_requests=10)
    metrics: dict[str, Any] = {
        LLM_KV_USAGE: {"r1": 0.9, "r2": 0.2},  # pressures 1.8, 0.4
        LLM_NUM_RUNNING: {"r1": 2.0, "r2": 5.0},
        LLM_NUM_WAITING: {"r1": 0.0, "r2": 9.0},  # r2: 14 / 10 = 1.4
    }
    n, _ = policy(_ctx(metrics, running=2))
    assert n == 4  # mean(1.8, 1.4) * 2 replicas = 3.2 -> 4
    quiet = {LLM_KV_USAGE: {"r1": 0.05, "r2": 0.05}, LLM_NUM_RUNNING: {"r1": 1.0, "r2": 0.0}}
    n, _ = policy(_ctx(quiet, running=4, target=4))
    assert n == 1
