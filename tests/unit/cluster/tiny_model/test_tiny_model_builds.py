"""``mmserve make-tiny-model`` with a family's flags writes the same bytes as the build the tests use:
a family (and variant) is one row, with the files its directory holds."""

from __future__ import annotations

import hashlib
from pathlib import Path

import pytest

from cluster.cli import main as cli_main
from tests.tiny_dirs import tiny_model_dir

HF_FILES = (
    "config.json",
    "generation_config.json",
    "model.safetensors",
    "tokenizer.json",
    "tokenizer_config.json",
    "processor_config.json",
    "chat_template.jinja",
)
BUILDS = [  # (family, variant, the files compared)
    ("qwen2.5-vl", "base", (*HF_FILES, "mmserve_tiny.json")),
    ("qwen3.5", "base", (*HF_FILES, "mmserve_tiny.json")),
    ("gemma3", "base", HF_FILES),
    ("gemma4", "k_eq_v", HF_FILES),
]


def _sha(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


@pytest.mark.parametrize(("family", "variant", "files"), BUILDS, ids=[f"{f}-{v}" for f, v, _ in BUILDS])
def test_cli_same_flags_byte_identical(
    family: str, variant: str, files: tuple[str, ...], tmp_path: Path
) -> None:
    flags = ["--family", family] + (["--variant", variant] if variant != "base" else [])
    assert cli_main(["make-tiny-model", str(tmp_path / "again"), *flags]) == 0
    for name in files:
        assert _sha(tiny_model_dir(family, variant) / name) == _sha(tmp_path / "again" / name), name
