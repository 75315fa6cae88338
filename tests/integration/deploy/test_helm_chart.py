"""helm/mmserve rendered with real Helm (helm-python-sdk), checked against KubeRay's CRD schema,
Ray's ServeDeploySchema, the app's AppConfig and the Serve options the app builds from it."""

from __future__ import annotations

import copy
import functools
import inspect
import json
import re
from pathlib import Path
from typing import Any

import helm_python as helm
import jsonschema
import pytest
import yaml

from cluster.app import deployment_options
from cluster.autoscaling_policy import EncoderQueuePolicy, LLMLoadPolicy
from cluster.config import AppConfig
from tests.integration.deploy.helpers import (
    pool_options,
    pool_policy,
    ray_autoscaling,
    validate_serve_config,
)

ROOT = Path(__file__).resolve().parents[3]
CHART = ROOT / "helm" / "mmserve"
CRD = Path("/work/shared/data/kuberay/ray.io_rayservices.yaml")
if not CRD.exists():
    CRD = ROOT.parent / "shared" / "data" / "kuberay" / "ray.io_rayservices.yaml"


def _gpu_values() -> dict[str, Any]:
    return yaml.safe_load((CHART / "values-gpu-example.yaml").read_text())


def _render(values: dict[str, Any] | None) -> dict[str, list[dict[str, Any]]]:
    out: dict[str, list[dict[str, Any]]] = {}
    rendered = helm.Chart.load(CHART).render(values, name="mm", namespace="ml")
    for path, doc_text in rendered.items():
        if path.endswith("NOTES.txt"):
            continue
        for doc in yaml.safe_load_all(doc_text):
            if isinstance(doc, dict):
                out.setdefault(doc["kind"], []).append(doc)
    return out


def _serve_config(values: dict[str, Any] | None) -> AppConfig:
    (rs,) = _render(values)["RayService"]
    (cfg,) = validate_serve_config(yaml.safe_load(rs["spec"]["serveConfigV2"]))
    return cfg


def _snake(camel: str) -> str:
    return re.sub(r"(?<!^)([A-Z])", r"_\1", camel).lower()


@functools.cache  # the CRD is 1 MB of YAML: parse it once
def _rayservice_schema() -> dict[str, Any]:
    crd = yaml.safe_load(CRD.read_text())
    (v1,) = [v for v in crd["spec"]["versions"] if v["name"] == "v1" and v["served"] and v["storage"]]
    return v1["schema"]["openAPIV3Schema"]


def _marker(start_param: str) -> dict[str, float]:
    """rayStartParams.resources is shell-quoted JSON: "{\\"encoder_node\\": 1}"."""
    assert start_param.startswith('"') and start_param.endswith('"'), start_param
    return json.loads(start_param[1:-1].replace('\\"', '"'))


def test_lint_reports_no_errors() -> None:
    for values in (None, _gpu_values()):
        report = helm.lint(CHART, values)
        assert report["errors"] == []
        assert [m for m in report["messages"] if m["severity"] >= 3] == []


@pytest.mark.parametrize("values", [None, "gpu"], ids=["defaults", "gpu-example"])
def test_rendered_rayservice_is_valid_everywhere(values: str | None) -> None:
    vals = _gpu_values() if values == "gpu" else None
    docs = _render(vals)
    (rs,) = docs["RayService"]
    assert rs["apiVersion"] == "ray.io/v1"
    jsonschema.validate(rs, _rayservice_schema())
    serve = yaml.safe_load(rs["spec"]["serveConfigV2"])
    (cfg,) = validate_serve_config(serve)
    (port,) = rs["spec"]["serveService"]["spec"]["ports"]
    assert port["port"] == serve["http_options"]["port"] == 8000
    if vals is not None:
        assert [m.name for m in cfg.models] == [m["name"] for m in vals["models"]]
        m = cfg.models[0]
        assert (m.encoder.mm_encoder_tp_size, m.encoder.mm_encoder_tp_mode) == (2, "data")
        assert m.encoder.max_num_encoder_input_tokens == 16384
        assert m.llm.deployment.autoscaling.max_replicas == 8
        assert {d["kind"] for d in (docs.get("ServiceMonitor") or [])} == {"ServiceMonitor"}
    else:
        assert "ServiceMonitor" not in docs


