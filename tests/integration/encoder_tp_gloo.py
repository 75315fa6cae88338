"""A tower at encoder TP=2 (weights and data modes, two gloo processes on CPU) against TP=1: the
machinery every family's TP test shares."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
import torch.multiprocessing as mp

from encoder_service.encode.runner import EncoderRunner
from encoder_service.encode.tp.launch import exit_spawned_rank, free_port, init_tp_process_group
from encoder_service.types import EncoderInput

ATOL, RTOL = 1e-5, 1e-5
MODES = ("weights", "data")


def _rank_main(rank: int, port: int, work: str, model_dir: str) -> None:
    torch.set_num_threads(1)
    init_tp_process_group(f"tcp://127.0.0.1:{port}", rank, 2, "gloo", timeout_s=60)
    items = torch.load(Path(work) / "inputs.pt", weights_only=False)
    result: dict[str, Any] = {}
    for mode in MODES:
        runner = EncoderRunner(model_dir, device="cpu", tp_rank=rank, tp_size=2, tp_mode=mode)  # type: ignore[arg-type]
        result[mode] = runner.encode(items)
        result[f"{mode}-params"] = sum(p.numel() for p in runner.model.parameters())
    torch.save(result, Path(work) / f"rank{rank}.pt")
    exit_spawned_rank()


def run_tp2(model_dir: Path, items: list[EncoderInput], work: Path) -> list[dict[str, Any]]:
    """Each rank's outputs and parameter count per mode, both ranks encoding ``items``."""
    torch.save(items, work / "inputs.pt")
    mp.spawn(_rank_main, args=(free_port(), str(work), str(model_dir)), nprocs=2)
    return [torch.load(work / f"rank{r}.pt", weights_only=False) for r in range(2)]


def assert_tp2_equals_tp1(
    items: list[EncoderInput], ranks: list[dict[str, Any]], reference: EncoderRunner, mode: str
) -> None:
    """Every rank's outputs equal TP=1's; ``weights`` holds a shard of the tower, ``data`` all of it."""
    expected = reference.encode(items)
    full_params = sum(p.numel() for p in reference.model.parameters())
    for rank in ranks:
        outs = rank[mode]
        assert [o.shape for o in outs] == [e.shape for e in expected]
        for ours, ref in zip(outs, expected, strict=True):
            torch.testing.assert_close(ours, ref, atol=ATOL, rtol=RTOL)
        params = rank[f"{mode}-params"]
        assert params < full_params if mode == "weights" else params == full_params
