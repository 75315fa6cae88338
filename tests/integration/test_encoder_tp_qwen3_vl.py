"""Qwen3-VL's tower at encoder TP=2 (weights and data modes, two gloo processes on CPU) equals TP=1,
DeepStack levels included (each row is main + every level)."""

from __future__ import annotations

from typing import Any

import pytest

from encoder_service.encode.runner import EncoderRunner
from tests.integration.encoder_tp_gloo import MODES, assert_tp2_equals_tp1, run_tp2
from tests.qwen3_vl_dir import tiny_qwen3_vl_dir
from tests.unit.encoder_service.encode.models.inputs import image_input


@pytest.fixture(scope="module")
def gloo_results(tmp_path_factory: pytest.TempPathFactory) -> tuple[Any, ...]:
    model_dir = tiny_qwen3_vl_dir()
    items = [image_input(model_dir, w, h, seed=s) for w, h, s in [(300, 200, 1), (64, 64, 2), (96, 160, 3)]]
    ranks = run_tp2(model_dir, items, tmp_path_factory.mktemp("encoder-tp-qwen3-vl"))
    return items, ranks, EncoderRunner(model_dir, device="cpu")


@pytest.mark.parametrize("mode", MODES)
def test_gloo_tp2_equals_tp1(gloo_results: tuple[Any, ...], mode: str) -> None:
    # weights mode holds a shard of every block, the merger and the DeepStack mergers; data the whole tower
    items, ranks, reference = gloo_results
    assert all(o.shape[1] == 64 * 3 for rank in ranks for o in rank[mode])
    assert_tp2_equals_tp1(items, ranks, reference, mode)
