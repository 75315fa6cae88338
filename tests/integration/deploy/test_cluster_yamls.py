"""cluster/deploy/*.yaml against Ray's own schemas, the app's config and the Serve options it builds."""

from __future__ import annotations

import copy
import json
import os
from pathlib import Path
from typing import Any

import jsonschema
import pytest
import ray.autoscaler
import yaml
from ray.autoscaler._private.util import prepare_config, validate_config

from cluster.app import build_app, encoder_placement
from cluster.autoscaling_policy import LLM_POLICY
from cluster.config import AppConfig
from cluster.malloc_env import ENCODER_MALLOC_ENV
from tests.integration.deploy.helpers import (
    pool_options,
    pool_policy,
    ray_autoscaling,
    validate_serve_config,
)

DEPLOY = Path(__file__).resolve().parents[3] / "cluster" / "deploy"


def _load(name: str) -> dict[str, Any]:
    return yaml.safe_load((DEPLOY / name).read_text())


def test_ray_up_yaml_validates_against_the_autoscaler_schema() -> None:
    cfg = _load("ray-cluster.yaml")
    schema_path = os.path.join(os.path.dirname(ray.autoscaler.__file__), "ray-schema.json")
    jsonschema.validate(cfg, json.loads(Path(schema_path).read_text()))
    validate_config(prepare_config(copy.deepcopy(cfg)))  # Ray's own checks after filling defaults


def test_ray_up_schema_check_is_not_vacuous() -> None:
    cfg = _load("ray-cluster.yaml")
    cfg["available_node_types"]["encoder_gpu"]["resources"]["encoder_node"] = 0.5  # must be an integer
    with pytest.raises(jsonschema.ValidationError):
        validate_config(prepare_config(cfg))


def test_ray_up_node_types_separate_the_pools() -> None:
    types = _load("ray-cluster.yaml")["available_node_types"]
    head = types["head"]["resources"]
    enc, llm = types["encoder_gpu"]["resources"], types["llm_gpu"]["resources"]
    assert head.get("GPU", 0) == 0 and "encoder_node" not in head and "llm_node" not in head
    assert enc["GPU"] >= 1 and enc["encoder_node"] >= 1 and "llm_node" not in enc
    assert llm["GPU"] >= 1 and llm["llm_node"] >= 1 and "encoder_node" not in llm
    for t in ("encoder_gpu", "llm_gpu"):
        assert types[t]["max_workers"] >= types[t]["min_workers"] >= 0
        assert types[t]["idle_timeout_s"] > 0


@pytest.mark.parametrize("name", ["serve-gpu.yaml", "serve-cpu.yaml", "serve-cpu-pd.yaml"])
def test_serve_configs_validate(name: str) -> None:
    doc = _load(name)
    (cfg,) = validate_serve_config(doc)
    assert doc["applications"][0]["import_path"] == "cluster.app:app_builder"
    assert doc["applications"][0]["route_prefix"] == "/"
    assert doc["http_options"]["port"] == 8000
    assert cfg.models


@pytest.mark.parametrize("name", ["serve-gpu.yaml", "serve-cpu.yaml", "serve-cpu-pd.yaml"])
def test_serve_configs_take_the_one_journey(name: str) -> None:
    """Every shipped config serves HTTP from the ingress replicas (no Serve proxy hop), on the port and
    interface the header promises, as `mmserve serve` and the Helm chart's default do."""
    doc = _load(name)
    (cfg,) = validate_serve_config(doc)
    assert doc["proxy_location"] == "Disabled"
    assert cfg.ingress.http_mode == "direct"
    assert cfg.port == doc["http_options"]["port"] and cfg.host == doc["http_options"]["host"]


@pytest.mark.parametrize("name", ["serve-gpu.yaml", "serve-cpu.yaml", "serve-cpu-pd.yaml"])
def test_pools_push_metrics_often_enough_to_react(name: str) -> None:
    """What the headers promise: metrics every 2 s (not Ray's 10 s), averaged over a window that holds
    several samples."""
    (cfg,) = validate_serve_config(_load(name))
    for m in cfg.models:
        for opts in pool_options(m).values():
            ray_cfg = ray_autoscaling(opts)
            assert ray_cfg.metrics_interval_s == 2.0
            assert ray_cfg.look_back_period_s >= 5 * ray_cfg.metrics_interval_s