def test_crd_check_is_not_vacuous() -> None:
    (rs,) = _render(None)["RayService"]
    bad = copy.deepcopy(rs)
    bad["spec"]["rayClusterConfig"]["workerGroupSpecs"][0]["minReplicas"] = "one"
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate(bad, _rayservice_schema())


def test_worker_groups_carry_the_resources_the_pools_ask_for() -> None:
    (rs,) = _render(_gpu_values())["RayService"]
    cluster = rs["spec"]["rayClusterConfig"]
    groups = {g["groupName"]: g for g in cluster["workerGroupSpecs"]}
    assert set(groups) == {"encoder", "llm"}
    enc_marker = _marker(groups["encoder"]["rayStartParams"]["resources"])
    llm_marker = _marker(groups["llm"]["rayStartParams"]["resources"])
    assert set(enc_marker).isdisjoint(llm_marker)
    assert "resources" not in cluster["headGroupSpec"]["rayStartParams"]
    assert cluster["headGroupSpec"]["rayStartParams"]["num-gpus"] == "0"
    (cfg,) = validate_serve_config(yaml.safe_load(rs["spec"]["serveConfigV2"]))
    for m in cfg.models:
        assert set(m.encoder.deployment.resources) == set(enc_marker)
        assert set(m.llm.deployment.resources) == set(llm_marker)
        for pool, marker in ((m.encoder, enc_marker), (m.llm, llm_marker)):
            for name, amount in pool.deployment.resources.items():
                assert 0 < amount <= marker[name]
    enc_pod = groups["encoder"]["template"]["spec"]
    limits = enc_pod["containers"][0]["resources"]["limits"]
    assert limits["nvidia.com/gpu"] == 4 >= cfg.models[0].encoder.mm_encoder_tp_size
    assert enc_pod["nodeSelector"] == {"node.kubernetes.io/instance-type": "g6.12xlarge"}
    assert enc_pod["tolerations"][0]["key"] == "nvidia.com/gpu"
    assert (groups["llm"]["minReplicas"], groups["llm"]["maxReplicas"]) == (1, 8)
    assert cluster["enableInTreeAutoscaling"] is True


def _set(values: dict[str, Any], path: str, value: Any) -> dict[str, Any]:
    v = copy.deepcopy(values)
    node = v
    *parents, last = path.split(".")
    for p in parents:
        node = node[int(p)] if isinstance(node, list) else node.setdefault(p, {})
    node[last] = value
    return v


@pytest.mark.parametrize(
    ("path", "value"),
    [
        ("bogus", 1),  # unknown top-level key
        ("pools.encoder.autoscalng", {}),  # typo
        ("pools.llm.autoscaling.minReplicas", -1),
        ("cluster.encoderWorkers.maxReplicas", 0),
        ("models.0.encoder.mm_encoder_tp_mode", "pipeline"),
        ("models.0.encoder.deployment", {"num_gpus": 1}),  # placement comes from pools
        ("models.0.path", "/models/x"),  # both path and tiny
        ("pools.llm.policy.targetKvUsage", 1.5),
        ("pools.llm.policy.target_kv_usage", 0.5),  # camelCase in values
        ("pools.encoder.policy.targetQueuedEmbeddingsPerReplica", 0),
        ("pools.encoder.autoscaling.metricsIntervalS", 0),
        ("pools.metricPushIntervalS", 2),  # gone: metricsIntervalS is per pool
        ("placement.encoderResource", "encoder node"),
    ],
)
def test_values_outside_the_schema_are_refused(path: str, value: Any) -> None:
    base = yaml.safe_load((CHART / "values.yaml").read_text())
    chart = helm.Chart.load(CHART)
    chart.validate_schema(base)  # the defaults pass
    with pytest.raises(helm.HelmValuesError, match="schema"):
        chart.render(_set(base, path, value), name="mm", namespace="ml")


