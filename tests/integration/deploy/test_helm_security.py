"""The chart's pod hardening and network isolation (issue 50, item 2), rendered with real Helm and
checked against KubeRay's CRD schema and Kubernetes' own (kubernetes-validate's offline JSON schemas,
strict: unknown fields are errors) for the oldest Kubernetes the chart supports and the newest:

- every Ray pod runs as rayproject/ray's user (uid 1000, gid 100) with a read-only root filesystem, no
  capabilities, no privilege escalation and RuntimeDefault seccomp, and writes only to emptyDirs;
- no pod mounts a service-account token; the KubeRay autoscaler sidecar alone gets one;
- a NetworkPolicy admits Ray's ports only from the release's pods, the HTTP port from
  networkPolicy.httpFrom, the dashboard from the KubeRay operator;
- the install notes warn when no API key is set.
"""

from __future__ import annotations

import copy
import os
from typing import Any

import helm_python as helm
import jsonschema
import kubernetes_validate
import pytest
import yaml

from cluster.config import AppConfig
from tests.integration.deploy.helpers import HARDENING_VOLUMES
from tests.integration.deploy.test_helm_chart import CHART, _rayservice_schema, _render, _serve_config

KUBE_VERSIONS = ("1.25.0", kubernetes_validate.latest_version())  # Chart.yaml kubeVersion >=1.25
TOKEN_DIR = "/var/run/secrets/kubernetes.io/serviceaccount"
RAY_HOME = "/home/ray"  # rayproject/ray's user `ray`
RELEASE = {"app.kubernetes.io/name": "mmserve", "app.kubernetes.io/instance": "mm"}
OPERATOR = {"app.kubernetes.io/name": "kuberay-operator", "app.kubernetes.io/instance": "kuberay-operator"}
# Ray's ports on a pod: GCS, dashboard, client, metrics, dashboard agent, a raylet / worker port.
RAY_PORTS = (6379, 8265, 10001, 8080, 52365, 10002)


def _values() -> dict[str, Any]:
    return yaml.safe_load((CHART / "values.yaml").read_text())


def _templates(rs: dict[str, Any]) -> list[dict[str, Any]]:
    cluster = rs["spec"]["rayClusterConfig"]
    return [cluster["headGroupSpec"]["template"]] + [g["template"] for g in cluster["workerGroupSpecs"]]


def _k8s_valid(doc: dict[str, Any]) -> None:
    for version in KUBE_VERSIONS:
        kubernetes_validate.validate(doc, version, strict=True)


def _as_pod(template: dict[str, Any], name: str = "p") -> dict[str, Any]:
    """A pod template as the Pod KubeRay creates from it, for Kubernetes' Pod schema."""
    return {"apiVersion": "v1", "kind": "Pod", "metadata": {**template["metadata"], "name": name}, **template}


def _rendered(values: dict[str, Any] | None) -> tuple[dict[str, Any], list[dict[str, Any]]]:
    """The RayService (checked against KubeRay's CRD, its pods against Kubernetes' Pod schema) and the
    NetworkPolicies (checked against Kubernetes' schema)."""
    docs = _render(values)
    (rs,) = docs["RayService"]
    jsonschema.validate(rs, _rayservice_schema())
    for i, template in enumerate(_templates(rs)):
        _k8s_valid(_as_pod(template, f"p{i}"))
    policies = docs.get("NetworkPolicy", [])
    for policy in policies:
        _k8s_valid(policy)
    return rs, policies


def _notes(values: dict[str, Any] | None) -> str:
    rendered = helm.Chart.load(CHART).render(values, name="mm", namespace="ml")
    (notes,) = [text for path, text in rendered.items() if path.endswith("NOTES.txt")]
    return notes


def _refused(values: dict[str, Any]) -> None:
    """The schema takes the key and refuses the value inside it (not the key itself: `at ''`)."""
    (key,) = values
    with pytest.raises(helm.HelmValuesError, match=rf"schema(.|\n)*at '/{key}['/]"):
        helm.Chart.load(CHART).render(values, name="mm", namespace="ml")


