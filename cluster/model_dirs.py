"""Where a configured model's files are: its ``path``, or a tiny model generated on first use.

Tiny models are deterministic, so every replica on every node can generate its own copy and get
the same bytes; a lock file and an atomic rename keep concurrent replicas on one node from racing.
"""

from __future__ import annotations

import fcntl
import os
import shutil
import tempfile
from pathlib import Path

from cluster.config import ModelConfig


def resolve_model_dir(model: ModelConfig, cache_dir: str) -> str:
    if model.path is not None:
        return model.path
    assert model.tiny is not None
    root = Path(os.path.expanduser(cache_dir))
    target = root / f"tiny-{model.tiny}"
    if (target / "model.safetensors").exists():
        return str(target)
    root.mkdir(parents=True, exist_ok=True)
    with open(root / f".tiny-{model.tiny}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not (target / "model.safetensors").exists():
            from cluster.tiny_model import make_tiny_model

            tmp = Path(tempfile.mkdtemp(prefix=f".tiny-{model.tiny}-", dir=root))
            try:
                make_tiny_model(tmp, model.tiny)
                if target.exists():
                    shutil.rmtree(target)
                tmp.rename(target)
            finally:
                if tmp.exists():
                    shutil.rmtree(tmp)
    return str(target)
