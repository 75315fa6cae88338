"""The Serve options of one pool (pydantic, part of the config, ``cluster/config.py``): where its
replicas go and how many (``DeploymentOptions``), how they scale (``AutoscalingConfig``, with a pool's
own policy in ``AutoscalingPolicyConfig``); and ``StrictModel``, the config sections' base (unknown
keys refused, frozen)."""

from __future__ import annotations

from typing import TypedDict

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from cluster.cpu_affinity import parse_cpu_affinity


class StrictModel(BaseModel):
    """A config section: unknown keys are refused by name, and it is frozen."""

    model_config = ConfigDict(extra="forbid", frozen=True)


class AutoscalingPolicyConfig(StrictModel):
    """A Serve autoscaling policy: ``module:Class`` built once with ``policy_kwargs``, or ``module:function``."""

    policy_function: str = Field(..., pattern=r"^[A-Za-z_][\w.]*:[A-Za-z_]\w*$")
    policy_kwargs: dict[str, float | int | str | bool] = Field(default_factory=dict)


class AutoscalingConfig(StrictModel):
    """Ray Serve ``autoscaling_config``; ``target_ongoing_requests`` is per replica.

    ``policy`` unset means the pool's own policy: encoder pools scale on queued embeddings
    (``EncoderQueuePolicy``), LLM pools on KV use and requests (``LLMLoadPolicy``), the preprocessor
    and ingress on Serve's ongoing requests. ``target_ongoing_requests`` is the fallback signal until
    replicas report their own metrics. Serve's default everywhere:
    ``{policy_function: "ray.serve.autoscaling_policy:default_autoscaling_policy"}``.
    """

    min_replicas: int = Field(1, ge=0)
    max_replicas: int = Field(1, ge=1)
    initial_replicas: int | None = Field(None, ge=0)
    target_ongoing_requests: float = Field(2.0, gt=0)
    upscale_delay_s: float = Field(5.0, ge=0)
    downscale_delay_s: float = Field(30.0, ge=0)
    look_back_period_s: float = Field(30.0, gt=0)
    metrics_interval_s: float | None = Field(
        None,
        gt=0,
        description="how often replicas and handles push autoscaling metrics (Ray's default: 10 s). "
        "Ray 2.60 marks it deprecated in favour of RAY_SERVE_*_AUTOSCALING_METRIC_PUSH_INTERVAL_S, "
        "but its replicas and handles still read only this field",
    )
    policy: AutoscalingPolicyConfig | None = None

    @model_validator(mode="after")
    def _check(self) -> AutoscalingConfig:
        if self.min_replicas > self.max_replicas:
            raise ValueError("min_replicas must be <= max_replicas")
        if self.look_back_period_s <= (self.metrics_interval_s or 10.0):
            raise ValueError(
                f"look_back_period_s ({self.look_back_period_s}) must exceed metrics_interval_s "
                f"({self.metrics_interval_s or 10.0}), or the window may hold no sample"
            )
        return self


class RayActorOptions(TypedDict, total=False):
    """Ray's ``ray_actor_options`` for one pool's replicas (what ``DeploymentOptions`` sets)."""

    num_cpus: float
    num_gpus: float
    resources: dict[str, float]


class DeploymentOptions(StrictModel):
    """What Ray Serve needs to place and scale one pool's replicas."""

    num_replicas: int | None = Field(None, ge=1, description="fixed replica count; omit to autoscale")
    autoscaling: AutoscalingConfig = Field(default_factory=AutoscalingConfig)
    max_ongoing_requests: int = Field(64, ge=1)
    max_queued_requests: int = Field(
        256,
        ge=-1,
        description="calls a caller's handle queues for this pool beyond max_ongoing_requests per replica; "
        "past it Serve refuses at once (BackPressureError, a 503 with Retry-After); -1: unbounded",
    )
    graceful_shutdown_timeout_s: float = Field(
        30.0, gt=0, description="scale-down/redeploy/shutdown: how long a replica may finish in-flight work"
    )
    access_log: bool = Field(
        False, description="Serve's per-request log line in the replica's log (costs CPU per request)"
    )
    num_cpus: float = Field(0.1, ge=0)
    num_gpus: float = Field(0.0, ge=0)
    resources: dict[str, float] = Field(default_factory=dict, description="custom Ray resources")
    cpu_affinity: str | list[int] | None = Field(
        None,
        description="the cores this pool's replicas' threads run on, on their node: '3', '0-3', '0,2', [0, 1], "
        "or one set per replica, '0|1' (on a node its replicas take the sets in turn); checked against the "
        "node's cores when a replica starts (cluster/cpu_affinity.py); default: not pinned",
    )

    @field_validator("cpu_affinity")
    @classmethod
    def _cpu_list(cls, value: str | list[int] | None) -> str | list[int] | None:
        if value is not None:
            parse_cpu_affinity(value)  # CpuAffinityError (a ValueError): pydantic names the pool's field
        return value

    def ray_actor_options(self) -> RayActorOptions:
        opts: RayActorOptions = {"num_cpus": self.num_cpus}
        if self.num_gpus:
            opts["num_gpus"] = self.num_gpus
        if self.resources:
            opts["resources"] = dict(self.resources)
        return opts
