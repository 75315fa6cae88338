"""The one config object (pydantic at the edge): YAML file, CLI flags, Serve ``args``.

A config names one or more models; each model gets its own preprocessor, encoder and LLM pools.
The services take frozen dataclasses built from these sections; pydantic stays here at the edge.
"""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Literal

import yaml
from pydantic import Field, ValidationInfo, WithJsonSchema, field_validator, model_validator

from cluster.ingress_config import AdmissionConfig, IngressConfig
from cluster.llm_config import LLMConfig
from cluster.pool_config import (
    LLM_DEPLOYMENT_PREFIX,
    LLMPoolConfig,
    LLMPoolEngine,
    refused_pool_engine_fields,
)
from cluster.serve_options import AutoscalingConfig, AutoscalingPolicyConfig, DeploymentOptions
from cluster.serve_options import StrictModel as _Strict
from encoder_service.cache.uuid_aliases import MAX_ALIASES_PER_TENANT
from encoder_service.families import FAMILY_NAMES
from llm_service.tools.formats import TOOL_FORMATS
from llm_service.tools.reasoning import REASONING_FORMATS
from mmcore.chat_template import check_template_syntax

# A pool's Serve options (cluster/serve_options.py), the ingress's section (cluster/ingress_config.py) and
# a model's LLM section (cluster/llm_config.py) are importable from here as they always were.
__all__ = [
    "AdmissionConfig",
    "AppConfig",
    "AutoscalingConfig",
    "AutoscalingPolicyConfig",
    "DeploymentOptions",
    "EncoderConfig",
    "IngressConfig",
    "LLMConfig",
    "LLMPoolConfig",
    "LLMPoolEngine",
    "MediaLimitsConfig",
    "ModelConfig",
    "PreprocessConfig",
    "default_config",
]


class MediaLimitsConfig(_Strict):
    max_bytes: int = Field(20 * 1024 * 1024, ge=1)
    max_pixels: int = Field(4096 * 4096, ge=1)
    max_video_frames: int = Field(64, ge=1)
    max_video_seconds: float = Field(600.0, gt=0)
    max_video_pixels_per_frame: int = Field(1920 * 1080, ge=1)
    video_num_frames: int | None = Field(None, ge=1, description="sample exactly this many frames")
    video_fps: float = Field(2.0, gt=0, description="sample frames at this rate when num_frames is unset")
    max_audio_seconds: float = Field(30.0, gt=0)
    max_audio_samples_per_second: int = Field(
        384_000,
        ge=1,
        description="decoded samples (rate x channels) per second of audio, checked while decoding",
    )
    max_video_decoded_pixels: int = Field(
        1920 * 1080 * 4096, ge=1, description="pixels summed over every decoded video frame"
    )
    fetch_timeout_s: float = Field(10.0, gt=0)
    allowed_domains: list[str] | None = None
    allow_private_addresses: bool = False
    allowed_local_media_path: str | None = None


class EncoderConfig(_Strict):
    max_num_encoder_input_tokens: int | None = Field(
        None, ge=1, description="default: LLM max_num_batched_tokens"
    )
    encoder_cache_size: int | None = Field(
        None, ge=1, description="embeddings; default: max_num_batched_tokens"
    )
    mm_encoder_tp_size: int = Field(1, ge=1)
    mm_encoder_tp_mode: Literal["weights", "data"] = "weights"
    dtype: Literal["float32", "bfloat16", "float16"] = "float32"
    device: Literal["auto", "cpu", "cuda"] = "auto"
    cache_index_shards: int = Field(2, ge=1)
    uuid_names_per_tenant: int = Field(
        MAX_ALIASES_PER_TENANT,
        ge=1,
        description="client `uuid` names one tenant keeps in the model's encoder cache (LRU of its own): "
        "past it the tenant's oldest name goes, never another tenant's",
    )
    cache_index_resources: dict[str, float] = Field(
        default_factory=dict,
        description="custom Ray resources each encoder-cache shard asks for (a node marker such as "
        "encoder_node: 0.001 pins the shards to those nodes); default: none, Ray places them",
    )
    max_queued_embeddings: int | None = Field(
        None, ge=1, description="embeddings one replica's FIFO holds; more: 503; default 16 x the step budget"
    )
    encoder_step_embeds: int | None = Field(
        None,
        ge=1,
        description="a step ends once it holds this many embeddings (each item waits for its whole step); "
        "default 256 on CPU, where bigger steps encode no faster, and the step budget on a GPU",
    )
    torch_threads: int | None = Field(
        None,
        ge=1,
        description="torch intra-op threads of each encoder replica's tower (TP=1); default: what Ray "
        "gives the replica's process (1 for a fractional num_cpus)",
    )
    deployment: DeploymentOptions = Field(default_factory=DeploymentOptions)


