"""MMSERVE_STAGE_METRICS=0 turns the per-stage histograms off (what the lead measures against):
every stage still times and traces, but observes into no histogram and counts no cache answer."""

from __future__ import annotations

import pytest

from encoder_service.serve.metrics import media_stages, stage, stage_metrics_on


@pytest.mark.parametrize("value", ["0", "false", "off", "no"])
def test_stage_metrics_off(monkeypatch: pytest.MonkeyPatch, value: str) -> None:
    monkeypatch.setenv("MMSERVE_STAGE_METRICS", value)
    assert not stage_metrics_on()
    stages = media_stages("m", "encoder")
    assert stages.lookups is None
    assert all(s.histogram is None for s in (stages.fetch, stages.media_decode, stages.cache_lookup))
    stage("m", "encoder", "encode").observe(0.01)  # times nothing into anything: no error


def test_stage_metrics_on_by_default(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("MMSERVE_STAGE_METRICS", raising=False)
    assert stage_metrics_on()
    s = stage("m", "ingress", "prepare")
    assert s.name == "prepare" and s.histogram is not None
    assert s.histogram._default_tags == {"model": "m", "pool": "ingress", "stage": "prepare"}