def test_encoder_tp_group_must_fit_a_worker_pod() -> None:
    vals = _set(_gpu_values(), "models.0.encoder.mm_encoder_tp_size", 8)  # 8 ranks x 1 GPU > 4 per pod
    with pytest.raises(helm.HelmError, match="TP group"):
        helm.Chart.load(CHART).render(vals, name="mm", namespace="ml")


def test_values_sections_mirror_the_app_config() -> None:
    """The chart's per-model sections list exactly the AppConfig fields (minus the chart-built `deployment`)."""
    from cluster.config import EncoderConfig, LLMConfig, MediaLimitsConfig, PreprocessConfig

    schema = json.loads((CHART / "values.schema.json").read_text())
    model = schema["properties"]["models"]["items"]["properties"]
    for key, cls in (("encoder", EncoderConfig), ("llm", LLMConfig), ("preprocess", PreprocessConfig)):
        assert set(model[key]["properties"]) == set(cls.model_fields) - {"deployment"}, key
    media = model["preprocess"]["properties"]["media"]["properties"]
    assert set(media) == set(MediaLimitsConfig.model_fields)


def test_encoder_tp_group_is_one_placement_group_on_an_encoder_pod() -> None:
    vals = _gpu_values()
    cfg = _serve_config(vals)
    (m,) = cfg.models
    opts = pool_options(m)[f"EncoderServer-{m.name}"]
    bundles = opts["placement_group_bundles"]
    assert len(bundles) == 1 + 2 and opts["placement_group_strategy"] == "STRICT_PACK"
    marker = "encoder_node"  # placement.encoderResource in values.yaml
    assert all(b[marker] > 0 for b in bundles), bundles
    gpus_per_pod = vals["cluster"]["encoderWorkers"]["gpus"]
    assert sum(b.get("GPU", 0) for b in bundles) == 2 * vals["pools"]["encoder"]["numGpus"] <= gpus_per_pod


def test_policy_values_reach_the_policies() -> None:
    vals = _gpu_values()
    (m,) = _serve_config(vals).models
    for name, opts in pool_options(m).items():
        ray_cfg = ray_autoscaling(opts)
        policy = pool_policy(name, ray_cfg)
        values = vals["pools"]["encoder" if name.startswith("EncoderServer") else "llm"]
        for key, value in values["policy"].items():
            assert getattr(policy.targets, _snake(key)) == value, (name, key)
        assert ray_cfg.metrics_interval_s == values["autoscaling"]["metricsIntervalS"] == 2


def test_unset_policy_values_take_the_policy_defaults() -> None:
    vals = {  # Helm merges these into values.yaml: null removes a default
        "pools": {
            "encoder": {
                "policy": {"targetQueuedEmbeddingsPerReplica": 1000, "embeddingsPerHandleQueuedRequest": None}
            },
            "llm": {"policy": None},
        }
    }
    (m,) = _serve_config(vals).models
    opts = pool_options(m)
    enc_cfg = ray_autoscaling(opts[f"EncoderServer-{m.name}"])
    llm_cfg = ray_autoscaling(opts[f"LLMServer-{m.name}"])
    assert enc_cfg.policy.policy_kwargs == {"target_queued_embeddings_per_replica": 1000}
    assert llm_cfg.policy.policy_kwargs == {}
    enc = pool_policy(f"EncoderServer-{m.name}", enc_cfg)
    assert enc.targets.embeddings_per_handle_queued_request == 1024.0  # EncoderQueuePolicy's default
    assert pool_policy(f"LLMServer-{m.name}", llm_cfg).targets.target_kv_usage == 0.8


