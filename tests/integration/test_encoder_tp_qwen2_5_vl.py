"""Qwen2.5-VL's tower at encoder TP=2 (weights and data modes, two gloo processes on CPU) equals TP=1."""

from __future__ import annotations

from typing import Any

import pytest

from encoder_service.encode.runner import EncoderRunner
from tests.integration.encoder_tp_gloo import MODES, assert_tp2_equals_tp1, run_tp2
from tests.qwen2_5_vl_dir import tiny_qwen2_5_vl_dir
from tests.unit.encoder_service.encode.models.inputs import image_input, video_input


@pytest.fixture(scope="module")
def gloo_results(tmp_path_factory: pytest.TempPathFactory) -> tuple[Any, ...]:
    model_dir = tiny_qwen2_5_vl_dir()
    items = [
        image_input(model_dir, 300, 200, seed=1),  # several windows, ragged edges
        video_input(model_dir, 140, 84, frames=4, seed=2),
        image_input(model_dir, 64, 48, seed=3),
        image_input(model_dir, 200, 150, seed=4),
    ]
    ranks = run_tp2(model_dir, items, tmp_path_factory.mktemp("encoder-tp-qwen2.5-vl"))
    return items, ranks, EncoderRunner(model_dir, device="cpu")


@pytest.mark.parametrize("mode", MODES)
def test_gloo_tp2_equals_tp1(gloo_results: tuple[Any, ...], mode: str) -> None:
    # weights mode holds a shard of every block (attention, gated MLP, merger); data mode the whole tower
    assert_tp2_equals_tp1(*gloo_results, mode)
