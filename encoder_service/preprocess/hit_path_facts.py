"""``HitPathFacts``: what the ingress's hit path needs of a model's processor, read as plain JSON.

The hit path hashes each item, looks it up and, when the encoder cache holds every one, builds the
prompt ids itself (``prepare_hits``): it needs the settings that go into an item's mm_hash, the
placeholder tokens and how the prompt writes them, never the image, video or audio processor. Loading
those (``AutoProcessor``) would import transformers' image stack, torchvision, ``torch._dynamo``,
sympy and scipy: ~2 CPU-s per ingress start for nothing. So the record is read from the model
directory's files (``processor_config.json``, or the older ``preprocessor_config.json`` and
``video_preprocessor_config.json``; ``tokenizer_config.json`` for the checkpoint's names of its
markers), each missing key taking the processor class's default, and it imports nothing of
transformers. tests/unit/encoder_service/preprocess/test_hit_path_facts.py holds every field to what
the loaded HF processor says, per family.

An item's mm_hash covers its sub-processor's section of those files as written, the transformers and
torchvision versions (which fix every default and the backend) and mmserve's own sampling and decode
settings (``hash_kwargs``): both sides compute it from this record, the encoder with the processor
loaded and the ingress without.
"""

from __future__ import annotations

import importlib.metadata
import importlib.util
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Final

from encoder_service.families import encoder_family
from encoder_service.preprocess.media.limits import MediaLimits
from encoder_service.types import Modality

SECTIONS: Final[dict[Modality, str]] = {
    "image": "image_processor",
    "video": "video_processor",
    "audio": "feature_extractor",
}
QWEN_VL_TYPES: Final = ("qwen2_vl", "qwen2_5_vl", "qwen3_vl", "qwen3_5")
QWEN3_VL_TYPES: Final = ("qwen3_vl", "qwen3_5")  # Qwen3VLProcessor: a video is one run per temporal patch
BICUBIC: Final = 3  # PIL's resample code, Qwen2-VL's default
# What a JPEG draft decode changes goes into the image's mm_hash: embeddings computed from a
# reduced-scale decode are never served for a full-size one, or the other way round.
DRAFT_POLICY: Final = "jpeg-dct-scaling-to-target-v1"
MAX_ASPECT_RATIO: Final = 200  # Qwen2-VL's smart_resize refuses a longer side over 200x the shorter


@dataclass(frozen=True)
class PixelGeometry:
    """Qwen2-VL-style patching of an image or a video frame."""

    patch_size: int
    merge_size: int
    temporal_patch_size: int
    min_pixels: int
    max_pixels: int


@dataclass(frozen=True)
class VideoRuns:
    """Qwen3-VL: a video's placeholder becomes one run per temporal patch, each ``<t seconds>``
    (``timestamp`` formatted with ``seconds``) then ``start``, the pads, ``end``."""

    start: str = "<|vision_start|>"
    end: str = "<|vision_end|>"
    timestamp: str = "<{seconds:.1f} seconds>"


@dataclass(frozen=True)
class HitPathFacts:
    model_type: str
    modalities: tuple[Modality, ...]
    placeholder_tokens: dict[Modality, str]  # the token one item's embeddings fill
    uses_mrope: bool
    # the templated text's markers, rewritten as the HF processor writes them (before tokenizing)
    prompt_rewrites: tuple[tuple[str, str], ...] = ()
    video_runs: VideoRuns | None = None
    sampling_rate: int | None = None
    frame_multiple: int = 1  # sampled video frames are rounded up to a multiple of this
    image_geometry: PixelGeometry | None = None
    video_geometry: PixelGeometry | None = None
    image_seq_length: int | None = None  # Gemma 3: every image's soft tokens
    jpeg_draft: bool = False  # the encoder decodes large JPEGs at reduced scale (processors/qwen2_vl.py)
    log_kwargs: dict[Modality, dict[str, object]] = field(default_factory=dict)
    # what an item's mm_hash covers of the processor, per modality (its section of the files, versions)
    processor_hash: dict[Modality, dict[str, object]] = field(default_factory=dict)

    def hash_kwargs(self, modality: Modality, limits: MediaLimits) -> dict[str, object]:
        """Every processor and sampling setting that changes how an item of ``modality`` is encoded,
        but the decode policy (the family's ``decode_kwargs``)."""
        out = dict(self.processor_hash.get(modality, {}))
        if modality == "video":
            out.update(
                sample_fps=limits.video_fps,
                sample_num_frames=limits.video_num_frames,
                frame_multiple=self.frame_multiple,
            )
        return out

    def check_image_size(self, width: int, height: int) -> None:
        """Raise ``ValueError`` (a message a client can act on) for a size the processor refuses."""
        if self.image_geometry is not None and max(width, height) > MAX_ASPECT_RATIO * min(width, height):
            raise ValueError(
                f"aspect ratio {max(width, height) / min(width, height):.1f} ({width}x{height}) is over "
                f"{MAX_ASPECT_RATIO}, the most the Qwen2-VL image processor accepts"
            )