def test_every_autoscaling_value_reaches_ray() -> None:
    """Each key the schema allows in pools.<pool>.autoscaling lands in that pool's Ray autoscaling_config."""
    chosen = {
        "minReplicas": 2,
        "maxReplicas": 7,
        "initialReplicas": 3,
        "targetOngoingRequests": 5,
        "upscaleDelayS": 11,
        "downscaleDelayS": 130,
        "metricsIntervalS": 1.5,
        "lookBackPeriodS": 17,
    }
    schema = json.loads((CHART / "values.schema.json").read_text())["properties"]["pools"]["properties"]
    vals = yaml.safe_load((CHART / "values.yaml").read_text())
    pools = ("ingress", "encoder", "llm")
    for i, pool in enumerate(pools):
        assert set(schema[pool]["properties"]["autoscaling"]["properties"]) == set(chosen), pool
        vals["pools"][pool]["autoscaling"] = {k: v + i for k, v in chosen.items()}  # distinct per pool
    cfg = _serve_config(vals)
    (m,) = cfg.models
    opts = {
        "ingress": deployment_options(cfg.ingress.deployment, "IngressServer"),
        **{p: o for p, o in zip(("encoder", "llm"), pool_options(m).values(), strict=True)},
    }
    for i, pool in enumerate(pools):
        ray_cfg = ray_autoscaling(opts[pool])
        for key, value in chosen.items():
            assert getattr(ray_cfg, _snake(key)) == value + i, (pool, key)


@pytest.mark.parametrize(
    "auto",
    [{"metricsIntervalS": 20, "lookBackPeriodS": 20}, {"metricsIntervalS": None, "lookBackPeriodS": 10}],
    ids=["equal", "ray-default-interval"],
)
def test_look_back_must_exceed_the_metrics_interval(auto: dict[str, Any]) -> None:
    vals = {"pools": {"llm": {"autoscaling": auto}}}  # merged into values.yaml; null unsets
    with pytest.raises(helm.HelmError, match=r"pools\.llm\.autoscaling: lookBackPeriodS"):
        helm.Chart.load(CHART).render(vals, name="mm", namespace="ml")


def test_policy_values_are_constructor_arguments() -> None:
    schema = json.loads((CHART / "values.schema.json").read_text())["properties"]["pools"]["properties"]
    for pool, cls in (("encoder", EncoderQueuePolicy), ("llm", LLMLoadPolicy)):
        keys = {_snake(k) for k in schema[pool]["properties"]["policy"]["properties"]}
        assert keys and keys <= set(inspect.signature(cls).parameters), (pool, keys)


def test_preprocess_values_reach_the_app_and_removed_switches_are_refused() -> None:
    vals = yaml.safe_load((CHART / "values.yaml").read_text())
    vals["models"][0]["preprocess"] = {"limit_mm_per_prompt": {"image": 3}}
    (rs,) = _render(vals)["RayService"]
    (cfg,) = validate_serve_config(yaml.safe_load(rs["spec"]["serveConfigV2"]))
    assert cfg.models[0].preprocess.limit_mm_per_prompt == {"image": 3}
    schema = json.loads((CHART / "values.schema.json").read_text())
    for gone in ({"placement": "pool"}, {"forward": True}, {"hit_path": False}):  # one journey (README)
        vals["models"][0]["preprocess"] = gone
        with pytest.raises(jsonschema.ValidationError):
            jsonschema.validate(vals, schema)


def test_an_epd_model_renders_a_prefill_and_a_decode_pool() -> None:
    """``llm.pools: [{role: prefill}, {role: decode}]``: each pool's Serve options from pools.<role>
    over pools.llm, its own marker (placement.<role>Resource, else the LLM group's)."""
    values = yaml.safe_load((CHART / "values.yaml").read_text())
    values["models"][0]["llm"]["pools"] = [{"role": "prefill"}, {"role": "decode"}]
    values["pools"]["decode"] = {"numCpus": 2, "autoscaling": {"minReplicas": 2, "maxReplicas": 6}}
    values["placement"]["decodeResource"] = "decode_node"
    (m,) = _serve_config(values).models
    assert m.llm.roles == ["prefill", "decode"]
    prefill, decode = m.llm.pool("prefill"), m.llm.pool("decode")
    assert prefill.num_cpus == m.llm.deployment.num_cpus and prefill.resources == m.llm.deployment.resources
    assert decode.num_cpus == 2 and set(decode.resources) == {"decode_node"}
    assert (decode.autoscaling.min_replicas, decode.autoscaling.max_replicas) == (2, 6)
    assert decode.autoscaling.upscale_delay_s == prefill.autoscaling.upscale_delay_s  # the rest: pools.llm's


