"""The family registries (encoder side, LLM side, tiny generator) agree, and every entry resolves."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from cluster.tiny_model import FAMILIES, TINY_RECIPES, make_tiny_model
from encoder_service.encode.models.common import EncoderModel
from encoder_service.families import (
    ENCODER_FAMILIES,
    FAMILY_NAMES,
    encoder_family,
    largest_item_embeds,
    max_resized_units,
    model_type_of,
    vision_largest_item,
)
from encoder_service.preprocess.media import MediaLimits
from llm_service.models import DECODER_FAMILIES
from llm_service.models.families import decoder_family
from tests.tiny_dirs import tiny_model_dir


def test_sides_agree() -> None:
    """Every encoder family has a decoder family and a tiny recipe under the same model_type and name."""
    assert set(FAMILY_NAMES) == set(FAMILIES)
    assert {r.model_type for r in TINY_RECIPES.values()} == set(ENCODER_FAMILIES)
    for model_type, enc in ENCODER_FAMILIES.items():
        dec = DECODER_FAMILIES[model_type]
        assert dec.modalities == enc.modalities, model_type
        assert model_type_of(enc.name) == model_type
        recipe = TINY_RECIPES[enc.name]
        assert (recipe.name, recipe.model_type) == (enc.name, model_type)
        assert recipe.variants[0] == "base", enc.name
    assert DECODER_FAMILIES["qwen2_5_vl"].position_scheme == "mrope_abs_time"
    assert DECODER_FAMILIES["qwen2_vl"].position_scheme == "mrope"
    assert DECODER_FAMILIES["qwen2_audio"].position_scheme == "rope"


@pytest.mark.parametrize("name", FAMILIES)
def test_tiny_model_dir_maps_to_both_sides(name: str, tmp_path: Path) -> None:
    """The model_type HF writes into a generated tiny model's config.json finds the family on both sides."""
    from transformers import AutoConfig

    model_dir = make_tiny_model(tmp_path / name, name)
    model_type = json.loads((model_dir / "config.json").read_text())["model_type"]
    assert AutoConfig.from_pretrained(model_dir).model_type == model_type == TINY_RECIPES[name].model_type
    assert encoder_family(model_type, str(model_dir)).name == name
    assert decoder_family(model_type, model_dir) is DECODER_FAMILIES[model_type]
    assert json.loads((model_dir / "mmserve_tiny.json").read_text())["family"] == name


@pytest.mark.parametrize("model_type", sorted(ENCODER_FAMILIES))
def test_entries_resolve(model_type: str) -> None:
    fam = ENCODER_FAMILIES[model_type]
    tower = fam.tower_class()
    assert issubclass(tower, EncoderModel)
    assert (tower.family, tuple(tower.modalities)) == (fam.name, fam.modalities)
    assert callable(fam.processor_factory())


def test_unknown_family_is_named() -> None:
    with pytest.raises(ValueError, match="model_type 'llava' is not a supported family"):
        encoder_family("llava", "/models/x")
    with pytest.raises(ValueError, match="unknown model family 'llava-next'"):
        model_type_of("llava-next")


def test_largest_image_bound_against_hf_smart_resize() -> None:
    """Every admitted size's HF unit count stays under the bound, and some size reaches it."""
    from transformers.models.qwen2_vl.image_processing_qwen2_vl import smart_resize

    for limit in (240_000, 28 * 28 * 50, 1_000_000):
        bound = max_resized_units(limit, 56 * 56, 28 * 28 * 1024, 28)
        most = 0
        for h in range(14, 1500):
            for w in {min(limit // h, 200 * h), *(limit // h - d for d in range(0, 28, 3))}:
                if w >= 14 and w * h <= limit and max(w, h) <= 200 * min(w, h):
                    rh, rw = smart_resize(h, w, 28, 56 * 56, 28 * 28 * 1024)
                    most = max(most, rh * rw // 784)
        assert most <= bound, (limit, most, bound)
        assert most >= bound * 0.9, (limit, most, bound)
    assert smart_resize(552, 434, 28, 56 * 56, 28 * 28 * 1024) == (560, 448)  # 320 units from 239,568 pixels
    assert max_resized_units(240_000, 56 * 56, 28 * 28 * 1024, 28) == 408  # 42x5698 -> 56x5712: 2x204 units


def test_largest_vision_item_uses_processor_caps() -> None:
    model_dir: Path = tiny_model_dir("qwen2.5-vl")
    proc_cfg = json.loads((model_dir / "processor_config.json").read_text())
    # no pixel limit below the processor's cap (28*28*1024): the cap decides
    assert vision_largest_item(proc_cfg, MediaLimits(max_video_frames=0)) == 1024
    # video: frames / temporal patch * per-frame embeddings (56x56 frames: 2x2 units, with rounding 4)
    video = MediaLimits(max_pixels=28 * 28, max_video_frames=8, max_video_pixels_per_frame=56 * 56)
    per_frame = max_resized_units(56 * 56, 56 * 56, 28 * 28 * 1024, 28)
    assert vision_largest_item(proc_cfg, video) == 8 // 2 * per_frame


def test_largest_item_by_model_dir_and_by_tiny_name(tiny_audio_dir: Path) -> None:
    limits = MediaLimits(max_pixels=240_000, max_video_frames=0)
    model_dir = tiny_model_dir("qwen2.5-vl")
    assert largest_item_embeds(model_dir, None, limits) == 408
    assert largest_item_embeds(None, "qwen2.5-vl", limits) == 408  # the tiny processor's defaults
    assert largest_item_embeds(tiny_audio_dir, None, limits) == 750
    with pytest.raises(ValueError, match="needs a model directory"):
        largest_item_embeds(None, None, limits)


def test_config_cli_and_chart_name_every_family() -> None:
    """The config's `tiny` (its check and its JSON schema), the CLI's --family choices and the Helm chart's
    enum list exactly the registry's families."""
    from pydantic import ValidationError

    from cluster.cli import build_parser
    from cluster.config import ModelConfig

    for name in FAMILY_NAMES:
        assert ModelConfig(name="m", tiny=name).tiny == name
    listed = f"unknown tiny family 'llava'; supported: {', '.join(FAMILY_NAMES)}"
    with pytest.raises(ValidationError, match=re.escape(listed)):
        ModelConfig(name="m", tiny="llava")
    (string, null) = ModelConfig.model_json_schema()["properties"]["tiny"]["anyOf"]
    assert set(string["enum"]) == set(FAMILY_NAMES) and null == {"type": "null"}

    make = build_parser()._subparsers._group_actions[0].choices["make-tiny-model"]
    (family,) = [a for a in make._actions if a.dest == "family"]
    assert set(family.choices or ()) == set(FAMILY_NAMES)
    schema = json.loads((Path(__file__).parents[4] / "helm/mmserve/values.schema.json").read_text())

    def enums(node: object) -> list[list[str]]:
        if isinstance(node, dict):
            found = [node["enum"]] if "qwen2-vl" in node.get("enum", []) else []
            return found + [e for v in node.values() for e in enums(v)]
        if isinstance(node, list):
            return [e for v in node for e in enums(v)]
        return []

    (tiny_enum,) = enums(schema)
    assert set(tiny_enum) == set(FAMILY_NAMES)