def read_hit_path_facts(model_dir: str | Path) -> HitPathFacts:
    """The record for the model in ``model_dir`` (its family from ``config.json``'s ``model_type``)."""
    model_dir = Path(model_dir)
    model_type = str(_read(model_dir / "config.json")["model_type"])
    family = encoder_family(model_type, str(model_dir))
    files = _ProcessorFiles.read(model_dir)
    if model_type in QWEN_VL_TYPES:
        return _qwen_vl(model_type, family.modalities, files)
    if model_type == "gemma3":
        return _gemma3(family.modalities, files, _read(model_dir / "tokenizer_config.json"))
    if model_type == "gemma4":
        return _gemma4(family.modalities, files, _read(model_dir / "tokenizer_config.json"))
    if model_type == "qwen2_audio":
        return _qwen2_audio(family.modalities, files)
    raise ValueError(f"{model_dir}: no hit-path facts for model_type {model_type!r}")  # a new family


@dataclass(frozen=True)
class _ProcessorFiles:
    sections: dict[Modality, dict[str, object]]  # each modality's sub-processor config, as written
    top: dict[str, object]  # the processor's own keys (image_seq_length, ...)

    @classmethod
    def read(cls, model_dir: Path) -> _ProcessorFiles:
        root = _read(model_dir / "processor_config.json", missing_ok=True)
        sections: dict[Modality, dict[str, object]] = {}
        for modality, key in SECTIONS.items():
            if isinstance(section := root.get(key), dict):
                sections[modality] = section
        older = _read(model_dir / "preprocessor_config.json", missing_ok=True)  # the older layout
        if older:
            sections.setdefault("audio" if "feature_extractor_type" in older else "image", older)
        video = _read(model_dir / "video_preprocessor_config.json", missing_ok=True)
        if video or "image" in sections:  # without its own file, the video processor reads the image's
            sections.setdefault("video", video or sections["image"])
        top = {k: v for k, v in root.items() if k not in SECTIONS.values()}
        return cls(sections, top)

    def section(self, modality: Modality) -> dict[str, object]:
        return self.sections.get(modality, {})

    def hashes(self, modalities: tuple[Modality, ...]) -> dict[Modality, dict[str, object]]:
        versions = _versions()
        return {m: {"processor": self.top, m: self.section(m), **versions} for m in modalities}


def _qwen_vl(model_type: str, modalities: tuple[Modality, ...], files: _ProcessorFiles) -> HitPathFacts:
    qwen3 = model_type in QWEN3_VL_TYPES
    image = _geometry(files.section("image"), _IMAGE_DEFAULTS)
    video = _geometry(files.section("video"), _VIDEO_DEFAULTS[qwen3])
    video_token = "<|video_pad|>"
    runs = VideoRuns() if qwen3 else None
    rewrites = ((f"{runs.start}{video_token}{runs.end}", video_token),) if runs else ()
    return HitPathFacts(
        model_type,
        modalities,
        {"image": "<|image_pad|>", "video": video_token},
        uses_mrope=True,
        prompt_rewrites=rewrites,
        video_runs=runs,
        frame_multiple=video.temporal_patch_size,
        image_geometry=image,
        video_geometry=video,
        jpeg_draft=_draft_capable(files.section("image")),
        log_kwargs={"image": _geometry_log(image), "video": _geometry_log(video)},
        processor_hash=files.hashes(modalities),
    )


# Each processor class's defaults where the file says nothing: (patch, min_pixels, max_pixels)
_IMAGE_DEFAULTS: Final = (14, 56 * 56, 28 * 28 * 1280)  # Qwen2VLImageProcessor (every Qwen family's)
_VIDEO_DEFAULTS: Final = {
    False: (14, 128 * 28 * 28, 28 * 28 * 768),  # Qwen2VLVideoProcessor
    True: (16, 128 * 32 * 32, 32 * 32 * 768),  # Qwen3VLVideoProcessor
}


def _geometry(cfg: dict[str, object], defaults: tuple[int, int, int]) -> PixelGeometry:
    """``min_pixels`` / ``max_pixels`` keys override ``size`` (as the processors' constructors do)."""
    patch, lo, hi = defaults
    raw_size = cfg.get("size")
    size: dict[str, object] = raw_size if isinstance(raw_size, dict) else {}
    min_pixels = cfg.get("min_pixels", size.get("shortest_edge", size.get("min_pixels", lo)))
    max_pixels = cfg.get("max_pixels", size.get("longest_edge", size.get("max_pixels", hi)))
    return PixelGeometry(
        patch_size=_int(cfg.get("patch_size", patch)),
        merge_size=_int(cfg.get("merge_size", 2)),
        temporal_patch_size=_int(cfg.get("temporal_patch_size", 2)),
        min_pixels=_int(min_pixels),
        max_pixels=_int(max_pixels),
    )


def _geometry_log(g: PixelGeometry) -> dict[str, object]:
    return {
        "min_pixels": g.min_pixels,
        "max_pixels": g.max_pixels,
        "patch_size": g.patch_size,
        "merge_size": g.merge_size,
        "temporal_patch_size": g.temporal_patch_size,
    }