def test_an_epd_pools_engine_settings_reach_the_app_and_shared_ones_are_refused() -> None:
    """``llm.pools[].engine``: a pool's own engine settings over llm's pass through the chart as they are
    (the decode pool with 4x the KV blocks); the values schema refuses one the moved KV needs alike."""
    values = yaml.safe_load((CHART / "values.yaml").read_text())
    values["models"][0]["llm"] |= {"num_kv_blocks": 512}
    values["models"][0]["llm"]["pools"] = [
        {"role": "prefill", "engine": {"max_num_batched_tokens": 4096}},
        {"role": "decode", "engine": {"num_kv_blocks": 2048, "max_num_seqs": 256}},
    ]
    schema = json.loads((CHART / "values.schema.json").read_text())
    jsonschema.validate(values, schema)
    (m,) = _serve_config(values).models
    prefill, decode = m.llm.for_role("prefill"), m.llm.for_role("decode")
    assert (prefill.num_kv_blocks, prefill.max_num_batched_tokens) == (512, 4096)
    assert (decode.num_kv_blocks, decode.max_num_seqs) == (2048, 256)
    values["models"][0]["llm"]["pools"][1]["engine"]["block_size"] = 32
    with pytest.raises(jsonschema.ValidationError, match="block_size"):
        jsonschema.validate(values, schema)


def test_a_models_chat_template_and_tool_call_parser_reach_the_app() -> None:
    """``--set-file 'models[0].chat_template=cluster/data/....jinja'`` puts the template's text in the
    values; the chart passes it (and ``tool_call_parser``, ``reasoning_parser``) through to the model's config unchanged."""
    from cluster.tiny_model.released_templates import tool_template_path

    text = tool_template_path("gemma3").read_text(encoding="utf-8")
    vals = yaml.safe_load((CHART / "values.yaml").read_text())
    vals["models"][0] |= {"chat_template": text, "tool_call_parser": "pythonic", "reasoning_parser": "auto"}
    schema = json.loads((CHART / "values.schema.json").read_text())
    jsonschema.validate(vals, schema)
    (m,) = _serve_config(vals).models
    assert (m.chat_template, m.tool_call_parser, m.reasoning_parser) == (text, "pythonic", "auto")
    (m,) = _serve_config(yaml.safe_load((CHART / "values.yaml").read_text())).models
    assert (m.chat_template, m.tool_call_parser, m.reasoning_parser) == (
        None,
        None,
        None,
    )  # unset: not written
    vals["models"][0]["reasoning_parser"] = "deepseek_r1"
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate(vals, schema)


def test_cpu_affinity_reaches_each_pool_and_bad_forms_are_refused() -> None:
    """``pools.<pool>.cpuAffinity``: the pool's ``deployment.cpu_affinity`` (E/P/D's roles each their own,
    over pools.llm's); unset: not pinned; a form that is no core list fails the schema."""
    values = yaml.safe_load((CHART / "values.yaml").read_text())
    (m,) = _serve_config(values).models
    assert m.llm.deployment.cpu_affinity is None  # off by default
    values["models"][0]["llm"]["pools"] = [{"role": "prefill"}, {"role": "decode"}]
    values["pools"]["llm"]["cpuAffinity"] = "0-1"
    values["pools"]["decode"] = {"cpuAffinity": "2|3"}
    values["pools"]["ingress"]["cpuAffinity"] = [4]
    cfg = _serve_config(values)
    (m,) = cfg.models
    assert (m.llm.pool("prefill").cpu_affinity, m.llm.pool("decode").cpu_affinity) == ("0-1", "2|3")
    assert cfg.ingress.deployment.cpu_affinity == [4] and m.encoder.deployment.cpu_affinity is None
    schema = json.loads((CHART / "values.schema.json").read_text())
    for bad in ("0-", "a", [-1], []):
        values["pools"]["encoder"]["cpuAffinity"] = bad
        with pytest.raises(jsonschema.ValidationError):
            jsonschema.validate(values, schema)
