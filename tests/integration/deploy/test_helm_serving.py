"""How HTTP reaches the chart's Ray pods, and what every pod carries: the serve Service KubeRay builds
from the rendered RayService, Serve's environment, the model volume and Ray's token auth, each rendered with real Helm and checked against KubeRay's CRD schema.

The chart renders no Service of its own for HTTP: it hands KubeRay `spec.serveService`, and KubeRay
builds the Service. `kuberay_serve_service` and `kuberay_pods` below restate what KubeRay does with the
rendered spec (ray-project/kuberay, ray-operator/controllers/ray/common/service.go BuildServeService,
common/pod.go BuildPod and initLivenessAndReadinessProbe, rayservice_controller.go
updateHeadPodServeLabel and reconcileServices), so the tests check the Service as it will exist.
"""

from __future__ import annotations

import copy
from typing import Any

import helm_python as helm
import jsonschema
import pytest
import yaml

from cluster.config import AppConfig
from cluster.serve_env import SERVE_ENV_DEFAULTS
from tests.integration.deploy.helpers import app_mounts, app_volumes
from tests.integration.deploy.test_helm_chart import (
    CHART,
    _gpu_values,
    _rayservice_schema,
    _render,
    _serve_config,
)

SERVE_LABEL = "ray.io/serve"  # utils.RayClusterServingServiceLabelKey
CLUSTER_LABEL = "ray.io/cluster"  # utils.RayClusterLabelKey
DEFAULT_SERVING_PORT = 8000  # utils.DefaultServingPort


def _values(**changes: Any) -> dict[str, Any]:
    """values.yaml with dotted-path changes, e.g. _values(**{"service.port": 9000})."""
    values = yaml.safe_load((CHART / "values.yaml").read_text())
    for path, value in changes.items():
        node = values
        *parents, last = path.split(".")
        for p in parents:
            node = node[int(p)] if isinstance(node, list) else node.setdefault(p, {})
        node[last] = value
    return values


def _rayservice(values: dict[str, Any] | None) -> dict[str, Any]:
    (rs,) = _render(values)["RayService"]
    jsonschema.validate(rs, _rayservice_schema())
    return rs


def _serving_port(container: dict[str, Any]) -> int:
    """utils.FindContainerPort(container, "serve", 8000): the port KubeRay probes and serves on."""
    for port in container.get("ports", []):
        if port.get("name") == "serve":
            return int(port["containerPort"])
    return DEFAULT_SERVING_PORT


def kuberay_serve_service(rs: dict[str, Any], cluster: str) -> dict[str, Any]:
    """The Service KubeRay builds for a RayService whose traffic goes to RayCluster `cluster`."""
    spec = rs["spec"]
    head = spec["rayClusterConfig"]["headGroupSpec"]["template"]["spec"]["containers"][0]
    ports = [
        {"name": "serve", "port": p["containerPort"]}
        for p in head.get("ports", [])
        if p.get("name") == "serve"
    ]
    custom = spec.get("serveService")
    if not ports and custom is not None:  # the head declares no `serve` port: the custom one named `serve`
        ports = [
            {"name": "serve", "port": p["port"]}
            for p in custom["spec"].get("ports", [])
            if p.get("name") == "serve"
        ]
    if not ports:
        raise ValueError("Please specify the port named 'serve' in the Ray head container")
    svc = copy.deepcopy(custom) if custom is not None else {"metadata": {}, "spec": {}}
    svc["metadata"].setdefault("name", f"{rs['metadata']['name']}-serve-svc")
    # any selector the chart set is ignored; no targetPort: Kubernetes targets the same port number
    svc["spec"]["selector"] = {CLUSTER_LABEL: cluster, SERVE_LABEL: "true"}
    svc["spec"]["ports"] = ports[:1]
    return svc


