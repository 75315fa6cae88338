"""One tiny model directory per family (and variant) per test process, made on first use. The session
fixtures of tests/conftest.py (``tiny_vl_dir``, ``tiny_audio_dir``) are pytest's; this is a plain
function a module-level helper or another process's test can call too."""

from __future__ import annotations

import atexit
import shutil
import tempfile
from functools import cache
from pathlib import Path


def tiny_model_dir(family: str, variant: str = "base") -> Path:
    """``cluster.tiny_model``'s ``family`` (its ``FAMILIES`` name, e.g. ``"qwen3-vl"``) at ``variant``."""
    return _made(family, variant)  # one cache key whether or not "base" is spelled out


@cache
def _made(family: str, variant: str) -> Path:
    from cluster.tiny_model import make_tiny_model

    root = Path(tempfile.mkdtemp(prefix=f"tiny-{family}-{variant}-"))
    atexit.register(shutil.rmtree, root, ignore_errors=True)
    return make_tiny_model(root / "model", family, variant=variant)
