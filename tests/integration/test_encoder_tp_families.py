"""Each family's towers at encoder TP=2 (weights and data modes, two gloo processes on CPU) equal TP=1
(``encoder_tp_gloo`` does the work; ``test_encoder_tp.py`` covers Qwen2-VL and Qwen2-Audio). A family
is one row: its items (mixed sizes, other modalities where it has them) and the width of each output
row where it is not the tower's plain output.

What weights mode shards, by family: Qwen2.5-VL every block (attention, gated MLP, merger); Qwen3-VL
every block, the merger and the DeepStack mergers (each row is main + every level); Qwen3.5 Qwen3-VL's
layers without DeepStack (one merger: LLM-width rows); Gemma 3 every SigLIP layer (attention heads,
MLP units); Gemma 4 every vision layer (heads, MLP units), its conformer replicated. Data mode holds
the whole tower.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any, NamedTuple

import pytest

from encoder_service.encode.runner import EncoderRunner
from encoder_service.preprocess.media import MediaLimits
from encoder_service.preprocess.processors.gemma4 import Gemma4Family
from encoder_service.types import EncoderInput
from tests.integration.encoder_tp_gloo import MODES, assert_tp2_equals_tp1, run_tp2
from tests.media import make_audio_array
from tests.tiny_dirs import tiny_model_dir
from tests.unit.encoder_service.encode.models.inputs import image_input, processor, video_input
from tests.unit.encoder_service.encode.models.test_tower_gemma3 import gemma3_image
from tests.unit.encoder_service.encode.models.test_tower_gemma4 import gemma4_image


def _qwen2_5_vl(model_dir: Path) -> list[EncoderInput]:
    return [
        image_input(model_dir, 300, 200, seed=1),  # several windows, ragged edges
        video_input(model_dir, 140, 84, frames=4, seed=2),
        image_input(model_dir, 64, 48, seed=3),
        image_input(model_dir, 200, 150, seed=4),
    ]


def _qwen3_vl(model_dir: Path) -> list[EncoderInput]:
    return [image_input(model_dir, w, h, seed=s) for w, h, s in [(300, 200, 1), (64, 64, 2), (96, 160, 3)]]


def _qwen3_5(model_dir: Path) -> list[EncoderInput]:
    return [image_input(model_dir, w, h, seed=s) for w, h, s in [(300, 200, 1), (64, 64, 2)]]


def _gemma3(model_dir: Path) -> list[EncoderInput]:
    return [gemma3_image(model_dir, w, h, s) for w, h, s in [(300, 200, 1), (64, 48, 2), (90, 120, 3)]]


def _gemma4(model_dir: Path) -> list[EncoderInput]:
    """Images of different patch counts and an audio clip in one batch."""
    items = [gemma4_image(model_dir, w, h, s) for w, h, s in [(300, 200, 1), (64, 48, 2)]]
    clip = Gemma4Family(processor(model_dir), MediaLimits()).process("audio", make_audio_array(0.7))
    items.append(EncoderInput("clip", "audio", clip.num_embeds, None, clip.tensors))
    return items


class Family(NamedTuple):
    name: str  # cluster.tiny_model's
    items: Callable[[Path], list[EncoderInput]]
    row_width: int | None = None  # every output row's width, checked where the row is not the tower's own


FAMILIES = [
    Family("qwen2.5-vl", _qwen2_5_vl),
    Family("qwen3-vl", _qwen3_vl, row_width=64 * 3),  # main + 2 DeepStack levels
    Family("qwen3.5", _qwen3_5, row_width=64),  # one merger, no DeepStack: the LLM's width
    Family("gemma3", _gemma3),
    Family("gemma4", _gemma4),
]


@pytest.fixture(scope="module", params=FAMILIES, ids=[f.name for f in FAMILIES])
def gloo_results(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> tuple[Any, ...]:
    family: Family = request.param
    model_dir = tiny_model_dir(family.name)
    items = family.items(model_dir)
    ranks = run_tp2(model_dir, items, tmp_path_factory.mktemp(f"encoder-tp-{family.name}"))
    return family, items, ranks, EncoderRunner(model_dir, device="cpu")


@pytest.mark.parametrize("mode", MODES)
def test_gloo_tp2_equals_tp1(gloo_results: tuple[Any, ...], mode: str) -> None:
    family, items, ranks, reference = gloo_results
    if family.row_width is not None:
        assert all(o.shape[1] == family.row_width for rank in ranks for o in rank[mode])
    assert_tp2_equals_tp1(items, ranks, reference, mode)
