"""Gemma 3's tower at encoder TP=2 (weights and data modes, two gloo processes on CPU) equals TP=1."""

from __future__ import annotations

from typing import Any

import pytest

from encoder_service.encode.runner import EncoderRunner
from tests.gemma3_dir import tiny_gemma3_dir
from tests.integration.encoder_tp_gloo import MODES, assert_tp2_equals_tp1, run_tp2
from tests.unit.encoder_service.encode.models.test_tower_gemma3 import gemma3_image


@pytest.fixture(scope="module")
def gloo_results(tmp_path_factory: pytest.TempPathFactory) -> tuple[Any, ...]:
    model_dir = tiny_gemma3_dir()
    items = [gemma3_image(model_dir, w, h, s) for w, h, s in [(300, 200, 1), (64, 48, 2), (90, 120, 3)]]
    ranks = run_tp2(model_dir, items, tmp_path_factory.mktemp("encoder-tp-gemma3"))
    return items, ranks, EncoderRunner(model_dir, device="cpu")


@pytest.mark.parametrize("mode", MODES)
def test_gloo_tp2_equals_tp1(gloo_results: tuple[Any, ...], mode: str) -> None:
    # weights mode holds a shard of every SigLIP layer (attention heads, MLP units); data mode the whole tower
    assert_tp2_equals_tp1(*gloo_results, mode)
