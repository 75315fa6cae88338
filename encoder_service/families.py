"""Model families on the encoder side, keyed by HF ``model_type``: one entry per family.

An entry names the family (what ``mmserve make-tiny-model --family`` and the config's ``tiny`` use),
its modalities, its processor adapter and its tower, and how many embeddings its largest item can
become. Pure data: no torch or transformers import, so config validation, budgets and the router can
read family facts cheaply; the adapter and tower classes are imported from their ``module:attr`` paths
only when a model is loaded.

Adding a family: its adapter (``processors/<family>.py``), its tower (``models/<family>_*.py``) and one
entry here; on the LLM side one line in ``llm_service/models/families.py``; for its tiny model one
``TinyRecipe`` in ``cluster/tiny_model/families.py`` (same name and model_type: a test checks). The
config's ``tiny`` choices are ``FAMILY_NAMES``.
"""

from __future__ import annotations

import importlib
import json
import math
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Literal, Protocol, TypedDict, cast

from encoder_service.types import Modality

if TYPE_CHECKING:
    from encoder_service.encode.models.common import EncoderModel
    from encoder_service.preprocess.media.limits import MediaLimits
    from encoder_service.preprocess.processors.base import FamilyProcessor

TINY_MAX_PIXELS = 28 * 28 * 1024  # the tiny models' processor cap (cluster/tiny_model)
WHISPER_MAX_EMBEDS = 750  # 30 s padded: 3000 mel frames -> 1500 after the conv -> 750 after pooling


class MediaSizeLimits(Protocol):
    """The media limits an item's size depends on (``MediaLimits`` or the config's ``MediaLimitsConfig``)."""

    @property
    def max_pixels(self) -> int: ...

    @property
    def max_video_pixels_per_frame(self) -> int: ...

    @property
    def max_video_frames(self) -> int: ...


class PixelRange(TypedDict, total=False):
    shortest_edge: int  # min pixels
    longest_edge: int  # max pixels


class SubProcessorConfig(TypedDict, total=False):
    """One sub-processor's section of ``processor_config.json`` (what the bounds read of it)."""

    size: PixelRange
    patch_size: int
    merge_size: int
    temporal_patch_size: int
    max_soft_tokens: int  # Gemma 4's image processor


class ProcessorConfig(TypedDict, total=False):
    """What the largest-item bounds read of a model's ``processor_config.json`` ({}: the tiny defaults)."""

    image_processor: SubProcessorConfig
    video_processor: SubProcessorConfig
    image_seq_length: int  # Gemma 3
    audio_seq_length: int  # Gemma 4


class VisionConfig(TypedDict, total=False):
    deepstack_visual_indexes: list[int]


class HFConfig(TypedDict, total=False):
    """What the registry reads of a model's ``config.json``."""

    model_type: str
    vision_config: VisionConfig


LargestItem = Callable[[ProcessorConfig, MediaSizeLimits], int]
# (hf_processor, media_limits) -> the family's adapter; the HF processor is transformers' own object
ProcessorFactory = Callable[[object, "MediaLimits"], "FamilyProcessor"]