def kuberay_pods(rs: dict[str, Any], cluster: str, head_proxy_healthy: bool = True) -> list[dict[str, Any]]:
    """The pods of one RayCluster of the RayService, one per group, with the labels KubeRay gives them:
    workers `ray.io/serve: "true"` (their readiness probe decides traffic), the head "true" only while
    its proxy answers and excludeHeadPodFromServeSvc is off."""
    spec = rs["spec"]
    rc = spec["rayClusterConfig"]
    head_serves = head_proxy_healthy and not spec.get("excludeHeadPodFromServeSvc", False)
    groups = [("headgroup", "head", rc["headGroupSpec"], head_serves)]
    groups += [(g["groupName"], "worker", g, True) for g in rc["workerGroupSpecs"]]
    pods = []
    for group, node_type, g, serves in groups:
        template = g["template"]
        labels = dict(template["metadata"].get("labels", {}))
        labels.update(
            {
                CLUSTER_LABEL: cluster,
                "ray.io/node-type": node_type,
                "ray.io/group": group,
                SERVE_LABEL: "true" if serves else "false",
            }
        )
        pods.append({"labels": labels, "node_type": node_type, "group": group, "spec": template["spec"]})
    return pods


def _selected(svc: dict[str, Any], pods: list[dict[str, Any]]) -> list[dict[str, Any]]:
    selector = svc["spec"]["selector"]
    return [p for p in pods if all(p["labels"].get(k) == v for k, v in selector.items())]


def _env(container: dict[str, Any]) -> dict[str, str]:
    return {e["name"]: e["value"] for e in container.get("env", [])}


def _ray_containers(rs: dict[str, Any]) -> list[dict[str, Any]]:
    return [p["spec"]["containers"][0] for p in kuberay_pods(rs, "c")]


@pytest.mark.parametrize(
    "values",
    [None, _gpu_values(), _values(**{"service.port": 9000})],
    ids=["defaults", "gpu-example", "port-9000"],
)
def test_the_service_reaches_every_worker_of_one_cluster_on_the_port_it_serves(values: dict | None) -> None:
    """During an upgrade both clusters' pods exist, with the same chart labels: the Service must reach
    the serving port of every worker of the cluster KubeRay points it at, and nothing of the other."""
    rs = _rayservice(values)
    port = (values or {}).get("service", {}).get("port", 8000)
    assert yaml.safe_load(rs["spec"]["serveConfigV2"])["http_options"]["port"] == port
    assert yaml.safe_load(rs["spec"]["serveConfigV2"])["proxy_location"] == "Disabled"  # direct HTTP
    old, new = kuberay_pods(rs, "mm-mmserve-old"), kuberay_pods(rs, "mm-mmserve-new")
    for active in (old, new):
        svc = kuberay_serve_service(rs, active[0]["labels"][CLUSTER_LABEL])
        assert svc["metadata"]["name"] == "mm-mmserve-http"
        reached = _selected(svc, old + new)
        workers = [p for p in active if p["node_type"] == "worker"]
        assert [p["group"] for p in workers] == ["encoder", "llm"]
        assert reached == workers  # every worker of the active cluster, not its head, nothing of the other
        (svc_port,) = svc["spec"]["ports"]
        for pod in reached:
            container = pod["spec"]["containers"][0]
            declared = {(p["name"], p["containerPort"]) for p in container["ports"]}
            assert ("serve", svc_port["port"]) in declared, pod["group"]
            assert _serving_port(container) == port  # where KubeRay's readiness probe GETs /-/healthz
            # a probe of the chart's own would replace KubeRay's, and with it the /-/healthz check
            assert "readinessProbe" not in container and "livenessProbe" not in container


@pytest.mark.parametrize(
    ("mode", "proxy_location"), [("direct", "Disabled"), ("proxy", "EveryNode")], ids=["direct", "proxy"]
)
def test_http_mode_decides_who_listens_on_the_serving_port(mode: str, proxy_location: str) -> None:
    """direct: the ingress replicas bind the pods' serving port themselves (and answer KubeRay's probe
    there, tests/integration/e2e/test_answers.py); proxy: Serve's proxy binds it and relays."""
    rs = _rayservice(_values(**{"service.httpMode": mode, "service.port": 8123}))
    cfg = yaml.safe_load(rs["spec"]["serveConfigV2"])
    assert cfg["proxy_location"] == proxy_location
    args = cfg["applications"][0]["args"]
    assert args["ingress"]["http_mode"] == mode
    assert (args["host"], args["port"]) == ("0.0.0.0", 8123)  # every pod's `serve` port, all interfaces
    for c in _ray_containers(rs):
        assert _serving_port(c) == 8123, c["name"]
    AppConfig.model_validate(args)  # the app takes it as rendered


