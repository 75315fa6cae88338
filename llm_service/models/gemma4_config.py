"""Gemma 4's decoder facts from ``config.json`` (the text model of ``Gemma4ForConditionalGeneration``).

Read as transformers 5.25's ``Gemma4TextConfig`` derives them: per-layer head dims and KV heads (full
layers: ``global_head_dim``, and ``num_global_key_value_heads`` with ``attention_k_eq_v``), each kind's
RoPE (``default`` or ``proportional`` with a partial rotary factor), and which layer's KV every
KV-shared layer reads (``kv_sharing_modes``: the last non-shared layer of its own kind).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, fields
from pathlib import Path

from llm_service.models.hf_config import ConfigDict, opt_number, section, to_float, to_int, to_list
from llm_service.models.qwen2 import PositionScheme, TextConfig

SLIDING, FULL = "sliding_attention", "full_attention"
# transformers' Gemma4TextConfig defaults: config.json files may leave these out
TEXT_DEFAULTS: ConfigDict = {
    "vocab_size": 262_144,
    "hidden_size": 2304,
    "intermediate_size": 9216,
    "num_hidden_layers": 30,
    "num_attention_heads": 8,
    "num_key_value_heads": 4,
    "head_dim": 256,
    "rms_norm_eps": 1e-6,
    "sliding_window": 512,
    "max_position_embeddings": 131_072,
    "pad_token_id": 0,
    "vocab_size_per_layer_input": 262_144,
    "hidden_size_per_layer_input": 256,
}
DEFAULT_ROPE: dict[str, ConfigDict] = {
    SLIDING: {"rope_type": "default", "rope_theta": 10_000.0},
    FULL: {"rope_type": "proportional", "partial_rotary_factor": 0.25, "rope_theta": 1_000_000.0},
}


@dataclass(frozen=True)
class RopeSpec:
    theta: float
    rotary_fraction: float = 1.0  # "proportional": the first fraction of frequencies rotate, the rest not
    factor: float = 1.0


@dataclass(frozen=True)
class Gemma4TextConfig(TextConfig):
    sliding_window: int = 512
    layer_is_sliding: tuple[bool, ...] = ()
    layer_head_dims: tuple[int, ...] = ()
    layer_kv_heads: tuple[int, ...] = ()
    kv_source: tuple[int, ...] = ()  # layer i attends the KV written by layer kv_source[i] (i: its own)
    rope_sliding: RopeSpec = RopeSpec(10_000.0)
    rope_full: RopeSpec = RopeSpec(1_000_000.0, 0.25)
    final_logit_softcapping: float | None = None
    ple_dim: int = 0  # hidden_size_per_layer_input (0: no per-layer embeddings)
    ple_vocab_size: int = 0
    attention_k_eq_v: bool = False
    double_wide_shared_mlp: bool = False
    num_experts: int = 0  # 0: no MoE block
    top_k_experts: int = 0
    moe_intermediate_size: int = 0
    bidirectional_vision: bool = False  # use_bidirectional_attention == "vision"
    pad_token_id: int = 0
    mm_token_ids: tuple[int, ...] = ()  # image / video / audio placeholders: PLE looks up pad for them

    @classmethod
    def from_hf_config(
        cls, model_dir: str | Path, cfg: Mapping[str, object], scheme: PositionScheme
    ) -> TextConfig:
        text: ConfigDict = {**TEXT_DEFAULTS, **(section(cfg, "text_config") or cfg)}
        bidir = text.get("use_bidirectional_attention")
        if bidir not in (None, "vision"):
            raise ValueError(
                f"{model_dir}: use_bidirectional_attention {bidir!r} is not supported (None, vision)"
            )
        if text.get("hidden_activation", "gelu_pytorch_tanh") != "gelu_pytorch_tanh":
            raise ValueError(f"{model_dir}: hidden_activation {text['hidden_activation']!r} is not supported")
        if text.get("attention_bias"):
            raise ValueError(f"{model_dir}: attention_bias is not supported")
        base = TextConfig.from_hf_config(
            model_dir, {**cfg, "text_config": {**text, "rope_parameters": {}}}, scheme
        )
        n = to_int(text["num_hidden_layers"])
        types = [
            str(t)
            for t in to_list(text.get("layer_types") or [SLIDING if (i + 1) % 6 else FULL for i in range(n)])
        ]
        types = [*types[:-1], FULL]  # HF forces the last layer to full attention
        if len(types) != n or set(types) - {SLIDING, FULL}:
            raise ValueError(f"{model_dir}: layer_types must name {n} sliding/full attention layers")
        head_dims, kv_heads = _per_layer_shapes(text, types)
        moe = bool(text.get("enable_moe_block"))
        values = {f.name: getattr(base, f.name) for f in fields(TextConfig)}
        values.update(tie_word_embeddings=bool(cfg.get("tie_word_embeddings", True)))
        mm_ids = tuple(
            to_int(cfg[k])
            for k in ("image_token_id", "video_token_id", "audio_token_id")
            if cfg.get(k) is not None
        )
        rope = section(text, "rope_parameters") or DEFAULT_ROPE
        return cls(
            **values,
            sliding_window=to_int(text["sliding_window"]),
            layer_is_sliding=tuple(t == SLIDING for t in types),
            layer_head_dims=head_dims,
            layer_kv_heads=kv_heads,
            kv_source=kv_sources(model_dir, types, to_int(text.get("num_kv_shared_layers") or 0)),
            rope_sliding=_rope(model_dir, SLIDING, section(rope, SLIDING) or DEFAULT_ROPE[SLIDING]),
            rope_full=_rope(model_dir, FULL, section(rope, FULL) or DEFAULT_ROPE[FULL]),
            final_logit_softcapping=opt_number(text.get("final_logit_softcapping")),
            ple_dim=to_int(text.get("hidden_size_per_layer_input") or 0),
            ple_vocab_size=to_int(text["vocab_size_per_layer_input"]),
            attention_k_eq_v=bool(text.get("attention_k_eq_v")),
            double_wide_shared_mlp=bool(text.get("use_double_wide_mlp")),
            num_experts=to_int(text["num_experts"]) if moe else 0,
            top_k_experts=to_int(text["top_k_experts"]) if moe else 0,
            moe_intermediate_size=to_int(text["moe_intermediate_size"]) if moe else 0,
            bidirectional_vision=bidir == "vision",
            pad_token_id=to_int(text["pad_token_id"] if text.get("pad_token_id") is not None else 0),
            mm_token_ids=mm_ids,
        )

    def kv_layer_specs(self) -> list[tuple[int, int]]:
        """(num_kv_heads, head_dim) of each layer that writes KV, in layer order; shared layers write none."""
        return [
            (h, d)
            for i, (h, d) in enumerate(zip(self.layer_kv_heads, self.layer_head_dims, strict=True))
            if self.kv_source[i] == i
        ]

    def kv_layer_windows(self) -> list[int | None]:
        """A shared layer reads a cache of its own kind, so a cache's window is its writer's."""
        return [
            self.sliding_window if self.layer_is_sliding[i] else None
            for i, src in enumerate(self.kv_source)
            if src == i
        ]

    def kv_cache_index(self) -> list[int]:
        """Per layer: the index (into ``kv_layer_specs``' caches) of the KV cache it attends."""
        owners = [i for i, src in enumerate(self.kv_source) if src == i]
        return [owners.index(src) for src in self.kv_source]


def _per_layer_shapes(
    text: Mapping[str, object], types: list[str]
) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """Head dim and KV heads per layer: ``per_layer_config`` when the file has it (transformers 5.25
    writes it), else what ``Gemma4TextConfig.__post_init__`` derives from ``global_head_dim``."""
    if text.get("per_layer_config") is None:
        full: ConfigDict = {"head_dim": to_int(text.get("global_head_dim", 512))}
        if text.get("attention_k_eq_v") and text.get("num_global_key_value_heads") is not None:
            full["num_key_value_heads"] = to_int(text["num_global_key_value_heads"])
        per_layer: ConfigDict = {str(i): full for i, t in enumerate(types) if t == FULL}
    else:
        per_layer = section(text, "per_layer_config")
    dims, heads = [], []
    for i in range(len(types)):
        over = section(per_layer, str(i))
        dims.append(to_int(over.get("head_dim", text["head_dim"])))
        heads.append(to_int(over.get("num_key_value_heads", text["num_key_value_heads"])))
    return tuple(dims), tuple(heads)


def kv_sources(model_dir: str | Path, types: list[str], num_shared: int) -> tuple[int, ...]:
    """transformers' ``kv_sharing_modes``: the last ``num_shared`` layers reuse the KV of the last
    non-shared layer of their own kind."""
    n = len(types)
    first_shared = n - num_shared
    if num_shared and (first_shared <= 0 or set(types[:first_shared]) != set(types)):
        raise ValueError(
            f"{model_dir}: num_kv_shared_layers={num_shared} leaves a layer kind with no KV producer"
        )
    last_of = {t: i for i, t in enumerate(types[:first_shared])}
    return tuple(i if i < first_shared else last_of[types[i]] for i in range(n))


def _rope(model_dir: str | Path, kind: str, p: Mapping[str, object]) -> RopeSpec:
    rope_type = p.get("rope_type", "default")
    if rope_type not in ("default", "proportional"):
        raise ValueError(
            f"{model_dir}: {kind} rope_type {rope_type!r} is not supported (default, proportional)"
        )
    theta = to_float(p.get("rope_theta", 10_000.0 if kind == SLIDING else 1_000_000.0))
    if rope_type == "default":
        return RopeSpec(theta)
    return RopeSpec(theta, to_float(p.get("partial_rotary_factor", 1.0)), to_float(p.get("factor", 1.0)))
