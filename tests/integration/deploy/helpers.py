"""Shared checks for the Serve configs (cluster/deploy/serve-*.yaml and the chart's serveConfigV2).

A Serve config is valid when Ray's ServeDeploySchema takes it, its ``args`` are an AppConfig, ``args``
is the only place (no ``deployments:`` override, no push-interval env var that Ray ignores), and the
autoscaling_config the app builds for each EncoderServer / LLMServer is one Ray's own AutoscalingConfig
takes, with a policy that resolves to the pool's class and accepts its kwargs.
"""

from __future__ import annotations

from typing import Any

from ray.serve.config import AutoscalingConfig as RayAutoscalingConfig
from ray.serve.schema import ServeDeploySchema

from cluster.app import deployment_options, encoder_placement
from cluster.autoscaling_policy import (
    ENCODER_POLICY,
    LLM_POLICY,
    PREFILL_POLICY,
    EncoderQueuePolicy,
    LLMLoadPolicy,
    PrefillQueuePolicy,
)
from cluster.config import AppConfig, ModelConfig

# Ray 2.60 defines these but its replicas and handles read only autoscaling_config.metrics_interval_s.
IGNORED_ENV_VARS = {
    "RAY_SERVE_REPLICA_AUTOSCALING_METRIC_PUSH_INTERVAL_S",
    "RAY_SERVE_HANDLE_AUTOSCALING_METRIC_PUSH_INTERVAL_S",
}
# Deployment name prefix -> the policy class that must scale it (the classes, not the app's strings).
POOL_POLICIES: dict[str, type] = {
    "EncoderServer": EncoderQueuePolicy,
    "LLMServer": LLMLoadPolicy,
    "LLMPrefillServer": PrefillQueuePolicy,
    "LLMDecodeServer": LLMLoadPolicy,
}


def pool_options(model: ModelConfig) -> dict[str, dict[str, Any]]:
    """Serve ``.options()`` of the model's encoder and LLM pools, as cluster.app builds them
    (test_cluster_yamls checks this against Serve's own build of the app)."""
    enc = deployment_options(model.encoder.deployment, f"EncoderServer-{model.name}", ENCODER_POLICY)
    enc.update(encoder_placement(model))
    out = {enc["name"]: enc}
    names = {"both": "LLMServer", "prefill": "LLMPrefillServer", "decode": "LLMDecodeServer"}
    for role in model.llm.roles:  # one pool, or E/P/D's two
        policy = PREFILL_POLICY if role == "prefill" else LLM_POLICY
        llm = deployment_options(model.llm.pool(role), f"{names[role]}-{model.name}", policy)
        out[llm["name"]] = llm
    return out


def ray_autoscaling(opts: dict[str, Any]) -> RayAutoscalingConfig:
    """The pool's autoscaling_config as Ray parses it; the pool must autoscale."""
    assert "autoscaling_config" in opts, f"{opts['name']} has a fixed replica count"
    return RayAutoscalingConfig(**opts["autoscaling_config"])


def pool_policy(name: str, ray_cfg: RayAutoscalingConfig) -> Any:
    """The policy instance Serve's controller would build: its class must be the pool's own, and its
    constructor must take the kwargs (TypeError for an unknown one, ValueError for a bad value)."""
    policy_cls = ray_cfg.policy.get_policy()
    expected = POOL_POLICIES[name.split("-", 1)[0]]
    assert policy_cls is expected, f"{name} scales with {ray_cfg.policy.policy_function}, not {expected}"
    return policy_cls(**ray_cfg.policy.policy_kwargs)


def validate_serve_config(doc: dict[str, Any]) -> list[AppConfig]:
    """Check a Serve config as described in the module docstring; return each app's AppConfig."""
    ServeDeploySchema.model_validate(doc)
    configs = []
    for app in doc["applications"]:
        assert "deployments" not in app, (
            f"app {app['name']}: `deployments:` would replace the options cluster.app builds from args"
        )
        env = (app.get("runtime_env") or {}).get("env_vars") or {}
        assert not IGNORED_ENV_VARS & set(env), "Ray ignores these; set autoscaling.metrics_interval_s"
        cfg = AppConfig.model_validate(app["args"])
        for m in cfg.models:
            for name, opts in pool_options(m).items():
                pool_policy(name, ray_autoscaling(opts))
        configs.append(cfg)
    return configs


# The chart's hardening volumes (values writableDirs, and the head's autoscaler token): tests about the
# app's own volumes (API keys, models) look past them.
HARDENING_VOLUMES = {"tmp", "dshm", "home-cache", "home-ray", "kube-api-access-autoscaler"}


def app_volumes(pod_spec: dict[str, Any]) -> list[dict[str, Any]]:
    """The pod's volumes other than the chart's hardening ones."""
    return [v for v in pod_spec.get("volumes", []) if v["name"] not in HARDENING_VOLUMES]


def app_mounts(container: dict[str, Any]) -> list[dict[str, Any]]:
    """The container's volume mounts other than the chart's hardening ones."""
    return [m for m in container.get("volumeMounts", []) if m["name"] not in HARDENING_VOLUMES]
