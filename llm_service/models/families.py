"""The LLM side of a model family, keyed by HF ``model_type``: decoder class and position scheme.

Adding a family whose language model is a Qwen2 decoder is one line here; a new decoder is one file
in this package plus its line. ``model_runner`` asks only ``load_text_config`` and ``build_decoder``.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from llm_service.attention import PagedAttention
from llm_service.models.gemma3 import Gemma3ForCausalLM, Gemma3TextConfig
from llm_service.models.gemma4 import Gemma4ForCausalLM
from llm_service.models.gemma4_config import Gemma4TextConfig
from llm_service.models.qwen2 import PositionScheme, Qwen2ForCausalLM, TextConfig
from llm_service.models.qwen3_5 import Qwen35ForCausalLM, Qwen35TextConfig
from llm_service.models.qwen3_vl import Qwen3VLForCausalLM, Qwen3VLTextConfig


@dataclass(frozen=True)
class DecoderFamily:
    decoder: type[Qwen2ForCausalLM]
    position_scheme: PositionScheme  # rope: 1-D; mrope: Qwen2-VL; mrope_abs_time: Qwen2.5-VL videos
    modalities: tuple[str, ...]  # what the family's prompts may carry embeddings for
    config: type[TextConfig] = TextConfig  # reads the decoder's facts from config.json
    tool_format: str = "hermes"  # how its answers write tool calls: llm_service/tools/formats.py
    reasoning_format: str | None = None  # how its template writes thinking: llm_service/tools/reasoning.py


DECODER_FAMILIES: dict[str, DecoderFamily] = {
    "qwen2": DecoderFamily(Qwen2ForCausalLM, "rope", ()),
    "qwen2_audio": DecoderFamily(Qwen2ForCausalLM, "rope", ("audio",)),
    "qwen2_vl": DecoderFamily(Qwen2ForCausalLM, "mrope", ("image", "video")),
    "qwen2_5_vl": DecoderFamily(Qwen2ForCausalLM, "mrope_abs_time", ("image", "video")),
    "gemma3": DecoderFamily(Gemma3ForCausalLM, "rope", ("image",), Gemma3TextConfig, "pythonic"),
    "qwen3_vl": DecoderFamily(Qwen3VLForCausalLM, "mrope", ("image", "video"), Qwen3VLTextConfig),
    "qwen3_5": DecoderFamily(
        Qwen35ForCausalLM, "mrope", ("image", "video"), Qwen35TextConfig, "qwen3_xml", "qwen3"
    ),
    "gemma4": DecoderFamily(
        Gemma4ForCausalLM, "rope", ("image", "audio"), Gemma4TextConfig, "gemma4", "gemma4"
    ),
}


def _read_config(model_dir: str | Path) -> dict:
    path = Path(model_dir) / "config.json"
    if not path.exists():
        raise FileNotFoundError(f"{model_dir} has no config.json")
    return dict(json.loads(path.read_text()))


def decoder_family(model_type: str, model_dir: str | Path = "") -> DecoderFamily:
    family = DECODER_FAMILIES.get(model_type)
    if family is None:
        raise ValueError(
            f"{model_dir}: model_type {model_type!r} has no LLM decoder; supported: {', '.join(DECODER_FAMILIES)}"
        )
    return family


def load_text_config(model_dir: str | Path) -> TextConfig:
    """The decoder's config from the model directory's ``config.json``, per its family's scheme."""
    cfg = _read_config(model_dir)
    family = decoder_family(str(cfg.get("model_type", "qwen2")), model_dir)
    return family.config.from_hf_config(model_dir, cfg, family.position_scheme)


def build_decoder(cfg: TextConfig, backend: PagedAttention) -> Qwen2ForCausalLM:
    """An uninitialised decoder of ``cfg``'s family (weights come from ``weights.load_weights``)."""
    return decoder_family(cfg.model_type).decoder(cfg, backend)
