"""Shared checks for the deployment files: Ray's and KubeRay's own schemas, and the app's config."""

from __future__ import annotations

from typing import Any

from ray.serve.config import AutoscalingConfig
from ray.serve.schema import ServeDeploySchema

from cluster.config import AppConfig

# The app's deployment names (contract with cluster/app.py).
POOL_DEPLOYMENTS = {"encoder": "EncoderPool-{}", "llm": "LLMServer-{}"}
CHECKED_AUTOSCALING_FIELDS = (
    "min_replicas",
    "max_replicas",
    "initial_replicas",
    "target_ongoing_requests",
    "upscale_delay_s",
    "downscale_delay_s",
    "look_back_period_s",
)


def validate_serve_config(doc: dict[str, Any]) -> list[AppConfig]:
    """Validate a Serve config as Ray does, each app's args as AppConfig, and each deployment override:
    its name must be one the app creates, its autoscaling_config a valid Ray one whose policy resolves
    and accepts its kwargs, and its bounds equal to those in args. Returns the AppConfigs."""
    ServeDeploySchema.model_validate(doc)
    configs = []
    for app in doc["applications"]:
        cfg = AppConfig.model_validate(app["args"])
        configs.append(cfg)
        names = {"Ingress"}
        for m in cfg.models:
            names |= {f"Preprocessor-{m.name}", f"EncoderPool-{m.name}", f"LLMServer-{m.name}"}
        for dep in app.get("deployments", []):
            assert dep["name"] in names, f"{dep['name']} is not a deployment of the app ({sorted(names)})"
            assert "ray_actor_options" not in dep, "placement belongs in args (see serve-gpu.yaml header)"
            if "autoscaling_config" not in dep:
                continue
            ray_cfg = AutoscalingConfig.model_validate(dep["autoscaling_config"])
            policy = ray_cfg.policy.get_policy()
            policy(**ray_cfg.policy.policy_kwargs)  # kwargs must match the constructor
            _check_override_matches_args(cfg, dep["name"], dep["autoscaling_config"])
    return configs


def _check_override_matches_args(cfg: AppConfig, name: str, override: dict[str, Any]) -> None:
    for m in cfg.models:
        for pool, pattern in POOL_DEPLOYMENTS.items():
            if pattern.format(m.name) != name:
                continue
            opts = getattr(m, pool).deployment
            assert opts.num_replicas is None, f"{name}: autoscaled in deployments: but fixed in args"
            args_auto = opts.autoscaling.model_dump()
            for field in CHECKED_AUTOSCALING_FIELDS:
                if field in override:
                    assert override[field] == args_auto[field], (
                        f"{name}.{field}: deployments: says {override[field]}, args say {args_auto[field]}"
                    )