class PreprocessConfig(_Strict):
    """How a model's media requests are prepared: by the encoder replicas (fetch, decode, hash, look up,
    process, encode: encoder_service/serve/deployment.py), and at the ingress for what the encoder
    cache holds whole (the hit path: no prepare hop)."""

    hit_path_cache_entries: int = Field(
        256,
        ge=0,
        description="the hit path's near cache: entries each ingress replica serves without asking the index "
        "(it keeps their objects alive up to hit_path_cache_ttl_s); 0: always ask",
    )
    hit_path_cache_ttl_s: float = Field(30.0, ge=0)
    overlap_prefill: bool = Field(
        False,
        description="submit a media request to the LLM as soon as its prompt is known and hand it each "
        "item as its encode commits: the LLM prefills up to the first item still encoding meanwhile",
    )
    limit_mm_per_prompt: dict[str, int] = Field(default_factory=lambda: {"image": 4, "video": 1, "audio": 2})
    processor_cache_bytes: int = Field(256 * 1024 * 1024, ge=0)
    media: MediaLimitsConfig = Field(default_factory=MediaLimitsConfig)


# A tiny family's name: one of the registry's (``EncoderFamily.name``; the tiny generator's recipes
# carry the same names, a test checks), so JSON Schema readers see the list too.
TinyFamily = Annotated[str, WithJsonSchema({"type": "string", "enum": list(FAMILY_NAMES)})]
ToolCallParser = Annotated[str, WithJsonSchema({"type": "string", "enum": list(TOOL_FORMATS)})]
ReasoningParser = Annotated[str, WithJsonSchema({"type": "string", "enum": ["auto", *REASONING_FORMATS]})]


def load_chat_template(model: str, value: str) -> str:
    """vLLM's ``--chat-template`` semantics: a value naming a readable file is that file's text (read
    here, where the config is validated: the replicas get the text); one that looks like a path (no
    ``{``, ``}`` or newline) but cannot be read is an error; any other value is the template itself.
    Either must parse as jinja (a ``ValueError`` naming the model, the setting and the line)."""
    path = Path(value).expanduser()
    try:
        is_file = path.is_file()
    except (OSError, ValueError):  # a name too long for the file system, a NUL: template text
        is_file = False
    if is_file:
        try:
            text = path.read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError) as e:
            raise ValueError(f"model {model!r}: chat_template {value!r} cannot be read: {e}") from e
    elif not any(c in value for c in "{}\n"):
        raise ValueError(f"model {model!r}: chat_template {value!r} looks like a path, but no such file")
    else:
        text = value
    try:
        check_template_syntax(text)
    except ValueError as e:
        where = value if is_file else "(inline text)"
        raise ValueError(f"model {model!r}: chat_template {where}: {e}") from e
    return text


