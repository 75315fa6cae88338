"""The chart's API keys: a Secret mounted in every Ray pod, named to the ingress as its keys file."""

from __future__ import annotations

import jsonschema
import pytest

from tests.integration.deploy.helpers import app_mounts, app_volumes
from tests.integration.deploy.test_helm_chart import _rayservice_schema, _render, _serve_config


def _pods(rs: dict) -> list[dict]:
    cluster = rs["spec"]["rayClusterConfig"]
    return [cluster["headGroupSpec"]["template"]["spec"]] + [
        g["template"]["spec"] for g in cluster["workerGroupSpecs"]
    ]


def test_keys_secret_is_mounted_everywhere_and_read_by_the_ingress() -> None:
    values = {"auth": {"apiKeysSecret": "mm-keys", "apiKeysSecretKey": "keys.yaml"}}
    (rs,) = _render(values)["RayService"]
    jsonschema.validate(rs, _rayservice_schema())
    assert _serve_config(values).ingress.api_keys_file == "/etc/mmserve/auth/keys.yaml"
    pods = _pods(rs)
    assert len(pods) == 3
    for pod in pods:
        assert app_volumes(pod) == [{"name": "mmserve-api-keys", "secret": {"secretName": "mm-keys"}}]
        (container,) = pod["containers"]
        assert app_mounts(container) == [
            {"name": "mmserve-api-keys", "mountPath": "/etc/mmserve/auth", "readOnly": True}
        ]


def test_no_secret_no_keys() -> None:
    (rs,) = _render(None)["RayService"]
    assert _serve_config(None).ingress.api_keys_file is None
    assert all(not app_volumes(pod) and not app_mounts(pod["containers"][0]) for pod in _pods(rs))


@pytest.mark.parametrize("value", [{"apiKeysSecret": 3}, {"apiKeysSecretKey": "../x"}, {"other": "x"}])
def test_bad_auth_values_are_refused(value: dict) -> None:
    with pytest.raises(Exception, match=r"(?i)schema|valid|auth"):
        _render({"auth": value})


def test_operator_key_secret_reaches_every_ray_container_as_its_env() -> None:
    values = {"auth": {"apiKeysSecret": "mm-keys", "operatorKeySecret": "mm-operator"}}
    (rs,) = _render(values)["RayService"]
    jsonschema.validate(rs, _rayservice_schema())
    for pod in _pods(rs):
        (container,) = pod["containers"]
        (env,) = [e for e in container.get("env", []) if e["name"] == "MMSERVE_OPERATOR_API_KEY"]
        assert env["valueFrom"] == {"secretKeyRef": {"name": "mm-operator", "key": "operator-api-key"}}
    (rs,) = _render(None)["RayService"]
    for pod in _pods(rs):
        assert all(e["name"] != "MMSERVE_OPERATOR_API_KEY" for e in pod["containers"][0].get("env", []))
    with pytest.raises(Exception, match=r"(?i)schema|valid|auth"):
        _render({"auth": {"operatorKeySecret": "Bad_Name"}})
