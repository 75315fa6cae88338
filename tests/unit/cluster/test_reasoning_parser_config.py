"""``reasoning_parser`` per model (docs/reasoning.md): off by default, a known name or ``auto``, set by
``mmserve serve --reasoning-parser``; each thinking family's registry line names its parser."""

from __future__ import annotations

import argparse

import pytest
from pydantic import ValidationError

from cluster.config import ModelConfig
from llm_service.models.families import DECODER_FAMILIES
from llm_service.tools.reasoning import REASONING_FORMATS


def test_off_by_default_and_names_checked() -> None:
    assert ModelConfig(name="a", tiny="qwen3.5").reasoning_parser is None
    for name in ("auto", "qwen3", "gemma4"):
        assert ModelConfig(name="a", tiny="qwen3.5", reasoning_parser=name).reasoning_parser == name
    with pytest.raises(
        ValidationError, match="unknown reasoning_parser 'deepseek_r1'; known: auto, qwen3, gemma4"
    ):
        ModelConfig(name="a", tiny="qwen3.5", reasoning_parser="deepseek_r1")


def test_the_flag_sets_every_model() -> None:
    from cluster.serve_cli import add_serve_command, config_from_args

    parser = argparse.ArgumentParser()
    add_serve_command(parser.add_subparsers())
    cfg = config_from_args(parser.parse_args(["serve", "--reasoning-parser", "auto"]))
    assert cfg.models and all(m.reasoning_parser == "auto" for m in cfg.models)
    assert all(m.reasoning_parser is None for m in config_from_args(parser.parse_args(["serve"])).models)


def test_the_thinking_families_register_their_parser() -> None:
    named = {t: f.reasoning_format for t, f in DECODER_FAMILIES.items() if f.reasoning_format is not None}
    assert named == {"qwen3_5": "qwen3", "gemma4": "gemma4"}
    assert set(named.values()) <= set(REASONING_FORMATS)