# ----------------------------------------------------------------------------------- security context


def test_every_ray_pod_runs_hardened_by_default() -> None:
    rs, _ = _rendered(None)
    templates = _templates(rs)
    assert len(templates) == 3
    for t in templates:
        pod = t["spec"]
        assert pod["securityContext"] == {
            "runAsNonRoot": True,
            "runAsUser": 1000,
            "runAsGroup": 100,
            "fsGroup": 100,
            "seccompProfile": {"type": "RuntimeDefault"},
        }
        (container,) = pod["containers"]
        assert container["securityContext"] == {
            "readOnlyRootFilesystem": True,
            "allowPrivilegeEscalation": False,
            "capabilities": {"drop": ["ALL"]},
            "seccompProfile": {"type": "RuntimeDefault"},
        }
        empty_dirs = {v["name"]: v["emptyDir"] for v in pod["volumes"] if "emptyDir" in v}
        mounts = {m["mountPath"]: m["name"] for m in container["volumeMounts"]}
        for path in ("/tmp", "/dev/shm", f"{RAY_HOME}/.cache", f"{RAY_HOME}/.ray"):
            assert mounts[path] in empty_dirs, path
        assert empty_dirs[mounts["/dev/shm"]] == {"medium": "Memory"}  # the object store, as KubeRay's own


def test_the_apps_cache_dir_is_writable() -> None:
    """cluster.model_dirs generates tiny models under models_cache_dir (the chart leaves the default)."""
    (rs,) = _render(None)["RayService"]
    cfg = _serve_config(None)
    assert cfg.models_cache_dir == AppConfig.model_fields["models_cache_dir"].default
    cache = os.path.normpath(cfg.models_cache_dir.replace("~", RAY_HOME, 1))
    for t in _templates(rs):
        (container,) = t["spec"]["containers"]
        writable = [m["mountPath"] for m in container["volumeMounts"] if not m.get("readOnly")]
        assert any(cache.startswith(path.rstrip("/") + "/") for path in writable), (cache, writable)


def test_hardening_volume_names_are_the_charts() -> None:
    """helpers.HARDENING_VOLUMES (what the volume tests look past) names what the chart mounts."""
    names = {d["name"] for d in _values()["writableDirs"]} | {"kube-api-access-autoscaler"}
    assert names == HARDENING_VOLUMES


def test_security_contexts_and_writable_dirs_are_overridable() -> None:
    values = {
        "podSecurityContext": {"runAsUser": 2000, "runAsGroup": 3000, "fsGroup": 3000},
        "securityContext": {"readOnlyRootFilesystem": None},  # null drops a default
        "writableDirs": [{"name": "scratch", "mountPath": "/scratch", "sizeLimit": "10Gi"}],
    }
    rs, _ = _rendered(values)
    for t in _templates(rs):
        pod = t["spec"]
        assert (pod["securityContext"]["runAsUser"], pod["securityContext"]["fsGroup"]) == (2000, 3000)
        assert pod["securityContext"]["runAsNonRoot"] is True  # the defaults it did not name stay
        (container,) = pod["containers"]
        assert "readOnlyRootFilesystem" not in container["securityContext"]
        assert container["securityContext"]["capabilities"] == {"drop": ["ALL"]}
        assert [v for v in pod["volumes"] if "emptyDir" in v] == [
            {"name": "scratch", "emptyDir": {"sizeLimit": "10Gi"}}
        ]
        assert container["volumeMounts"] == [{"name": "scratch", "mountPath": "/scratch"}]