def test_serve_gpu_policy_targets() -> None:
    (cfg,) = validate_serve_config(_load("serve-gpu.yaml"))
    (m,) = cfg.models
    opts = pool_options(m)
    enc = pool_policy(f"EncoderServer-{m.name}", ray_autoscaling(opts[f"EncoderServer-{m.name}"]))
    llm_auto = ray_autoscaling(opts[f"LLMServer-{m.name}"])
    llm = pool_policy(f"LLMServer-{m.name}", llm_auto)
    # the encoder's target backlog is 2 batches of its compute budget (as the YAML comment says)
    assert m.encoder.max_num_encoder_input_tokens is not None
    assert enc.targets.target_queued_embeddings_per_replica == 2 * m.encoder.max_num_encoder_input_tokens
    # the LLM's request target and Serve's fallback target count the same thing: keep them equal
    assert llm.targets.target_ongoing_requests == llm_auto.target_ongoing_requests
    assert 0 < llm.targets.target_kv_usage < 1


def test_serve_gpu_pools_fit_their_node_types() -> None:
    (cfg,) = validate_serve_config(_load("serve-gpu.yaml"))
    types = _load("ray-cluster.yaml")["available_node_types"]
    for m in cfg.models:
        enc, llm = m.encoder.deployment, m.llm.deployment
        assert set(enc.resources) == {"encoder_node"} and set(llm.resources) == {"llm_node"}
        assert enc.num_gpus > 0 and llm.num_gpus > 0
        assert types["llm_gpu"]["resources"]["GPU"] >= llm.num_gpus
        assert m.encoder.mm_encoder_tp_mode in ("weights", "data")


def test_serve_gpu_encoder_replica_is_one_placement_group_on_an_encoder_node() -> None:
    (cfg,) = validate_serve_config(_load("serve-gpu.yaml"))
    (m,) = cfg.models
    assert m.encoder.mm_encoder_tp_size == 2
    opts = pool_options(m)[f"EncoderServer-{m.name}"]
    bundles = opts["placement_group_bundles"]
    assert opts["placement_group_strategy"] == "STRICT_PACK"  # NCCL ranks on one node
    assert len(bundles) == 3  # the replica + 2 ranks
    assert all(b.get("encoder_node", 0) > 0 for b in bundles), bundles
    replica, ranks = bundles[0], bundles[1:]
    assert replica.get("GPU", 0) == 0
    assert all(r["GPU"] == 1 and r["CPU"] == 4 for r in ranks), ranks  # per-rank values of the YAML
    # Serve puts the replica actor in bundle 0: what it asks for must fit there
    actor = opts["ray_actor_options"]
    assert actor["num_cpus"] <= replica["CPU"] and actor.get("num_gpus", 0) == 0
    assert all(0 < v <= replica[k] for k, v in actor["resources"].items())
    # STRICT_PACK: the whole group fits one encoder node, two groups per node as ray-cluster.yaml says
    node = _load("ray-cluster.yaml")["available_node_types"]["encoder_gpu"]["resources"]
    for res in ("CPU", "GPU", "encoder_node"):
        assert 2 * sum(b.get(res, 0) for b in bundles) <= node[res], res


def test_serve_builds_the_options_the_checks_look_at() -> None:
    """Serve's own build of the app (no cluster) deploys the autoscaling_config and placement group
    that pool_options() shows, so the checks above look at what really runs."""
    from ray.serve._private.build_app import build_app as serve_build_app

    (app,) = _load("serve-gpu.yaml")["applications"]
    cfg = AppConfig.model_validate(app["args"])
    built = {d.name: d for d in serve_build_app(build_app(cfg), name=app["name"]).deployments}
    (m,) = cfg.models
    for name, opts in pool_options(m).items():
        d = built[name]
        assert d._deployment_config.autoscaling_config == ray_autoscaling(opts), name
        assert d._replica_config.placement_group_bundles == opts.get("placement_group_bundles"), name
        assert d._replica_config.placement_group_strategy == opts.get("placement_group_strategy"), name
    assert built[f"EncoderServer-{m.name}"]._replica_config.placement_group_bundles  # TP 2: a group
    # glibc's malloc settings reach the encoder replicas' processes (cluster/malloc_env.py)
    env = built[f"EncoderServer-{m.name}"]._replica_config.ray_actor_options["runtime_env"]["env_vars"]
    assert ENCODER_MALLOC_ENV.items() <= env.items()


