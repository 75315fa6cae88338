"""Encoder TP=2 (weights and data modes) equals TP=1: two gloo processes on CPU, and a Ray actor group."""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.multiprocessing as mp

from encoder_service.encode.runner import EncoderRunner
from encoder_service.encode.tp.launch import exit_spawned_rank, free_port, init_tp_process_group
from tests.integration.local_app import own_ray
from tests.unit.encoder_service.encode.models.inputs import audio_input, image_input, video_input

ATOL, RTOL = 1e-5, 1e-5


def vision_items(model_dir: Path) -> list:
    return [
        image_input(model_dir, 64, 48, seed=1),
        video_input(model_dir, 84, 56, frames=4, seed=2),
        image_input(model_dir, 140, 90, seed=3),
        image_input(model_dir, 56, 56, seed=4),
    ]


def _rank_main(rank: int, port: int, work: str, vl_dir: str, audio_dir: str) -> None:
    torch.set_num_threads(1)
    init_tp_process_group(f"tcp://127.0.0.1:{port}", rank, 2, "gloo", timeout_s=60)
    batches = torch.load(Path(work) / "inputs.pt", weights_only=False)
    result: dict[str, Any] = {}
    for name, model_dir in (("vl", vl_dir), ("audio", audio_dir)):
        for mode in ("weights", "data"):
            runner = EncoderRunner(model_dir, device="cpu", tp_rank=rank, tp_size=2, tp_mode=mode)  # type: ignore[arg-type]
            result[f"{name}-{mode}"] = runner.encode(batches[name])
            result[f"{name}-{mode}-params"] = sum(p.numel() for p in runner.model.parameters())
    torch.save(result, Path(work) / f"rank{rank}.pt")
    exit_spawned_rank()


@pytest.fixture(scope="module")
def gloo_results(tiny_vl_dir: Path, tiny_audio_dir: Path, tmp_path_factory: pytest.TempPathFactory):  # type: ignore[no-untyped-def]
    work = tmp_path_factory.mktemp("encoder-tp")
    batches = {
        "vl": vision_items(tiny_vl_dir),
        "audio": [audio_input(tiny_audio_dir, s, seed) for s, seed in ((1.0, 0), (4.0, 1), (2.0, 2))],
    }
    torch.save(batches, work / "inputs.pt")
    mp.spawn(_rank_main, args=(free_port(), str(work), str(tiny_vl_dir), str(tiny_audio_dir)), nprocs=2)
    ranks = [torch.load(work / f"rank{r}.pt", weights_only=False) for r in range(2)]
    reference = {
        "vl": EncoderRunner(tiny_vl_dir, device="cpu"),
        "audio": EncoderRunner(tiny_audio_dir, device="cpu"),
    }
    return batches, ranks, reference


@pytest.mark.parametrize("family", ["vl", "audio"])
@pytest.mark.parametrize("mode", ["weights", "data"])
def test_gloo_tp2_equals_tp1(gloo_results, family: str, mode: str) -> None:  # type: ignore[no-untyped-def]
    batches, ranks, reference = gloo_results
    expected = reference[family].encode(batches[family])
    full_params = sum(p.numel() for p in reference[family].model.parameters())
    for rank in ranks:
        outs = rank[f"{family}-{mode}"]
        assert [o.shape for o in outs] == [e.shape for e in expected]
        for ours, ref in zip(outs, expected, strict=True):
            torch.testing.assert_close(ours, ref, atol=ATOL, rtol=RTOL)
        params = rank[f"{family}-{mode}-params"]
        # weights mode holds a shard of every block; data mode the whole tower
        assert params < full_params if mode == "weights" else params == full_params


@pytest.fixture(scope="module")
def ray_local():  # type: ignore[no-untyped-def]
    import ray

    with own_ray(log_to_driver=False):
        yield ray


def test_ray_tp_group_weights_and_data(ray_local, tiny_vl_dir: Path) -> None:  # type: ignore[no-untyped-def]
    from encoder_service.encode.tp_group import EncoderTPGroup

    items = vision_items(tiny_vl_dir)
    expected = EncoderRunner(tiny_vl_dir, device="cpu").encode(items)
    for mode in ("weights", "data"):
        group = EncoderTPGroup(tiny_vl_dir, 2, mode, device="cpu", num_cpus_per_rank=0.5)  # type: ignore[arg-type]
        try:
            assert (group.family, group.hidden_size) == ("qwen2-vl", 64)
            for outs in (group.encode(items), asyncio.run(group.encode_async(items[::-1]))[::-1]):
                for ours, ref in zip(outs, expected, strict=True):
                    torch.testing.assert_close(ours, ref, atol=ATOL, rtol=RTOL)
        finally:
            group.shutdown()
    assert ray_local.util.placement_group_table() and all(
        pg["state"] == "REMOVED" for pg in ray_local.util.placement_group_table().values()
    )