@pytest.mark.parametrize(
    "values",
    [
        {"podSecurityContext": {"runAsUser": "ray"}},
        {"podSecurityContext": {"runAsRoot": False}},  # not a PodSecurityContext field
        {"securityContext": {"capabilities": {"drop": "ALL"}}},
        {"securityContext": {"privileged": "no"}},
        {"writableDirs": [{"name": "tmp", "mountPath": "tmp"}]},
        {"writableDirs": [{"name": "shm", "mountPath": "/dev/shm", "medium": "HugePages"}]},
        {"networkPolicy": {"httpFrom": [{"podSelectr": {}}]}},
        {"networkPolicy": {"httpFrom": {"podSelector": {}}}},
        {"networkPolicy": {"enable": True}},
    ],
    ids=[
        "runAsUser-name",
        "unknown-pod-field",
        "drop-not-list",
        "privileged-string",
        "relative-mount",
        "medium",
        "peer-typo",
        "peers-not-list",
        "enable-typo",
    ],
)
def test_bad_security_values_are_refused(values: dict[str, Any]) -> None:
    _refused(values)


# ------------------------------------------------------------------------------ service-account token


def _autoscaler_pod(rs: dict[str, Any]) -> dict[str, Any]:
    """The head pod with the autoscaler sidecar KubeRay adds from autoscalerOptions."""
    cluster = rs["spec"]["rayClusterConfig"]
    template = copy.deepcopy(cluster["headGroupSpec"]["template"])
    opts = cluster["autoscalerOptions"]
    sidecar = {"name": "autoscaler", "image": "autoscaler"}
    sidecar.update({k: opts[k] for k in ("securityContext", "volumeMounts") if k in opts})
    template["spec"]["containers"].append(sidecar)
    return _as_pod(template)


def test_no_pod_mounts_a_token_and_the_autoscaler_gets_its_own() -> None:
    rs, _ = _rendered(None)
    assert rs["spec"]["rayClusterConfig"]["enableInTreeAutoscaling"] is True  # the default
    for t in _templates(rs):
        assert t["spec"]["automountServiceAccountToken"] is False
        (container,) = t["spec"]["containers"]
        assert not [m for m in container["volumeMounts"] if m["mountPath"].startswith("/var/run/secrets")]
    pod = _autoscaler_pod(rs)
    _k8s_valid(pod)
    ray_head, sidecar = pod["spec"]["containers"]
    assert sidecar["volumeMounts"] == [
        {"name": "kube-api-access-autoscaler", "mountPath": TOKEN_DIR, "readOnly": True}
    ]
    assert sidecar["securityContext"] == ray_head["securityContext"]
    (token,) = [v for v in pod["spec"]["volumes"] if v["name"] == "kube-api-access-autoscaler"]
    sources = token["projected"]["sources"]
    assert [next(iter(s)) for s in sources] == ["serviceAccountToken", "configMap", "downwardAPI"]
    paths = {sources[0]["serviceAccountToken"]["path"]} | {
        i["path"] for s in sources[1:] for i in next(iter(s.values()))["items"]
    }
    assert paths == {"token", "ca.crt", "namespace"}  # what the kubelet mounts, and Ray's autoscaler reads
    workers = _templates(rs)[1:]
    assert all("kube-api-access-autoscaler" not in {v["name"] for v in w["spec"]["volumes"]} for w in workers)


def test_without_the_autoscaler_no_pod_has_a_token() -> None:
    rs, _ = _rendered({"cluster": {"enableInTreeAutoscaling": False}})
    for t in _templates(rs):
        assert t["spec"]["automountServiceAccountToken"] is False
        assert "kube-api-access-autoscaler" not in {v["name"] for v in t["spec"]["volumes"]}
    assert "volumeMounts" not in rs["spec"]["rayClusterConfig"].get("autoscalerOptions", {})


# ------------------------------------------------------------------------------------ network policy


def _selects(selector: dict[str, Any], labels: dict[str, str]) -> bool:
    assert set(selector) <= {"matchLabels"}, selector  # the chart's selectors use matchLabels only
    return all(labels.get(k) == v for k, v in selector.get("matchLabels", {}).items())


