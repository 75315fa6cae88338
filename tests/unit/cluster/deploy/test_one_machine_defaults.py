"""`mmserve serve` on one machine: direct HTTP and one cache shard unless the config says otherwise."""

from __future__ import annotations

import argparse

from cluster.config import AppConfig
from cluster.serve_cli import add_serve_command, config_from_args


def _args(*argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    add_serve_command(parser.add_subparsers())
    return parser.parse_args(["serve", *argv])


def test_defaults_on_one_machine() -> None:
    cfg = config_from_args(_args())
    assert cfg.ingress.http_mode == "direct"
    assert {m.encoder.cache_index_shards for m in cfg.models} == {1}
    assert AppConfig(models=cfg.models).models[0].encoder.cache_index_shards == 1  # it stays set


def test_a_config_file_that_names_them_wins(tmp_path) -> None:  # type: ignore[no-untyped-def]
    path = tmp_path / "app.yaml"
    path.write_text(
        "models:\n"
        "  - {name: a, tiny: qwen2-vl, encoder: {cache_index_shards: 3}}\n"
        "  - {name: b, tiny: qwen2-audio}\n"
        "ingress: {http_mode: proxy}\n"
    )
    cfg = config_from_args(_args("--config", str(path)))
    assert [m.encoder.cache_index_shards for m in cfg.models] == [3, 1]
    assert cfg.ingress.http_mode == "proxy"
    assert (
        config_from_args(_args("--config", str(path), "--http-mode", "direct")).ingress.http_mode == "direct"
    )


def test_a_pool_that_cannot_scale_runs_a_fixed_count(tmp_path) -> None:  # type: ignore[no-untyped-def]
    from cluster.app import deployment_options

    path = tmp_path / "app.yaml"
    path.write_text(
        "models:\n"
        "  - name: a\n"
        "    tiny: qwen2-vl\n"
        "    encoder: {deployment: {autoscaling: {min_replicas: 1, max_replicas: 3}}}\n"
        "    llm: {deployment: {autoscaling: {min_replicas: 2, max_replicas: 2}}}\n"
        "ingress: {deployment: {num_replicas: 3}}\n"
    )
    cfg = config_from_args(_args("--config", str(path)))
    m = cfg.models[0]
    assert cfg.ingress.deployment.num_replicas == 3  # set: kept
    assert m.llm.deployment.num_replicas == 2
    assert m.encoder.deployment.num_replicas is None  # it can scale: Serve's autoscaling stays
    llm = deployment_options(m.llm.deployment, "LLMServer-a")
    assert llm["num_replicas"] == 2 and "autoscaling_config" not in llm
    assert "autoscaling_config" in deployment_options(m.encoder.deployment, "EncoderServer-a")


def test_pd_gives_every_model_a_prefill_and_a_decode_pool() -> None:
    """``mmserve serve --pd``: each model's LLM as E/P/D's two pools, each on the model's LLM options
    (fixed at one replica here, as the LLM pool is); the config refuses what E/P/D does not take."""
    import pytest
    from pydantic import ValidationError

    cfg = config_from_args(_args("--pd"))
    for m in cfg.models:
        assert m.llm.roles == ["prefill", "decode"]
        for role in ("prefill", "decode"):
            assert m.llm.pool(role).num_replicas == 1
            assert m.llm.pool(role).num_cpus == m.llm.deployment.num_cpus
    with pytest.raises(ValidationError, match="overlap_prefill"):
        config_from_args(_args("--pd", "--overlap-prefill"))
    assert config_from_args(_args()).models[0].llm.roles == ["both"]
