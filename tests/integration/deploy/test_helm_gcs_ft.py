"""The chart turns on KubeRay GCS fault tolerance (external Redis) when asked, valid against the CRD."""

from __future__ import annotations

from typing import Any

import helm_python as helm
import jsonschema
import pytest
import yaml

from tests.integration.deploy.test_helm_chart import CHART, _rayservice_schema, _render


def _values(**gcs: Any) -> dict[str, Any]:
    values = yaml.safe_load((CHART / "values.yaml").read_text())
    values["gcsFaultTolerance"] = gcs
    return values


def test_off_by_default() -> None:
    (rs,) = _render(None)["RayService"]
    assert "gcsFaultToleranceOptions" not in rs["spec"]["rayClusterConfig"]


def test_on_renders_the_crd_options_with_the_password_from_a_secret() -> None:
    vals = _values(
        enabled=True,
        redisAddress="redis-master.redis.svc:6379",
        redisPasswordSecret={"name": "redis-auth", "key": "password"},
        externalStorageNamespace="mmserve-prod",
    )
    (rs,) = _render(vals)["RayService"]
    jsonschema.validate(rs, _rayservice_schema())
    assert rs["spec"]["rayClusterConfig"]["gcsFaultToleranceOptions"] == {
        "redisAddress": "redis-master.redis.svc:6379",
        "redisPassword": {"valueFrom": {"secretKeyRef": {"name": "redis-auth", "key": "password"}}},
        "externalStorageNamespace": "mmserve-prod",
    }


def test_the_crd_check_of_the_options_is_not_vacuous() -> None:
    (rs,) = _render(_values(enabled=True, redisAddress="redis:6379"))["RayService"]
    rs["spec"]["rayClusterConfig"]["gcsFaultToleranceOptions"]["backend"] = "etcd"
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate(rs, _rayservice_schema())


@pytest.mark.parametrize(
    "gcs",
    [
        {"enabled": True},  # no Redis to keep the state in
        {"enabled": True, "redisAddress": ""},
        {"enabled": True, "redisAddress": "r:6379", "redisPasswordSecret": {"name": "s"}},  # no key
        {"enabled": "yes"},
        {"enabled": False, "redis": "r:6379"},  # unknown key
    ],
)
def test_incomplete_or_unknown_settings_are_refused(gcs: dict[str, Any]) -> None:
    with pytest.raises(helm.HelmValuesError, match="schema"):
        helm.Chart.load(CHART).render(_values(**gcs), name="mm", namespace="ml")