class ModelConfig(_Strict):
    name: str = Field(..., min_length=1, description="the OpenAI `model` name clients send")
    path: str | None = Field(None, description="HF model directory; omit with `tiny` to generate one")
    tiny: TinyFamily | None = Field(
        None, description="generate this tiny model (encoder_service.families.FAMILY_NAMES)"
    )
    llm: LLMConfig = Field(default_factory=LLMConfig)
    encoder: EncoderConfig = Field(default_factory=EncoderConfig)
    preprocess: PreprocessConfig = Field(default_factory=PreprocessConfig)
    chat_template: str | None = Field(
        None,
        description="a chat template in place of the checkpoint's, as vLLM's `--chat-template`: the path of a "
        ".jinja file (read when the config is validated: relative to that process's working directory) or the "
        "template text; the ingress's tokenizer and the encoder's processor both render with it "
        "(docs/tools.md ships tool-capable ones under cluster/data/)",
    )
    tool_call_parser: ToolCallParser | None = Field(
        None,
        description="how the model writes tool calls (vLLM's `--tool-call-parser`): "
        f"{', '.join(TOOL_FORMATS)}; default: the family's (llm_service/models/families.py)",
    )
    reasoning_parser: ReasoningParser | None = Field(
        None,
        description="split the answer's thinking into `reasoning` (vLLM's `--reasoning-parser`): "
        f"{', '.join(REASONING_FORMATS)}, or auto (the family's own); default: off (docs/reasoning.md)",
    )

    @field_validator("chat_template")
    @classmethod
    def _readable_template(cls, value: str | None, info: ValidationInfo) -> str | None:
        return None if value is None else load_chat_template(str(info.data.get("name", "?")), value)

    @field_validator("tool_call_parser")
    @classmethod
    def _known_parser(cls, value: str | None) -> str | None:
        if value is not None and value not in TOOL_FORMATS:
            raise ValueError(f"unknown tool_call_parser {value!r}; known: {', '.join(TOOL_FORMATS)}")
        return value

    @field_validator("reasoning_parser")
    @classmethod
    def _known_reasoning_parser(cls, value: str | None) -> str | None:
        if value is not None and value != "auto" and value not in REASONING_FORMATS:
            raise ValueError(
                f"unknown reasoning_parser {value!r}; known: auto, {', '.join(REASONING_FORMATS)}"
            )
        return value

    @field_validator("tiny")
    @classmethod
    def _known_family(cls, tiny: str | None) -> str | None:
        if tiny is not None and tiny not in FAMILY_NAMES:
            raise ValueError(f"unknown tiny family {tiny!r}; supported: {', '.join(FAMILY_NAMES)}")
        return tiny

    @model_validator(mode="before")
    @classmethod
    def _refuse_shared_pool_engine(cls, data: object) -> object:
        if isinstance(data, dict) and isinstance(data.get("llm"), dict):
            refused_pool_engine_fields(str(data.get("name", "?")), data["llm"].get("pools"))
        return data

    @model_validator(mode="after")
    def _check(self) -> ModelConfig:
        if (self.path is None) == (self.tiny is None):
            raise ValueError(f"model {self.name!r}: set exactly one of `path` or `tiny`")
        return self


class AppConfig(_Strict):
    models: list[ModelConfig] = Field(..., min_length=1)
    ingress: IngressConfig = Field(default_factory=IngressConfig)
    host: str = "127.0.0.1"
    port: int = Field(8000, ge=1, le=65535)
    models_cache_dir: str = Field("~/.cache/mmserve/models", description="where tiny models are generated")

    @model_validator(mode="after")
    def _unique_names(self) -> AppConfig:
        names = [m.name for m in self.models]
        if len(set(names)) != len(names):
            raise ValueError(f"model names must be unique, got {names}")
        for m in self.models:
            if m.llm.pools and self.ingress.transport != "auto":
                raise ValueError(
                    f"model {m.name!r}: llm.pools (E/P/D) needs ingress.transport `auto`: the KV moves "
                    "over the replicas' direct links"
                )
            if m.llm.pools and m.preprocess.overlap_prefill:
                raise ValueError(
                    f"model {m.name!r}: preprocess.overlap_prefill is not written for llm.pools yet"
                )
        return self

    def pool_deployments(self) -> dict[str, DeploymentOptions]:
        """Every pool's Serve options by its deployment's name (as cluster/app.py names them)."""
        out = {"IngressServer": self.ingress.deployment}
        for m in self.models:
            out[f"EncoderServer-{m.name}"] = m.encoder.deployment
            for role in m.llm.roles:
                out[f"{LLM_DEPLOYMENT_PREFIX[role]}-{m.name}"] = m.llm.pool(role)
        return out

    @classmethod
    def from_yaml(cls, path: str | Path) -> AppConfig:
        return cls.model_validate(yaml.safe_load(Path(path).read_text()) or {})


def default_config() -> AppConfig:
    """The out-of-the-box app: tiny Qwen2-VL (image, video) and tiny Qwen2-Audio (audio) on CPU."""
    return AppConfig(
        models=[
            ModelConfig(name="tiny-qwen2-vl", tiny="qwen2-vl"),
            ModelConfig(name="tiny-qwen2-audio", tiny="qwen2-audio"),
        ]
    )
