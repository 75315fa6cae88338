"""A Qwen2.5-VL video's ``second_per_grid_ts`` travels preprocessor → encoder input (processor cache) →
cache entry (``EmbeddingMeta``) → the item's ``MediaFeature`` (prepared request, LLM spec) → ``MultiModalInput``, over every
wire form on the way, and a cache hit (no decode) carries the value the miss computed."""

from __future__ import annotations

import pickle
from dataclasses import replace
from pathlib import Path

import pytest

from encoder_service.preprocess.media import MediaLimits
from encoder_service.preprocess.prepared import PreparedRequest
from encoder_service.preprocess.processing import Preprocessor
from encoder_service.types import EmbeddingMeta, MediaRef, PreprocessedRequest
from llm_service.embeddings import resolve_embeddings
from llm_service.request_spec import LLMRequestSpec
from llm_service.sampling_params import SamplingParams
from mmcore.feature import MediaFeature
from tests.media import make_video_bytes
from tests.tiny_dirs import tiny_model_dir

LIMITS = MediaLimits(video_fps=1.0)  # 3 s at 8 fps: 3 frames kept -> 4 (a multiple of 2)
SPGT = 2 * 3 / 4  # frames per temporal patch / (kept frames per second of clip)


@pytest.fixture(scope="module")
def model_dir() -> Path:
    return tiny_model_dir("qwen2.5-vl")


def _messages(video: bytes) -> list[dict]:
    return [{"role": "user", "content": [{"type": "video", "media": MediaRef("video", data=video)}]}]


def test_miss_then_hit_carry_second_per_grid_ts(model_dir: Path) -> None:
    import asyncio

    import torch

    video = make_video_bytes(84, 56, num_frames=24, fps=8, seed=4)
    pre = Preprocessor(model_dir, LIMITS, {"video": 1})
    miss = pickle.loads(pickle.dumps(pre.preprocess_sync(_messages(video))))
    assert isinstance(miss, PreprocessedRequest)
    (item,) = miss.items
    assert item.second_per_grid_ts == pytest.approx(SPGT)
    assert item.data is not None and item.data.second_per_grid_ts == pytest.approx(SPGT)

    # The encoder replica's cache entry, read back by a preprocessor on another build of the record.
    meta = pickle.loads(
        pickle.dumps(EmbeddingMeta(item.mm_hash, "video", item.length, 8, "float32", item.grid_thw, SPGT))
    )
    fresh = Preprocessor(model_dir, LIMITS, {"video": 1})  # no processor cache: a hit must not decode
    hit = fresh.preprocess_sync(_messages(video), lambda hashes: {h: meta for h in hashes})
    assert fresh.num_processor_calls == 0
    (hit_item,) = hit.items
    assert hit_item.data is None and hit_item.second_per_grid_ts == pytest.approx(SPGT)

    # The same record goes on: with its ref in the prepared request, then as it is in the LLM spec.
    prepared = PreparedRequest(hit.prompt_token_ids, [replace(hit_item, ref=["ref"])], 0, {})
    (p_item,) = pickle.loads(pickle.dumps(prepared)).items
    assert p_item.second_per_grid_ts == pytest.approx(SPGT)
    spec = pickle.loads(
        pickle.dumps(LLMRequestSpec("r", prepared.prompt_token_ids, SamplingParams(max_tokens=1), [p_item]))
    )
    (e_ref,) = spec.mm_items
    assert e_ref.second_per_grid_ts == pytest.approx(SPGT)

    async def fetch(_: object) -> torch.Tensor:
        return torch.zeros(p_item.length, 8)

    (mm,) = asyncio.run(resolve_embeddings([e_ref], fetch))
    assert mm.second_per_grid_ts == pytest.approx(SPGT) and mm.grid_thw == item.grid_thw


def test_images_have_none(model_dir: Path) -> None:
    from tests.media import make_image_bytes

    pre = Preprocessor(model_dir, LIMITS, {"image": 1})
    msgs = [
        {"role": "user", "content": [{"type": "image", "media": MediaRef("image", data=make_image_bytes())}]}
    ]
    (item,) = pre.preprocess_sync(msgs).items
    assert item.second_per_grid_ts is None


def test_run_rows_cross_every_wire_form() -> None:
    """A run of a several-run item (a Qwen3-VL video frame) names its rows of the one cached tensor;
    they survive the prepared request and the LLM spec, and the LLM side takes exactly those rows."""
    import asyncio

    import torch

    item = MediaFeature(0, "video", "h", 30, 6, grid_thw=(1, 4, 6), rows=(6, 12))
    back = pickle.loads(pickle.dumps(PreprocessedRequest([1] * 40, [item], {})))
    assert back.items[0].rows == (6, 12)
    prepared = PreparedRequest([1] * 40, [replace(back.items[0], ref=["r"])], 0, {})
    (p_item,) = pickle.loads(pickle.dumps(prepared)).items
    assert p_item.rows == (6, 12)
    (e_ref,) = pickle.loads(
        pickle.dumps(LLMRequestSpec("r", [1] * 40, SamplingParams(max_tokens=1), [p_item]))
    ).mm_items
    assert e_ref.rows == (6, 12)
    whole = torch.arange(18.0)[:, None].expand(18, 4)

    async def fetch(_: object) -> torch.Tensor:
        return whole

    (mm,) = asyncio.run(resolve_embeddings([e_ref], fetch))
    assert mm.embeddings[:, 0].tolist() == list(range(6, 12))
    meta = EmbeddingMeta("h", "video", 18, 4, "float32", (3, 4, 6), frame_times=[0.5, 1.5, 2.5])
    assert pickle.loads(pickle.dumps(meta)).frame_times == [0.5, 1.5, 2.5]
