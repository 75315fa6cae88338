"""One app for the package, serving the tiny families whose released chat template reads ``tools``:
Qwen3-VL (hermes), Qwen3.5 (``<function=...>``) and Gemma 4 (``<|tool_call>``), shared by the
tools-in-the-prompt, tool-call and Responses-tools modules (one Ray start instead of three). Each
module's checks read counters as differences, and each sends its own images."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.integration.local_app import local_app

MODEL = "tiny-qwen3-vl"
TOOL_FAMILIES = ("qwen3-vl", "qwen3.5", "gemma4")  # tiny families, as `tiny:` names them


def _model(family: str) -> dict[str, Any]:
    return {
        "name": f"tiny-{family}",
        "tiny": family,
        "llm": {"max_model_len": 2048, "block_size": 16, "num_kv_blocks": 256},
        "encoder": {"cache_index_shards": 1},
        "preprocess": {"limit_mm_per_prompt": {"image": 4, **({} if family == "gemma4" else {"video": 1})}},
    }


@pytest.fixture(scope="package")
def tool_app(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, Any]]:
    cache_dir = tmp_path_factory.mktemp("models")
    models = [_model(f) for f in TOOL_FAMILIES]
    with local_app({"models": models, "models_cache_dir": str(cache_dir)}, num_cpus=3) as client:
        dirs = {f: Path(cache_dir) / f"tiny-{f}" for f in TOOL_FAMILIES}
        yield {"client": client, "dir": dirs["qwen3-vl"], "dirs": dirs}