def _draft_capable(cfg: dict[str, object]) -> bool:
    """Whether the encoder's own image transform takes these settings (``Qwen2VLImageTransform.from_hf``:
    the torchvision backend, resize + rescale + normalize + RGB, bicubic, on the CPU): only then may it
    decode a JPEG at reduced scale."""
    flags = ("do_resize", "do_rescale", "do_normalize", "do_convert_rgb")
    return (
        importlib.util.find_spec("torchvision") is not None
        and all(cfg.get(flag, True) is True for flag in flags)
        and cfg.get("resample", BICUBIC) == BICUBIC
        and cfg.get("device") in (None, "cpu")
    )


def _gemma3(
    modalities: tuple[Modality, ...], files: _ProcessorFiles, tokenizer_config: dict[str, object]
) -> HitPathFacts:
    names = _token_names(tokenizer_config)
    boi = names.get("boi_token", "<start_of_image>")
    image = names.get("image_token", "<image_soft_token>")
    eoi = names.get("eoi_token", "<end_of_image>")
    cfg = files.section("image")
    if cfg.get("do_pan_and_scan"):
        raise ValueError(
            "Gemma 3 pan-and-scan (do_pan_and_scan) is not supported; turn it off in the processor config"
        )
    size = cfg.get("size") if isinstance(cfg.get("size"), dict) else {"height": 896, "width": 896}
    assert isinstance(size, dict)
    seq = _int(files.top.get("image_seq_length", 256))
    return HitPathFacts(
        "gemma3",
        modalities,
        {"image": image},
        uses_mrope=False,
        prompt_rewrites=((boi, f"\n\n{boi}{image}{eoi}\n\n"),),
        image_seq_length=seq,
        log_kwargs={"image": {"size": [size["height"], size["width"]], "image_seq_length": seq}},
        processor_hash=files.hashes(modalities),
    )


def _gemma4(
    modalities: tuple[Modality, ...], files: _ProcessorFiles, tokenizer_config: dict[str, object]
) -> HitPathFacts:
    names = _token_names(tokenizer_config)
    image, audio = names.get("image_token", "<|image|>"), names.get("audio_token", "<|audio|>")
    boi, eoi = names.get("boi_token", "<|image>"), names.get("eoi_token", "<image|>")
    boa, eoa = names.get("boa_token", "<|audio>"), names.get("eoa_token", "<audio|>")
    cfg = files.section("image")
    return HitPathFacts(
        "gemma4",
        modalities,
        {"image": image, "audio": audio},
        uses_mrope=False,
        prompt_rewrites=((image, f"{boi}{image}{eoi}"), (audio, f"{boa}{audio}{eoa}")),
        sampling_rate=_int(files.section("audio").get("sampling_rate", 16000)),
        log_kwargs={
            "image": {
                "max_soft_tokens": _int(cfg.get("max_soft_tokens", 280)),
                "patch_size": _int(cfg.get("patch_size", 16)),
            },
            "audio": {"sampling_rate": _int(files.section("audio").get("sampling_rate", 16000))},
        },
        processor_hash=files.hashes(modalities),
    )


def _qwen2_audio(modalities: tuple[Modality, ...], files: _ProcessorFiles) -> HitPathFacts:
    fe = files.section("audio")
    rate = _int(fe.get("sampling_rate", 16000))
    chunk = _int(fe.get("chunk_length", 30))
    return HitPathFacts(
        "qwen2_audio",
        modalities,
        {"audio": "<|AUDIO|>"},
        uses_mrope=False,
        sampling_rate=rate,
        log_kwargs={
            "audio": {
                "sampling_rate": rate,
                "feature_size": _int(fe.get("feature_size", 80)),
                "n_samples": _int(fe.get("n_samples", chunk * rate)),
            }
        },
        processor_hash=files.hashes(modalities),
    )


def _token_names(tokenizer_config: dict[str, object]) -> dict[str, str]:
    """The checkpoint's names for its markers (``boi_token``, ...): top-level keys of
    ``tokenizer_config.json``, or an ``extra_special_tokens`` mapping (the older layout)."""
    names: dict[str, str] = {}
    extra = tokenizer_config.get("extra_special_tokens")
    for source in (extra if isinstance(extra, dict) else {}, tokenizer_config):
        names.update({k: v for k, v in source.items() if k.endswith("_token") and isinstance(v, str)})
    return names


def _versions() -> dict[str, object]:
    """The packages that fix every default the files leave out, and the processor's backend."""
    out: dict[str, object] = {}
    for name in ("transformers", "torchvision"):
        try:
            out[name] = importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            out[name] = None
    return out


def _read(path: Path, missing_ok: bool = False) -> dict[str, object]:
    if missing_ok and not path.exists():
        return {}
    data = json.loads(path.read_text())
    if not isinstance(data, dict):
        raise ValueError(f"{path}: expected a JSON object")
    return data


def _int(value: object) -> int:
    if isinstance(value, bool) or not isinstance(value, (int, float, str)):
        raise ValueError(f"expected a number in the processor config, got {value!r}")
    return int(value)
