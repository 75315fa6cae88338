"""The Grafana dashboard (helm/mmserve/dashboards/mmserve.json): every panel's query names a metric
the e2e metrics test finds in a real scrape (tests/metric_names.py, the one list both tests read),
the panels the operator needs are there, and the chart ships it as a ConfigMap for Grafana's sidecar."""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import helm_python as helm
import yaml

from tests.metric_names import EXPORTED, STAGES

ROOT = Path(__file__).resolve().parents[4]
CHART = ROOT / "helm" / "mmserve"
DASHBOARD = CHART / "dashboards" / "mmserve.json"
METRIC = re.compile(r"\b(ray_[a-zA-Z0-9_]+)")
PROMQL_WORDS = {"by", "without", "on", "ignoring", "group_left", "group_right"}


def _dashboard() -> dict[str, Any]:
    return dict(json.loads(DASHBOARD.read_text()))


def _queries(dash: dict[str, Any]) -> list[tuple[str, str]]:
    return [(p["title"], t["expr"]) for p in dash["panels"] for t in p.get("targets", [])]


def _family(sample: str) -> str:
    for end in ("_bucket", "_count", "_sum"):
        if sample.endswith(end) and sample.removesuffix(end) in EXPORTED:
            return sample.removesuffix(end)
    return sample


def test_every_query_names_an_exported_metric() -> None:
    dash = _dashboard()
    queries = [*_queries(dash), ("$model", dash["templating"]["list"][1]["definition"])]
    assert len(queries) >= 16
    for title, expr in queries:
        names = METRIC.findall(expr)
        assert names, f"{title}: {expr} names no metric"
        unknown = {n for n in names if _family(n) not in EXPORTED}
        assert not unknown, f"{title}: {sorted(unknown)} are not exported (tests/metric_names.py)"
        assert expr.count("(") == expr.count(")") and expr.count("{") == expr.count("}"), expr
        for stage in re.findall(r'stage="([^"]+)"', expr):
            assert stage in {s for _, s in STAGES}, f"{title}: no stage {stage!r}"


def test_the_panels_an_operator_needs() -> None:
    dash = _dashboard()
    titles = {p["title"] for p in dash["panels"]}
    needed = {
        "Request rate (completed)",
        "Errors by code",
        "Time to first token",
        "Inter-token latency",
        "Per-stage latency p50",
        "Per-stage latency p99",
        "Encoder-cache hit rate",
        "Prefix-cache hit rate",
        "KV cache use",
        "Queue depths",
        "Replicas per pool",
    }
    assert needed <= titles, needed - titles
    ids = [p["id"] for p in dash["panels"]]
    assert len(ids) == len(set(ids))
    for p in dash["panels"]:
        assert p["datasource"]["uid"] == "${datasource}"  # whatever the Prometheus is called there
        assert [t["refId"] for t in p["targets"]] == [chr(65 + i) for i in range(len(p["targets"]))]
    stage_panels = [e for t, e in _queries(dash) if t.startswith("Per-stage")]
    assert all("ray_mmserve_stage_seconds" in e and "stage" in e for e in stage_panels)


def _configmaps(values: dict[str, Any] | None) -> list[dict[str, Any]]:
    rendered = helm.Chart.load(CHART).render(values, name="mm", namespace="ml")
    docs = [
        d
        for path, text in rendered.items()
        if not path.endswith("NOTES.txt")
        for d in yaml.safe_load_all(text)
    ]
    return [d for d in docs if isinstance(d, dict) and d["kind"] == "ConfigMap"]


def test_the_chart_ships_the_dashboard_for_grafanas_sidecar_when_asked() -> None:
    assert _configmaps(None) == []  # off by default
    (cm,) = _configmaps({"grafanaDashboard": {"enabled": True, "annotations": {"grafana_folder": "ml"}}})
    assert cm["metadata"]["labels"]["grafana_dashboard"] == "1"
    assert cm["metadata"]["annotations"] == {"grafana_folder": "ml"}
    assert json.loads(cm["data"]["mmserve.json"]) == _dashboard()  # the repo's file, byte for byte in JSON
    (elsewhere,) = _configmaps({"grafanaDashboard": {"enabled": True, "namespace": "monitoring"}})
    assert elsewhere["metadata"]["namespace"] == "monitoring"