def max_resized_units(pixel_limit: int, min_pixels: int, max_pixels: int, side: int) -> int:
    """The most ``side x side`` units Qwen2-VL's ``smart_resize`` gives an image of at most
    ``pixel_limit`` pixels (aspect ratio at most 200, as it requires). An upper bound that is tight
    where it matters: each side rounds to the nearest multiple of ``side``, so the area can exceed
    ``pixel_limit`` (434x552 = 239,568 pixels becomes 448x560 = 320 units of 28x28, over ceil(P/784) = 307)."""
    unit, half = side * side, side // 2
    balanced = math.isqrt(pixel_limit // 200)  # where w = 200 h meets w = pixel_limit / h
    rounded = 0  # no rescale: a side of n units is between n * side - half and n * side + half pixels
    for a in range(1, (pixel_limit // (side - half) + half) // side + 1):
        lo, hi = a * side - half, a * side + half
        heights = {lo, hi, min(max(balanced, lo), hi)}
        widest = max(min(pixel_limit // h, 200 * h) if 200 * (pixel_limit // h) >= h else 0 for h in heights)
        rounded = max(rounded, a * ((widest + half) // side))
        if rounded * unit > max_pixels:  # past the cap: the answer no longer depends on larger a
            break
    units = min(rounded, max_pixels // unit)
    if rounded * unit > max_pixels:  # some admitted image is scaled down to <= max_pixels (a side >= 1 unit)
        units = max(units, max_pixels // unit, math.isqrt(200 * max_pixels) // side)
    scaled_up = int(min_pixels / unit + 14.2 * math.sqrt(min_pixels) / side + 1)  # images under min_pixels
    return max(units, scaled_up)


def vision_largest_item(processor_config: ProcessorConfig, limits: MediaSizeLimits) -> int:
    """Qwen2-VL-style patching: one embedding per ``(patch * merge)^2`` pixels after ``smart_resize``,
    ``temporal_patch`` frames per temporal step. ``processor_config``: the model's
    ``processor_config.json`` ({}: the tiny models' defaults)."""

    def units(sub: Literal["image_processor", "video_processor"], pixel_limit: int) -> tuple[int, int]:
        cfg = processor_config.get(sub) or {}
        size = cfg.get("size") or {}
        side = int(cfg.get("patch_size", 14)) * int(cfg.get("merge_size", 2))
        lo, hi = int(size.get("shortest_edge", 56 * 56)), int(size.get("longest_edge", TINY_MAX_PIXELS))
        return max_resized_units(pixel_limit, lo, hi, side), int(cfg.get("temporal_patch_size", 2))

    per_image, _ = units("image_processor", limits.max_pixels)
    per_frame, temporal = units("video_processor", limits.max_video_pixels_per_frame)
    return max(per_image, math.ceil(limits.max_video_frames / temporal) * per_frame)


def whisper_largest_item(processor_config: ProcessorConfig, limits: MediaSizeLimits) -> int:
    return WHISPER_MAX_EMBEDS


def gemma3_largest_item(processor_config: ProcessorConfig, limits: MediaSizeLimits) -> int:
    """Every Gemma 3 image is resized to one square size: ``image_seq_length`` soft tokens
    (256 in the released checkpoints; {}: the tiny model's 16)."""
    return int(processor_config.get("image_seq_length", 16 if not processor_config else 256))


def gemma4_largest_item(processor_config: ProcessorConfig, limits: MediaSizeLimits) -> int:
    """A Gemma 4 image becomes at most ``max_soft_tokens`` soft tokens, whatever its size (280 in the
    released checkpoints; {}: the tiny model's 70); an audio clip at most ``audio_seq_length`` (750:
    the feature extractor keeps 30 s, one soft token per 40 ms)."""
    image = processor_config.get("image_processor") or {}
    image_max = int(image.get("max_soft_tokens", 70 if not processor_config else 280))
    return max(image_max, int(processor_config.get("audio_seq_length", 750)))


@dataclass(frozen=True)
class EncoderFamily:
    name: str  # user-facing family name: the tiny generator's --family, the config's `tiny`
    modalities: tuple[Modality, ...]
    processor: str  # "module:attr" of a callable (hf_processor, media_limits) -> FamilyProcessor
    tower: str  # "module:attr" of the EncoderModel subclass
    largest_item: LargestItem  # embeddings of the largest item the limits admit (before max_model_len)
    # How many LLM-width rows one output row is (config.json, or None for the tiny generator's
    # defaults): 1 + DeepStack levels for Qwen3-VL, whose rows carry them beside the main embedding.
    row_units: Callable[[HFConfig | None], int] = lambda config: 1

    def processor_factory(self) -> ProcessorFactory:
        return cast("ProcessorFactory", _resolve(self.processor))

    def tower_class(self) -> type[EncoderModel]:
        return cast("type[EncoderModel]", _resolve(self.tower))


def _resolve(path: str) -> object:
    module, _, attr = path.partition(":")
    return getattr(importlib.import_module(module), attr)


ENCODER_FAMILIES: dict[str, EncoderFamily] = {
    "qwen2_vl": EncoderFamily(
        "qwen2-vl",
        ("image", "video"),
        "encoder_service.preprocess.processors.qwen2_vl:Qwen2VLFamily",
        "encoder_service.encode.models.qwen2_vl_vision:Qwen2VLVisionEncoder",
        vision_largest_item,
    ),
    "qwen2_5_vl": EncoderFamily(
        "qwen2.5-vl",
        ("image", "video"),
        "encoder_service.preprocess.processors.qwen2_5_vl:Qwen25VLFamily",
        "encoder_service.encode.models.qwen2_5_vl_vision:Qwen25VLVisionEncoder",
        vision_largest_item,
    ),
    "qwen3_vl": EncoderFamily(
        "qwen3-vl",
        ("image", "video"),
        "encoder_service.preprocess.processors.qwen3_vl:Qwen3VLFamily",
        "encoder_service.encode.models.qwen3_vl_vision:Qwen3VLVisionEncoder",
        vision_largest_item,
        lambda config: deepstack_row_units(config),
    ),
    "qwen3_5": EncoderFamily(
        "qwen3.5",
        ("image", "video"),
        "encoder_service.preprocess.processors.qwen3_vl:Qwen3VLFamily",  # transformers maps qwen3_5 to Qwen3VLProcessor
        "encoder_service.encode.models.qwen3_5_vision:Qwen35VisionEncoder",
        vision_largest_item,
    ),
    "gemma3": EncoderFamily(
        "gemma3",
        ("image",),
        "encoder_service.preprocess.processors.gemma3:Gemma3Family",
        "encoder_service.encode.models.gemma3_vision:Gemma3VisionEncoder",
        gemma3_largest_item,
    ),
    "gemma4": EncoderFamily(
        "gemma4",
        ("image", "audio"),
        "encoder_service.preprocess.processors.gemma4:Gemma4Family",
        "encoder_service.encode.models.gemma4:Gemma4Encoder",
        gemma4_largest_item,
    ),
    "qwen2_audio": EncoderFamily(
        "qwen2-audio",
        ("audio",),
        "encoder_service.preprocess.processors:qwen2_audio_processor",
        "encoder_service.encode.models.qwen2_audio_encoder:Qwen2AudioEncoder",
        whisper_largest_item,
    ),
}

FAMILY_NAMES: tuple[str, ...] = tuple(f.name for f in ENCODER_FAMILIES.values())


def encoder_family(model_type: str | None, where: str = "") -> EncoderFamily:
    family = ENCODER_FAMILIES.get(model_type or "")
    if family is None:
        prefix = f"{where}: " if where else ""
        raise ValueError(
            f"{prefix}model_type {model_type!r} is not a supported family; "
            f"supported: {', '.join(ENCODER_FAMILIES)}"
        )
    return family


def model_type_of(name: str) -> str:
    """The HF model_type of the family called ``name`` (e.g. "qwen2.5-vl" -> "qwen2_5_vl")."""
    for model_type, family in ENCODER_FAMILIES.items():
        if family.name == name:
            return model_type
    raise ValueError(f"unknown model family {name!r}; choose one of {', '.join(FAMILY_NAMES)}")


TINY_QWEN3_VL_DEEPSTACK_LEVELS = 2  # cluster/tiny_model/qwen3_vl.py: deepstack_indexes (a test checks)


def deepstack_row_units(config: HFConfig | None) -> int:
    """One Qwen3-VL output row: the main embedding plus one per DeepStack level, each LLM-width."""
    if config is None:
        return 1 + TINY_QWEN3_VL_DEEPSTACK_LEVELS
    vision = config.get("vision_config") or {}
    return 1 + len(vision.get("deepstack_visual_indexes", [8, 16, 24]))  # transformers' default


def row_units(model_dir: str | Path | None, family_name: str | None) -> int:
    """LLM-width rows per encoder output row for a model (its directory, else the tiny defaults): what
    the encoder cache charges per embedding (``EmbeddingMeta.units``)."""
    if model_dir is not None:
        config = json.loads((Path(model_dir) / "config.json").read_text())
        return encoder_family(config.get("model_type"), str(model_dir)).row_units(config)
    if family_name is not None:
        return ENCODER_FAMILIES[model_type_of(family_name)].row_units(None)
    return 1


def largest_item_embeds(
    model_dir: str | Path | None, family_name: str | None, limits: MediaSizeLimits
) -> int:
    """Embeddings of the largest item ``limits`` admit for a model: its directory's ``config.json`` and
    ``processor_config.json`` when given, else the tiny generator's ``family_name`` defaults.
    (What ``cluster/budgets.py`` needs, before capping at ``max_model_len``.)"""
    processor_config: ProcessorConfig = {}
    if model_dir is not None:
        config = json.loads((Path(model_dir) / "config.json").read_text())
        family = encoder_family(config.get("model_type"), str(model_dir))
        proc_path = Path(model_dir) / "processor_config.json"
        if proc_path.exists():
            processor_config = json.loads(proc_path.read_text())
    elif family_name is not None:
        family = ENCODER_FAMILIES[model_type_of(family_name)]
    else:
        raise ValueError("largest_item_embeds needs a model directory or a tiny family name")
    return family.largest_item(processor_config, limits)