def _admits(
    policy: dict[str, Any], port: int, labels: dict[str, str], namespace: dict[str, str] | None
) -> bool:
    """Whether the policy lets a pod with `labels` in a namespace labelled `namespace` (None: the
    policy's own namespace) connect to `port` on a pod it selects (Kubernetes' NetworkPolicy rules)."""
    for rule in policy["spec"].get("ingress", []):
        if rule.get("ports") and port not in [p["port"] for p in rule["ports"]]:
            continue
        peers = rule.get("from")
        if not peers:
            return True
        for peer in peers:
            if "ipBlock" in peer:
                continue
            if "namespaceSelector" in peer:
                ns_ok = namespace is not None and _selects(peer["namespaceSelector"], namespace)
                ns_ok = ns_ok or (namespace is None and _selects(peer["namespaceSelector"], {}))
            else:
                ns_ok = namespace is None
            if ns_ok and _selects(peer.get("podSelector", {}), labels):
                return True
    return False


def test_network_policy_admits_ray_ports_only_from_the_release() -> None:
    rs, policies = _rendered(None)
    (policy,) = policies
    spec = policy["spec"]
    assert spec["policyTypes"] == ["Ingress"]
    assert spec["podSelector"] == {"matchLabels": RELEASE}
    for t in _templates(rs):  # every Ray pod is selected (KubeRay keeps the template's labels)
        assert _selects(spec["podSelector"], t["metadata"]["labels"])
    release_pod = {**RELEASE, "mmserve.io/group": "encoder", "ray.io/cluster": "mm-mmserve-x"}
    other_pod = {"app": "curl"}
    other_ns = {"kubernetes.io/metadata.name": "other"}
    for port in RAY_PORTS:
        assert _admits(policy, port, release_pod, None), port
        assert not _admits(policy, port, other_pod, None), port
        assert not _admits(policy, port, other_pod, other_ns), port
        assert not _admits(policy, port, RELEASE, other_ns), port  # the release's labels elsewhere
    assert _admits(policy, 8000, other_pod, None) and _admits(policy, 8000, other_pod, other_ns)
    operator_ns = {"kubernetes.io/metadata.name": "kuberay-system"}
    assert _admits(policy, 8265, OPERATOR, operator_ns)  # KubeRay reaches the dashboard ...
    assert not [p for p in RAY_PORTS if p != 8265 and _admits(policy, p, OPERATOR, operator_ns)]  # only


def test_network_policy_peers_come_from_values() -> None:
    team = {"namespaceSelector": {"matchLabels": {"team": "a"}}}
    prometheus = {"namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": "monitoring"}}}
    extra = {"ports": [{"port": 10001, "protocol": "TCP"}], "from": [{"ipBlock": {"cidr": "10.1.0.0/16"}}]}
    values = {
        "service": {"port": 9000},
        "networkPolicy": {"httpFrom": [team], "metricsFrom": [prometheus], "extraIngress": [extra]},
    }
    _, (policy,) = _rendered(values)
    rules = policy["spec"]["ingress"]
    assert {"ports": [{"port": 9000, "protocol": "TCP"}], "from": [team]} in rules
    assert {"ports": [{"port": 8080, "protocol": "TCP"}], "from": [prometheus]} in rules
    assert rules[-1] == extra
    assert _admits(policy, 9000, {}, {"team": "a"}) and not _admits(policy, 9000, {}, {"team": "b"})
    assert not _admits(policy, 9000, {"app": "curl"}, None)
    assert _admits(policy, 8080, {}, {"kubernetes.io/metadata.name": "monitoring"})


def test_network_policy_can_be_turned_off() -> None:
    _, policies = _rendered({"networkPolicy": {"enabled": False}})
    assert policies == []
    assert "networkPolicy.enabled is false" in _notes({"networkPolicy": {"enabled": False}})


# ------------------------------------------------------------------------------------------ the notes


def test_notes_warn_when_no_api_key_is_set() -> None:
    assert _values()["auth"]["apiKeysSecret"] == ""  # the default: no keys
    notes = _notes(None)
    assert "WARNING: no API key is set" in notes
    assert "auth.apiKeysSecret" in notes
    assert "no API key" not in _notes({"auth": {"apiKeysSecret": "mm-keys"}})


def test_notes_warn_when_rays_token_auth_is_off() -> None:
    assert "token authentication is off" not in _notes(None)
    assert "token authentication is off" in _notes({"rayAuth": {"mode": "disabled"}})
