"""Encoder on CUDA: bf16 on one GPU vs float32 on the CPU, and NCCL TP=2 vs TP=1 (needs 2 GPUs)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.multiprocessing as mp

from encoder_service.encode.runner import EncoderRunner
from encoder_service.encode.tp.launch import exit_spawned_rank, free_port, init_tp_process_group
from tests.unit.encoder_service.encode.models.inputs import audio_input, image_input, video_input

pytestmark = pytest.mark.gpu


def _items(vl_dir: Path) -> list:
    return [
        image_input(vl_dir, 64, 48, seed=1),
        video_input(vl_dir, 84, 56, frames=4, seed=2),
        image_input(vl_dir, 300, 200, seed=3),
    ]


def _rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.float().cpu(), b.float().cpu()
    return float((a - b).norm() / b.norm())


def test_bf16_gpu_close_to_fp32_cpu(tiny_vl_dir: Path, tiny_audio_dir: Path) -> None:
    for model_dir, items in (
        (tiny_vl_dir, _items(tiny_vl_dir)),
        (tiny_audio_dir, [audio_input(tiny_audio_dir, s, i) for i, s in enumerate((1.0, 7.5))]),
    ):
        ref = EncoderRunner(model_dir, device="cpu").encode(items)
        gpu = EncoderRunner(model_dir, device="cuda", dtype="bfloat16")
        outs = gpu.encode(items)
        for ours, expected in zip(outs, ref, strict=True):
            assert ours.dtype == torch.bfloat16 and ours.device.type == "cuda"
            assert ours.shape == expected.shape
            assert _rel_err(ours, expected) < 0.03


def _rank_main(rank: int, port: int, work: str, vl_dir: str) -> None:
    init_tp_process_group(f"tcp://127.0.0.1:{port}", rank, 2, "nccl", timeout_s=120)
    items = torch.load(Path(work) / "inputs.pt", weights_only=False)
    out = {}
    for mode in ("weights", "data"):
        runner = EncoderRunner(vl_dir, device=f"cuda:{rank}", tp_rank=rank, tp_size=2, tp_mode=mode)  # type: ignore[arg-type]
        out[mode] = [t.cpu() for t in runner.encode(items)]
    torch.save(out, Path(work) / f"rank{rank}.pt")
    exit_spawned_rank()


def test_nccl_tp2_equals_tp1(tiny_vl_dir: Path, tmp_path: Path) -> None:
    if torch.cuda.device_count() < 2:
        pytest.skip("NCCL TP=2 needs 2 GPUs")
    items = _items(tiny_vl_dir)
    torch.save(items, tmp_path / "inputs.pt")
    mp.spawn(_rank_main, args=(free_port(), str(tmp_path), str(tiny_vl_dir)), nprocs=2)
    expected = [t.cpu() for t in EncoderRunner(tiny_vl_dir, device="cuda:0").encode(items)]
    for rank in range(2):
        got = torch.load(tmp_path / f"rank{rank}.pt", weights_only=False)
        for mode in ("weights", "data"):
            for ours, ref in zip(got[mode], expected, strict=True):
                # TF32 may be on for CUDA matmuls: a little looser than the CPU tests.
                torch.testing.assert_close(ours, ref, atol=1e-3, rtol=1e-3)
