"""Gemma 4's towers at encoder TP=2 (weights and data modes, two gloo processes on CPU) equal TP=1:
images of different patch counts and an audio clip in one batch."""

from __future__ import annotations

from typing import Any

import pytest

from encoder_service.encode.runner import EncoderRunner
from encoder_service.preprocess.media import MediaLimits
from encoder_service.preprocess.processors.gemma4 import Gemma4Family
from encoder_service.types import EncoderInput
from tests.gemma4_dir import tiny_gemma4_dir
from tests.integration.encoder_tp_gloo import MODES, assert_tp2_equals_tp1, run_tp2
from tests.media import make_audio_array
from tests.unit.encoder_service.encode.models.inputs import processor
from tests.unit.encoder_service.encode.models.test_tower_gemma4 import gemma4_image


@pytest.fixture(scope="module")
def gloo_results(tmp_path_factory: pytest.TempPathFactory) -> tuple[Any, ...]:
    model_dir = tiny_gemma4_dir()
    items = [gemma4_image(model_dir, w, h, s) for w, h, s in [(300, 200, 1), (64, 48, 2)]]
    clip = Gemma4Family(processor(model_dir), MediaLimits()).process("audio", make_audio_array(0.7))
    items.append(EncoderInput("clip", "audio", clip.num_embeds, None, clip.tensors))
    ranks = run_tp2(model_dir, items, tmp_path_factory.mktemp("encoder-tp-gemma4"))
    return items, ranks, EncoderRunner(model_dir, device="cpu")


@pytest.mark.parametrize("mode", MODES)
def test_gloo_tp2_equals_tp1(gloo_results: tuple[Any, ...], mode: str) -> None:
    # weights mode holds a shard of every vision layer (heads, MLP units); the conformer is replicated
    assert_tp2_equals_tp1(*gloo_results, mode)
