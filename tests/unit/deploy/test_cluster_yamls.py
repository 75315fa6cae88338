"""cluster/deploy/*.yaml against Ray's own schemas and the app's config."""

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

from tests.unit.deploy.helpers import validate_serve_config

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


@pytest.mark.parametrize("name", ["serve-gpu.yaml", "serve-cpu.yaml"])
def test_serve_configs_validate(name: str) -> None:
    doc = _load(name)
    (cfg,) = validate_serve_config(doc)
    assert doc["applications"][0]["import_path"] == "cluster.app:app_builder"
    assert doc["applications"][0]["route_prefix"] == "/"
    assert doc["http_options"]["port"] == 8000
    assert cfg.models


def test_serve_gpu_pools_fit_their_node_types() -> None:
    (cfg,) = validate_serve_config(_load("serve-gpu.yaml"))
    types = _load("ray-cluster.yaml")["available_node_types"]
    for m in cfg.models:
        enc, llm = m.encoder.deployment, m.llm.deployment
        assert set(enc.resources) == {"encoder_node"} and set(llm.resources) == {"llm_node"}
        assert enc.num_gpus > 0 and llm.num_gpus > 0
        # one replica is a TP group: the encoder node type must hold all its ranks
        assert types["encoder_gpu"]["resources"]["GPU"] >= m.encoder.mm_encoder_tp_size * enc.num_gpus
        assert types["llm_gpu"]["resources"]["GPU"] >= llm.num_gpus
        assert m.encoder.mm_encoder_tp_mode in ("weights", "data")


def test_serve_cpu_uses_the_tiny_model_without_gpus() -> None:
    (cfg,) = validate_serve_config(_load("serve-cpu.yaml"))
    for m in cfg.models:
        assert m.tiny == "qwen2-vl"
        for pool in (m.encoder, m.llm, m.preprocess):
            assert pool.deployment.num_gpus == 0 and not pool.deployment.resources
            assert 0 < pool.deployment.num_cpus < 1  # fractional, or it waits forever on a small box


def test_serve_check_catches_override_drift() -> None:
    doc = _load("serve-gpu.yaml")
    doc["applications"][0]["deployments"][0]["autoscaling_config"]["max_replicas"] = 3
    with pytest.raises(AssertionError, match="max_replicas"):
        validate_serve_config(doc)
    doc = _load("serve-gpu.yaml")
    doc["applications"][0]["deployments"][1]["autoscaling_config"]["policy"]["policy_kwargs"] = {"nope": 1}
    with pytest.raises(TypeError):
        validate_serve_config(doc)