def test_no_chart_service_reaches_the_serving_port_without_selecting_one_cluster() -> None:
    """A Service the chart renders itself cannot know the cluster's generated name, so during an upgrade
    it would select both clusters' pods: the HTTP Service must be KubeRay's."""
    vals = _values(**{"serviceMonitor.enabled": True})
    docs = _render(vals)
    port = vals["service"]["port"]
    for svc in docs.get("Service", []):
        for p in svc["spec"]["ports"]:
            if p.get("targetPort") in (port, "serve") or p["port"] == port:
                assert CLUSTER_LABEL in svc["spec"].get("selector", {}), svc["metadata"]["name"]
    assert "serveService" in docs["RayService"][0]["spec"]


def test_kuberay_takes_the_port_from_the_head_container() -> None:
    """KubeRay ignores serveService's ports when the head declares `serve`; the two must agree."""
    rs = _rayservice(_values(**{"service.port": 8123}))
    (declared,) = rs["spec"]["serveService"]["spec"]["ports"]
    (built,) = kuberay_serve_service(rs, "c")["spec"]["ports"]
    assert declared["port"] == built["port"] == 8123


def test_the_head_runs_no_replica_and_takes_no_traffic_by_default() -> None:
    rs = _rayservice(None)
    head = rs["spec"]["rayClusterConfig"]["headGroupSpec"]
    assert head["rayStartParams"]["num-cpus"] == "0"
    assert rs["spec"]["excludeHeadPodFromServeSvc"] is True
    head_pod = kuberay_pods(rs, "c", head_proxy_healthy=True)[0]
    assert head_pod["labels"][SERVE_LABEL] == "false"


def test_a_head_that_runs_replicas_can_serve() -> None:
    rs = _rayservice(_values(**{"cluster.head.runReplicas": True, "service.excludeHeadPod": False}))
    assert "num-cpus" not in rs["spec"]["rayClusterConfig"]["headGroupSpec"]["rayStartParams"]
    assert rs["spec"]["excludeHeadPodFromServeSvc"] is False
    pods = kuberay_pods(rs, "c")
    reached = _selected(kuberay_serve_service(rs, "c"), pods)
    assert [p["group"] for p in reached] == ["headgroup", "encoder", "llm"]
    assert _serving_port(pods[0]["spec"]["containers"][0]) == 8000


def test_the_values_serve_env_is_the_one_mmserve_serve_runs_with() -> None:
    assert _values()["serveEnv"] == SERVE_ENV_DEFAULTS


@pytest.mark.parametrize("values", [None, _gpu_values()], ids=["defaults", "gpu-example"])
def test_serve_env_reaches_every_ray_container(values: dict | None) -> None:
    rs = _rayservice(values)
    containers = _ray_containers(rs)
    assert len(containers) == 3
    for c in containers:
        assert _env(c) == SERVE_ENV_DEFAULTS, c["name"]


def test_haproxy_mode_and_removed_defaults_reach_every_container() -> None:
    vals = {
        "service": {"httpMode": "proxy"},  # HAProxy replaces Serve's proxy: there must be one
        "serveEnv": {"RAY_SERVE_ENABLE_HA_PROXY": "1", "RAY_SERVE_CONTROL_LOOP_INTERVAL_S": None},
    }
    rs = _rayservice(vals)  # merged into values.yaml; null removes a default
    expected = {k: v for k, v in SERVE_ENV_DEFAULTS.items() if k != "RAY_SERVE_CONTROL_LOOP_INTERVAL_S"}
    expected["RAY_SERVE_ENABLE_HA_PROXY"] = "1"
    for c in _ray_containers(rs):
        assert _env(c) == expected, c["name"]
        assert _serving_port(c) == 8000  # HAProxy binds http_options.port: same port, same probe
    assert yaml.safe_load(rs["spec"]["serveConfigV2"])["proxy_location"] == "EveryNode"


@pytest.mark.parametrize(
    "env",
    [{"RAY_AUTH_MODE": "token"}, {"RAY_AUTH_TOKEN": "x"}, {"BAD NAME": "1"}, {"RAY_SERVE_X": 1}],
)
def test_serve_env_refuses_auth_settings_and_bad_entries(env: dict[str, Any]) -> None:
    with pytest.raises(helm.HelmValuesError, match="schema"):
        helm.Chart.load(CHART).render({"serveEnv": env}, name="mm", namespace="ml")


