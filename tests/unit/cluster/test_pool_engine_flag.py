"""``mmserve serve --pool-engine ROLE.KEY=VALUE``: argument → AppConfig (no Ray), each refusal naming
the flag and what is wrong."""

from __future__ import annotations

import argparse
import shlex
from pathlib import Path

import pytest
import yaml
from pydantic import ValidationError

from cluster.config import AppConfig
from cluster.serve_cli import add_serve_command, config_from_args


def cfg(*argv: str) -> AppConfig:
    parser = argparse.ArgumentParser()
    add_serve_command(parser.add_subparsers())
    return config_from_args(parser.parse_args(["serve", *argv]))


def test_each_pool_gets_its_own_settings_over_the_models_llm() -> None:
    c = cfg(
        "--pd",
        "--max-num-batched-tokens",
        "256",
        "--pool-engine",
        "prefill.max_num_batched_tokens=1024",
        "--pool-engine",
        "decode.num_kv_blocks=4096",
        "--pool-engine",
        "decode.max_num_seqs=96",
        "--pool-engine",
        "decode.kv_swap_space_mib=12.5",
    )
    assert c.models  # every model of the default config
    for m in c.models:
        prefill, decode = m.llm.for_role("prefill"), m.llm.for_role("decode")
        assert prefill.max_num_batched_tokens == 1024 and decode.max_num_batched_tokens == 256
        assert (decode.num_kv_blocks, decode.max_num_seqs, decode.kv_swap_space_mib) == (4096, 96, 12.5)
        assert prefill.num_kv_blocks == m.llm.num_kv_blocks and prefill.max_num_seqs == m.llm.max_num_seqs


def test_a_configs_pools_take_the_flag_over_their_own(tmp_path: Path) -> None:
    pools = [
        {"role": "prefill", "engine": {"max_num_batched_tokens": 512, "torch_threads": 2}},
        {"role": "decode"},
    ]
    path = tmp_path / "app.yaml"
    path.write_text(yaml.safe_dump({"models": [{"name": "m", "tiny": "qwen2-vl", "llm": {"pools": pools}}]}))
    c = cfg("--config", str(path), "--pool-engine", "prefill.max_num_batched_tokens=2048")
    prefill = c.models[0].llm.for_role("prefill")
    assert (prefill.max_num_batched_tokens, prefill.torch_threads) == (2048, 2)


@pytest.mark.parametrize(
    ("flag", "says"),
    [
        ("prefill.max_num_batched_tokens", "ROLE.KEY=VALUE"),
        ("max_num_batched_tokens=2048", "ROLE.KEY=VALUE"),
        ("encoder.max_num_seqs=4", "ROLE is one of prefill, decode, not 'encoder'"),
        ("decode.max_num_sequences=4", "unknown key 'max_num_sequences'; a pool sets num_kv_blocks"),
        ("decode.block_size=32", "block_size must be the same in the prefill and decode pools"),
        ("prefill.max_model_len=4096", "set it for the model's llm"),
        ("decode.max_num_seqs=many", "VALUE is a number, not 'many'"),
    ],
)
def test_bad_flags_are_refused_naming_what_is_wrong(flag: str, says: str) -> None:
    with pytest.raises(SystemExit, match=f"--pool-engine '{flag}'.*{says}"):
        cfg("--pd", "--pool-engine", flag)


def test_a_model_not_deployed_as_epd_is_refused() -> None:
    with pytest.raises(SystemExit, match="is not deployed as E/P/D \\(no prefill pool\\): add --pd"):
        cfg("--pool-engine", "prefill.max_num_batched_tokens=2048")


@pytest.mark.parametrize(
    ("flag", "field"),
    [
        ("decode.max_num_seqs=0", "max_num_seqs"),  # LLMPoolEngine's bounds
        ("prefill.kv_swap_space_mib=64", "kv_swap_space_mib"),  # a decode pool's setting only
    ],
)
def test_values_are_checked_by_the_config(flag: str, field: str) -> None:
    with pytest.raises(ValidationError, match=field):
        cfg("--pd", "--pool-engine", flag)


def test_the_documented_command_gives_the_pools_it_says() -> None:
    """docs/disaggregation.md's `--pool-engine` command, as written there."""
    page = (Path(__file__).parents[3] / "docs" / "disaggregation.md").read_text()
    block = page.split("```\nmmserve serve --pd", 1)[1].split("```", 1)[0]
    argv = shlex.split("--pd" + block.replace("\\\n", " "))
    c = cfg(*argv)
    for m in c.models:
        prefill, decode = m.llm.for_role("prefill"), m.llm.for_role("decode")
        assert (prefill.max_num_batched_tokens, decode.max_num_batched_tokens) == (1024, 256)
        assert (decode.num_kv_blocks, decode.max_num_seqs) == (2048, 64)
