"""Read encoder weights from a model directory's safetensors files by their HF names."""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors import safe_open


class CheckpointReader:
    """Tensors of one tower, looked up under the first of ``prefixes`` the checkpoint uses.

    transformers 5 saves ``model.visual.*`` / ``model.audio_tower.*``; released checkpoints use
    ``visual.*`` / ``audio_tower.*``. Handles a single ``model.safetensors`` and sharded
    ``model.safetensors.index.json`` layouts. Only the requested tensors are read from disk.
    """

    def __init__(self, model_dir: str | Path, dtype: torch.dtype) -> None:
        self.model_dir = Path(model_dir)
        self.dtype = dtype
        self._handles: dict[Path, safe_open] = {}  # open files, read lazily
        index = self.model_dir / "model.safetensors.index.json"
        if index.exists():
            weight_map: dict[str, str] = json.loads(index.read_text())["weight_map"]
            self._file_of = {k: self.model_dir / f for k, f in weight_map.items()}
        else:
            single = self.model_dir / "model.safetensors"
            if not single.exists():
                raise FileNotFoundError(
                    f"no model.safetensors or model.safetensors.index.json in {model_dir}"
                )
            with safe_open(str(single), "pt") as f:
                self._file_of = {k: single for k in f.keys()}  # noqa: SIM118 (safe_open is not a dict)

    def resolve_prefix(self, *prefixes: str) -> str:
        for p in prefixes:
            if any(k.startswith(p) for k in self._file_of):
                return p
        raise KeyError(f"none of the weight prefixes {prefixes} found in {self.model_dir}")

    def get(self, name: str) -> torch.Tensor:
        path = self._file_of.get(name)
        if path is None:
            raise KeyError(f"weight {name!r} missing from {self.model_dir}")
        handle = self._handles.get(path)
        if handle is None:
            handle = self._handles[path] = safe_open(str(path), "pt")
        return handle.get_tensor(name).to(self.dtype)

    def get_optional(self, name: str) -> torch.Tensor | None:
        return self.get(name) if name in self._file_of else None


def read_config(model_dir: str | Path) -> dict:
    path = Path(model_dir) / "config.json"
    if not path.exists():
        raise FileNotFoundError(f"{model_dir} has no config.json")
    return json.loads(path.read_text())
