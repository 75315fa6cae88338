"""The chart's ``upgradeStrategy``: KubeRay's NewCluster by default, None, and NewClusterWithIncrementalUpgrade
with its options, rendered with real Helm and checked against KubeRay's CRD schema; what KubeRay would
refuse is refused at render time."""

from __future__ import annotations

import copy
from typing import Any

import helm_python as helm
import jsonschema
import pytest

from tests.integration.deploy.test_helm_chart import CHART, _rayservice_schema
from tests.integration.deploy.test_helm_serving import _rayservice


def test_upgrade_strategy_defaults_to_a_new_cluster_and_takes_none() -> None:
    assert _rayservice(None)["spec"]["upgradeStrategy"] == {"type": "NewCluster"}
    assert _rayservice({"upgradeStrategy": {"type": "None"}})["spec"]["upgradeStrategy"] == {"type": "None"}


def test_incremental_upgrade_renders_its_options() -> None:
    options = {
        "gatewayClassName": "istio",
        "stepSizePercent": 20,
        "intervalSeconds": 30,
        "maxSurgePercent": 40,
    }
    vals = {"upgradeStrategy": {"type": "NewClusterWithIncrementalUpgrade", "clusterUpgradeOptions": options}}
    assert _rayservice(vals)["spec"]["upgradeStrategy"] == vals["upgradeStrategy"]


def test_the_crd_check_of_the_upgrade_strategy_is_not_vacuous() -> None:
    rs = _rayservice(None)
    rs["spec"]["upgradeStrategy"]["clusterUpgradeOptions"] = {
        "gatewayClassName": "istio"
    }  # two required missing
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate(rs, _rayservice_schema())


@pytest.mark.parametrize(
    "strategy",
    [
        {"type": "Recreate"},
        {"type": "NewClusterWithIncrementalUpgrade"},  # no options
        {"type": "NewClusterWithIncrementalUpgrade", "clusterUpgradeOptions": {"gatewayClassName": "istio"}},
        {
            "type": "NewCluster",
            "clusterUpgradeOptions": {"gatewayClassName": "i", "stepSizePercent": 1, "intervalSeconds": 1},
        },
    ],
    ids=[
        "unknown-type",
        "incremental-without-options",
        "incremental-partial-options",
        "options-without-incremental",
    ],
)
def test_bad_upgrade_strategies_are_refused_by_the_schema(strategy: dict[str, Any]) -> None:
    with pytest.raises(helm.HelmValuesError, match="schema"):
        helm.Chart.load(CHART).render({"upgradeStrategy": strategy}, name="mm", namespace="ml")


@pytest.mark.parametrize(
    ("changes", "match"),
    [
        ({"cluster": {"enableInTreeAutoscaling": False}}, "enableInTreeAutoscaling"),
        (
            {"upgradeStrategy": {"clusterUpgradeOptions": {"stepSizePercent": 50, "maxSurgePercent": 25}}},
            "maxSurgePercent",
        ),
    ],
    ids=["without-autoscaler", "step-above-surge"],
)
def test_incremental_upgrade_needs_what_kuberay_needs(changes: dict[str, Any], match: str) -> None:
    base = {
        "upgradeStrategy": {
            "type": "NewClusterWithIncrementalUpgrade",
            "clusterUpgradeOptions": {
                "gatewayClassName": "istio",
                "stepSizePercent": 20,
                "intervalSeconds": 30,
            },
        }
    }
    vals = copy.deepcopy(base)
    for key, value in changes.items():
        vals.setdefault(key, {})
        for k, v in value.items():
            if isinstance(v, dict):
                vals[key].setdefault(k, {}).update(v)
            else:
                vals[key][k] = v
    with pytest.raises(helm.HelmError, match=match):
        helm.Chart.load(CHART).render(vals, name="mm", namespace="ml")
