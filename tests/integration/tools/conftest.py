"""One app for the package, serving the tiny families whose released chat template reads ``tools``:
Qwen3-VL (hermes), Qwen3.5 (``<function=...>``) and Gemma 4 (``<|tool_call>``), and the four whose
checkpoints' templates have none, served with the shipped tool template as their ``chat_template``
(Qwen2-VL and Qwen2.5-VL hermes on Qwen3-VL's released template, Gemma 3 pythonic, Qwen2-Audio hermes on
the adapted template: docs/tools.md). Each model adds three replicas to the start (measured: 7 models
ready in 349 s, 3 in 212 s at load average ~45); tests/unit/router/journey/test_chat_template_override.py
also renders all four on both sides as HF. Shared by the
tools-in-the-prompt, tool-call and Responses-tools modules (one Ray start instead of three). Each
module's checks read counters as differences, and each sends its own images."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from cluster.tiny_model.released_templates import tool_template_path
from tests.integration.local_app import local_app
from tests.tiny_dirs import tiny_model_dir

MODEL = "tiny-qwen3-vl"
TOOL_FAMILIES = ("qwen3-vl", "qwen3.5", "gemma4")  # tiny families, as `tiny:` names them
# served with `chat_template:` the shipped tool template (cluster/tiny_model/released_templates.py)
OVERRIDE_FAMILIES = ("qwen2-vl", "qwen2.5-vl", "gemma3", "qwen2-audio")
# Gemma 3's tool template writes the tools as indented JSON: 1,662 prompt tokens with the tests' two
LLM = {"gemma3": {"max_model_len": 4096, "num_kv_blocks": 320}}
LIMIT_MM = {"gemma4": {"image": 4}, "gemma3": {"image": 4}, "qwen2-audio": {"audio": 2}}


def _model(family: str) -> dict[str, Any]:
    override = {"chat_template": str(tool_template_path(family))} if family in OVERRIDE_FAMILIES else {}
    # the override families from this process's tiny dirs (the unit tests' too: made once)
    where = {"path": str(tiny_model_dir(family))} if override else {"tiny": family}
    return {
        "name": f"tiny-{family}",
        **where,
        "llm": {"block_size": 16, **LLM.get(family, {"max_model_len": 2048, "num_kv_blocks": 256})},
        "encoder": {"cache_index_shards": 1},
        "preprocess": {"limit_mm_per_prompt": LIMIT_MM.get(family, {"image": 4, "video": 1})},
        **override,
    }


@pytest.fixture(scope="package")
def tool_app(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, Any]]:
    cache_dir = tmp_path_factory.mktemp("models")
    families = TOOL_FAMILIES + OVERRIDE_FAMILIES
    models = [_model(f) for f in families]
    with local_app({"models": models, "models_cache_dir": str(cache_dir)}, num_cpus=4) as client:
        dirs = {
            f: Path(m.get("path") or Path(cache_dir) / f"tiny-{f}")
            for f, m in zip(families, models, strict=True)
        }
        yield {"client": client, "dir": dirs["qwen3-vl"], "dirs": dirs}