def test_serve_cpu_pd_builds_a_prefill_and_a_decode_pool() -> None:
    """The shipped E/P/D config: Serve's build of it has one deployment per pool, the LLM's two each
    on its own options, the decode pool routed by free KV."""
    from ray.serve._private.build_app import build_app as serve_build_app

    from router.routing.request_routers import FreeKVRouter, PrefixAffinityRouter

    (app,) = _load("serve-cpu-pd.yaml")["applications"]
    cfg = AppConfig.model_validate(app["args"])
    (m,) = cfg.models
    built = {d.name: d for d in serve_build_app(build_app(cfg), name=app["name"]).deployments}
    prefill, decode = f"LLMPrefillServer-{m.name}", f"LLMDecodeServer-{m.name}"
    assert f"LLMServer-{m.name}" not in built and {prefill, decode} <= set(built)
    for name, opts in pool_options(m).items():
        assert built[name]._deployment_config.autoscaling_config == ray_autoscaling(opts), name
    routers = {
        n: built[n]._deployment_config.request_router_config.request_router_class for n in (prefill, decode)
    }
    assert PrefixAffinityRouter.__name__ in str(routers[prefill]) and FreeKVRouter.__name__ in str(
        routers[decode]
    )


def test_serve_cpu_uses_the_tiny_model_without_gpus() -> None:
    (cfg,) = validate_serve_config(_load("serve-cpu.yaml"))
    for m in cfg.models:
        assert m.tiny == "qwen2-vl"
        for pool in (m.encoder, m.llm):
            assert pool.deployment.num_gpus == 0 and not pool.deployment.resources
            assert 0 < pool.deployment.num_cpus < 1  # fractional, or it waits forever on a small box
        assert encoder_placement(m) == {}  # TP 1: the replica holds the rank, no placement group


LLM_AUTO = "args.models.0.llm.deployment.autoscaling"
ENC_AUTO = "args.models.0.encoder.deployment.autoscaling"
PUSH_ENV = {"env_vars": {"RAY_SERVE_REPLICA_AUTOSCALING_METRIC_PUSH_INTERVAL_S": "2"}}


def _set(doc: dict[str, Any], path: str, value: Any) -> dict[str, Any]:
    """``path`` is relative to the first application."""
    node = doc["applications"][0]
    *parents, last = path.split(".")
    for p in parents:
        node = node[int(p)] if isinstance(node, list) else node[p]
    node[last] = value
    return doc


@pytest.mark.parametrize("name", ["serve-gpu.yaml", "serve-cpu.yaml"])
@pytest.mark.parametrize(
    ("path", "value", "error", "match"),
    [
        ("deployments", [{"name": "IngressServer", "num_replicas": 2}], AssertionError, "deployments"),
        ("runtime_env", PUSH_ENV, AssertionError, "metrics_interval_s"),
        (f"{LLM_AUTO}.policy.policy_kwargs", {"nope": 1}, TypeError, "nope"),
        (f"{LLM_AUTO}.policy.policy_kwargs.target_kv_usage", 1.5, ValueError, "target_kv_usage"),
        (f"{ENC_AUTO}.policy.policy_function", LLM_POLICY, AssertionError, "EncoderServer-.* scales with"),
        (f"{ENC_AUTO}.policy.policy_function", "cluster.nope:Policy", ModuleNotFoundError, "cluster.nope"),
        (f"{ENC_AUTO}.metrics_interval_s", 20, ValueError, "look_back_period_s"),
        (f"{LLM_AUTO}.metrics_interval_s", 0, ValueError, "metrics_interval_s"),
        (f"{LLM_AUTO}.look_back_period_s", 2, ValueError, "look_back_period_s"),  # == metrics_interval_s
        ("args.models.0.llm.deployment.num_replicas", 2, AssertionError, "fixed replica count"),
    ],
)
def test_serve_check_refuses_bad_configs(name: str, path: str, value: Any, error: type, match: str) -> None:
    validate_serve_config(_load(name))  # the file itself passes
    with pytest.raises(error, match=match):
        validate_serve_config(_set(_load(name), path, value))


def test_each_deployment_is_named_for_its_replica_class() -> None:
    """One name per replica: a deployment is its class's name (``-<model>`` for a model's pools), the
    class is defined at module level (not inside a builder), and its module is where cluster/ keeps
    the deployables (the cache owner beside its shards)."""
    from ray.serve._private.build_app import build_app as serve_build_app

    (app,) = _load("serve-gpu.yaml")["applications"]
    cfg = AppConfig.model_validate(app["args"])
    (m,) = cfg.models
    built = serve_build_app(build_app(cfg), name=app["name"]).deployments
    names = {}
    for d in built:
        cls = d.func_or_class
        assert "<locals>" not in cls.__qualname__, cls.__qualname__
        assert cls.__module__ in ("cluster.replicas", "cluster.cache_shards"), cls.__module__
        names[d.name] = cls.__name__
    assert names == {
        "IngressServer": "IngressServer",
        f"EncoderServer-{m.name}": "EncoderServer",
        f"LLMServer-{m.name}": "LLMServer",
        f"EncoderCacheIndex-{m.name}": "EncoderCacheIndex",
    }
