"""`mmserve serve` on one machine: direct HTTP and encoder-side preparing unless the config says otherwise."""

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
    assert {m.preprocess.placement for m in cfg.models} == {"encoder"}
    assert AppConfig(models=cfg.models).models[0].preprocess.placement == "encoder"  # it stays set


def test_a_config_file_that_names_them_wins(tmp_path) -> None:  # type: ignore[no-untyped-def]
    path = tmp_path / "app.yaml"
    path.write_text(
        "models:\n"
        "  - {name: a, tiny: qwen2-vl, preprocess: {placement: pool}}\n"
        "  - {name: b, tiny: qwen2-audio}\n"
        "ingress: {http_mode: proxy}\n"
    )
    cfg = config_from_args(_args("--config", str(path)))
    assert [m.preprocess.placement for m in cfg.models] == ["pool", "encoder"]
    assert cfg.ingress.http_mode == "proxy"
    assert (
        config_from_args(_args("--config", str(path), "--http-mode", "direct")).ingress.http_mode == "direct"
    )