def test_ray_token_auth_is_kuberay_s_by_default_and_optional() -> None:
    assert _rayservice(None)["spec"]["rayClusterConfig"]["authOptions"] == {"mode": "token"}
    assert _rayservice({"rayAuth": {"mode": "disabled"}})["spec"]["rayClusterConfig"]["authOptions"] == {
        "mode": "disabled"
    }
    assert "authOptions" not in _rayservice({"rayAuth": {"mode": ""}})["spec"]["rayClusterConfig"]
    with pytest.raises(helm.HelmValuesError, match="schema"):
        helm.Chart.load(CHART).render({"rayAuth": {"mode": "k8s"}}, name="mm", namespace="ml")


def _model_values(volume: dict[str, Any], path: str = "Qwen2-VL-7B-Instruct") -> dict[str, Any]:
    vals = _values()
    vals["models"][0].pop("tiny")
    vals["models"][0]["path"] = path
    vals["modelVolume"].update(volume)
    return vals


@pytest.mark.parametrize(
    ("volume", "source"),
    [
        (
            {"persistentVolumeClaim": "models"},
            {"persistentVolumeClaim": {"claimName": "models", "readOnly": True}},
        ),
        ({"hostPath": "/mnt/models"}, {"hostPath": {"path": "/mnt/models", "type": "Directory"}}),
    ],
    ids=["pvc", "hostPath"],
)
def test_model_volume_is_mounted_read_only_where_the_serve_config_points(volume: dict, source: dict) -> None:
    vals = _model_values({**volume, "mountPath": "/weights/"})
    rs = _rayservice(vals)
    (m,) = _serve_config(vals).models
    assert m.path == "/weights/Qwen2-VL-7B-Instruct"
    for pod in kuberay_pods(rs, "c"):
        spec = pod["spec"]
        assert app_volumes(spec) == [{"name": "mmserve-models", **source}], pod["group"]
        assert app_mounts(spec["containers"][0]) == [
            {"name": "mmserve-models", "mountPath": "/weights/", "readOnly": True}
        ]


def test_model_volume_sits_beside_the_api_keys_secret() -> None:
    vals = _model_values({"persistentVolumeClaim": "models"})
    vals["auth"]["apiKeysSecret"] = "keys"
    for pod in kuberay_pods(_rayservice(vals), "c"):
        assert [v["name"] for v in app_volumes(pod["spec"])] == ["mmserve-api-keys", "mmserve-models"]
        mounts = app_mounts(pod["spec"]["containers"][0])
        assert [(v["mountPath"], v["readOnly"]) for v in mounts] == [
            ("/etc/mmserve/auth", True),
            ("/models", True),
        ]


def test_an_absolute_model_path_is_kept_and_no_volume_is_mounted_without_one() -> None:
    vals = _model_values({}, path="/opt/baked/model")
    assert _serve_config(vals).models[0].path == "/opt/baked/model"
    for pod in kuberay_pods(_rayservice(vals), "c"):
        assert not app_volumes(pod["spec"]) and not app_mounts(pod["spec"]["containers"][0])


@pytest.mark.parametrize(
    ("vals", "error"),
    [
        (_model_values({}), helm.HelmError),  # relative path, no volume to hold it
        (_model_values({"persistentVolumeClaim": "m"}, path="../etc"), helm.HelmError),
        (_model_values({"persistentVolumeClaim": "m", "hostPath": "/mnt/m"}), helm.HelmValuesError),
        (_model_values({"hostPath": "relative/dir"}), helm.HelmValuesError),
        (_model_values({"persistentVolumeClaim": "m", "mountPath": "models"}), helm.HelmValuesError),
    ],
    ids=["relative-without-volume", "dot-dot", "pvc-and-hostPath", "relative-hostPath", "relative-mountPath"],
)
def test_model_volume_mistakes_are_refused(vals: dict[str, Any], error: type[Exception]) -> None:
    with pytest.raises(error):
        helm.Chart.load(CHART).render(vals, name="mm", namespace="ml")
