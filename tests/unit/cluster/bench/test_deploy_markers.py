"""``deploy_config``'s node markers reach the Serve deployments a config really makes: the encoder and
``llm.deployment`` of a colocated model, each LLM pool's own deployment of an E/P/D one."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from cluster.bench.local_cluster import REPO, deploy_config

PD = REPO / "cluster" / "deploy" / "serve-cpu-pd.yaml"
COLOCATED = REPO / "cluster" / "deploy" / "serve-cpu.yaml"


def _model(path: Path) -> dict:
    return yaml.safe_load(path.read_text())["applications"][0]["args"]["models"][0]


def test_llm_markers_reach_every_pd_pool(tmp_path: Path) -> None:
    markers = {"encoder": {"encoder_node": 0.001}, "llm": {"llm_node": 0.001}}
    deploy_config(PD, tmp_path / "c.yaml", 8123, resources=markers)
    model = _model(tmp_path / "c.yaml")
    assert model["encoder"]["deployment"]["resources"] == {"encoder_node": 0.001}
    pools = {p["role"]: p["deployment"] for p in model["llm"]["pools"]}
    assert pools["prefill"]["resources"] == {"llm_node": 0.001}
    assert pools["decode"]["resources"] == {"llm_node": 0.001}
    assert "deployment" not in model["llm"]  # E/P/D ignores it: nothing is written there
    # everything else is the shipped file's
    for p in model["llm"]["pools"]:
        p["deployment"].pop("resources")
    model["encoder"]["deployment"].pop("resources")
    assert model == _model(PD)


def test_a_roles_own_markers_come_before_llms(tmp_path: Path) -> None:
    markers = {"llm": {"llm_node": 0.001}, "prefill": {"prefill_node": 1.0}}
    deploy_config(PD, tmp_path / "c.yaml", 8123, resources=markers)
    pools = {p["role"]: p["deployment"] for p in _model(tmp_path / "c.yaml")["llm"]["pools"]}
    assert pools["prefill"]["resources"] == {"prefill_node": 1.0}
    assert pools["decode"]["resources"] == {"llm_node": 0.001}


def test_a_pools_own_resources_are_kept(tmp_path: Path) -> None:
    config = yaml.safe_load(PD.read_text())
    config["applications"][0]["args"]["models"][0]["llm"]["pools"][1]["deployment"]["resources"] = {"d": 1.0}
    pinned = tmp_path / "pinned.yaml"
    pinned.write_text(yaml.safe_dump(config))
    deploy_config(pinned, tmp_path / "c.yaml", 8123, resources={"llm": {"llm_node": 0.001}})
    pools = {p["role"]: p["deployment"] for p in _model(tmp_path / "c.yaml")["llm"]["pools"]}
    assert pools["prefill"]["resources"] == {"llm_node": 0.001}
    assert pools["decode"]["resources"] == {"d": 1.0}


def test_colocated_llm_markers_go_on_its_deployment(tmp_path: Path) -> None:
    deploy_config(COLOCATED, tmp_path / "c.yaml", 8123, resources={"llm": {"llm_node": 0.001}})
    assert _model(tmp_path / "c.yaml")["llm"]["deployment"]["resources"] == {"llm_node": 0.001}


def test_role_markers_without_pd_pools_are_refused(tmp_path: Path) -> None:
    with pytest.raises(KeyError, match="prefill"):
        deploy_config(COLOCATED, tmp_path / "c.yaml", 8123, resources={"prefill": {"prefill_node": 1.0}})
