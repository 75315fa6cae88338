"""Gemma 3's tower at encoder TP=2 (weights and data modes, two gloo processes on CPU) equals TP=1."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
import torch.multiprocessing as mp

from encoder_service.runner import EncoderRunner
from encoder_service.tp.launch import free_port, init_tp_process_group
from tests.unit.encoder_models.test_tower_gemma3 import gemma3_image
from tests.unit.gemma3_dir import tiny_gemma3_dir

ATOL, RTOL = 1e-5, 1e-5


def _rank_main(rank: int, port: int, work: str, model_dir: str) -> None:
    torch.set_num_threads(1)
    init_tp_process_group(f"tcp://127.0.0.1:{port}", rank, 2, "gloo", timeout_s=60)
    items = torch.load(Path(work) / "inputs.pt", weights_only=False)
    result: dict[str, Any] = {}
    for mode in ("weights", "data"):
        runner = EncoderRunner(model_dir, device="cpu", tp_rank=rank, tp_size=2, tp_mode=mode)  # type: ignore[arg-type]
        result[mode] = runner.encode(items)
        result[f"{mode}-params"] = sum(p.numel() for p in runner.model.parameters())
    torch.save(result, Path(work) / f"rank{rank}.pt")


@pytest.fixture(scope="module")
def gloo_results(tmp_path_factory: pytest.TempPathFactory):  # type: ignore[no-untyped-def]
    model_dir = tiny_gemma3_dir()
    work = tmp_path_factory.mktemp("encoder-tp-gemma3")
    items = [gemma3_image(model_dir, w, h, s) for w, h, s in [(300, 200, 1), (64, 48, 2), (90, 120, 3)]]
    torch.save(items, work / "inputs.pt")
    mp.spawn(_rank_main, args=(free_port(), str(work), str(model_dir)), nprocs=2)
    ranks = [torch.load(work / f"rank{r}.pt", weights_only=False) for r in range(2)]
    return items, ranks, EncoderRunner(model_dir, device="cpu")


@pytest.mark.parametrize("mode", ["weights", "data"])
def test_gloo_tp2_equals_tp1(gloo_results, mode: str) -> None:  # type: ignore[no-untyped-def]
    items, ranks, reference = gloo_results
    expected = reference.encode(items)
    full_params = sum(p.numel() for p in reference.model.parameters())
    for rank in ranks:
        outs = rank[mode]
        assert [o.shape for o in outs] == [e.shape for e in expected]
        for ours, ref in zip(outs, expected, strict=True):
            torch.testing.assert_close(ours, ref, atol=ATOL, rtol=RTOL)
        params = rank[f"{mode}-params"]
        # weights mode holds a shard of every SigLIP layer (attention heads, MLP units); data mode the whole tower
        assert params < full_params if mode == "weights" else params == full_params
