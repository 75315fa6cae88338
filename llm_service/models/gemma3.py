"""Gemma 3's decoder on the paged KV cache (the language model of ``Gemma3ForConditionalGeneration``).

What differs from Qwen2 (math as transformers' ``Gemma3TextModel``, so greedy outputs agree):

- token embeddings are scaled by ``sqrt(hidden_size)`` (image embeddings, scattered in afterwards, are not);
- RMSNorm multiplies by ``1 + weight`` in float32; q and k get their own per-head RMSNorm (QK-norm);
- every layer norms the attention and MLP outputs too (post-attention, pre/post feed-forward norms);
- layers are local (sliding window of ``sliding_window`` positions) or global, per the config's
  ``layer_types``, and each kind has its own RoPE base (global: optionally linear-scaled);
- attention scale is ``query_pre_attn_scalar ** -0.5``; the MLP is gated GELU (tanh);
- the soft tokens of one image attend each other both ways (``bidirectional_mm``): the runner hands
  those spans to the attention metadata and the scheduler never cuts one across chunks.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, fields
from pathlib import Path

import torch
from torch import nn

from llm_service.attention import AttentionMetadata, PagedAttention
from llm_service.models.hf_config import ConfigDict, opt_number, section, to_float, to_int, to_list
from llm_service.models.qwen2 import PositionScheme, Qwen2ForCausalLM, TextConfig, rotate_half

SLIDING, FULL = "sliding_attention", "full_attention"
# transformers' Gemma3TextConfig defaults: released config.json files leave some of these out
TEXT_DEFAULTS: ConfigDict = {
    "vocab_size": 262_208,
    "hidden_size": 2304,
    "intermediate_size": 9216,
    "num_hidden_layers": 26,
    "num_attention_heads": 8,
    "num_key_value_heads": 4,
    "head_dim": 256,
    "query_pre_attn_scalar": 256,
    "rms_norm_eps": 1e-6,
    "sliding_window": 4096,
    "max_position_embeddings": 131_072,
}


@dataclass(frozen=True)
class Gemma3TextConfig(TextConfig):
    sliding_window: int = 4096
    layer_is_sliding: tuple[bool, ...] = ()
    local_rope_theta: float = 10000.0
    global_rope_factor: float = 1.0  # linear RoPE scaling of the global layers (1: none)
    query_pre_attn_scalar: float = 256.0
    final_logit_softcapping: float | None = None

    def kv_layer_windows(self) -> list[int | None]:
        return [self.sliding_window if s else None for s in self.layer_is_sliding]

    @classmethod
    def from_hf_config(
        cls, model_dir: str | Path, cfg: Mapping[str, object], scheme: PositionScheme
    ) -> TextConfig:
        text: ConfigDict = {**TEXT_DEFAULTS, **(section(cfg, "text_config") or cfg)}
        if text.get("attn_logit_softcapping") is not None:
            raise ValueError(f"{model_dir}: attn_logit_softcapping (Gemma 2) is not supported")
        if text.get("use_bidirectional_attention"):
            raise ValueError(
                f"{model_dir}: use_bidirectional_attention (an embedding model) is not supported"
            )
        if text.get("hidden_activation", "gelu_pytorch_tanh") != "gelu_pytorch_tanh":
            raise ValueError(f"{model_dir}: hidden_activation {text['hidden_activation']!r} is not supported")
        base = TextConfig.from_hf_config(
            model_dir, {**cfg, "text_config": {**text, "rope_parameters": None}}, scheme
        )
        local, glob = _rope_parameters(model_dir, text)
        num_layers = to_int(text["num_hidden_layers"])
        layer_types = text.get("layer_types")
        if layer_types is None:  # older configs: every ``sliding_window_pattern``-th layer is global
            pattern = to_int(text.get("sliding_window_pattern", 6))
            types = [SLIDING if (i + 1) % pattern else FULL for i in range(num_layers)]
        else:
            types = [str(t) for t in to_list(layer_types)]
        if len(types) != num_layers or set(types) - {SLIDING, FULL}:
            raise ValueError(f"{model_dir}: layer_types must name {num_layers} sliding/full attention layers")
        values = {f.name: getattr(base, f.name) for f in fields(TextConfig)}
        values.update(rope_theta=glob[0], tie_word_embeddings=bool(cfg.get("tie_word_embeddings", True)))
        return cls(
            **values,
            sliding_window=to_int(text.get("sliding_window") or 4096),
            layer_is_sliding=tuple(t == SLIDING for t in types),
            local_rope_theta=local[0],
            global_rope_factor=glob[1],
            query_pre_attn_scalar=to_float(text.get("query_pre_attn_scalar", base.head_dim)),
            final_logit_softcapping=opt_number(text.get("final_logit_softcapping")),
        )


def _rope_parameters(model_dir: str | Path, text: Mapping[str, object]) -> tuple[tuple[float, float], ...]:
    """``(theta, linear factor)`` of the local and the global layers, from either config layout."""
    params = section(text, "rope_parameters")
    if SLIDING not in params:  # older layout: rope_theta, rope_local_base_freq, rope_scaling
        scaling = section(text, "rope_scaling")
        params = {
            SLIDING: {"rope_type": "default", "rope_theta": text.get("rope_local_base_freq", 10000.0)},
            FULL: {"rope_type": "default", "rope_theta": text.get("rope_theta", 1000000.0), **scaling},
        }
    out = []
    for kind, default_theta in ((SLIDING, 10000.0), (FULL, 1000000.0)):
        p = section(params, kind)
        rope_type = p.get("rope_type", p.get("type", "default"))
        if rope_type not in ("default", "linear"):
            raise ValueError(
                f"{model_dir}: {kind} rope_type {rope_type!r} is not supported (default, linear)"
            )
        factor = to_float(p.get("factor", 1.0)) if rope_type == "linear" else 1.0
        out.append((to_float(p.get("rope_theta", default_theta)), factor))
    return tuple(out)


class GemmaRMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = x.float()
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        return (h * (1.0 + self.weight.float())).type_as(x)


class ScaledEmbedding(nn.Embedding):
    """Token embeddings times ``sqrt(hidden_size)``, the scale rounded to the weights' dtype (as HF)."""

    def __init__(self, num: int, dim: int) -> None:
        super().__init__(num, dim)
        self.scale = math.sqrt(dim)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return super().forward(ids) * torch.tensor(self.scale).to(self.weight.dtype)


def rope_cos_sin(
    positions: torch.Tensor, head_dim: int, theta: float, factor: float, dtype: torch.dtype
) -> tuple[torch.Tensor, torch.Tensor]:
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.float) / head_dim)) / factor
    freqs = positions[:, None].float() * inv_freq.to(positions.device)
    emb = torch.cat((freqs, freqs), dim=-1)
    return emb.cos().to(dtype)[:, None, :], emb.sin().to(dtype)[:, None, :]


class Gemma3Attention(nn.Module):
    def __init__(self, cfg: Gemma3TextConfig, backend: PagedAttention, sliding: bool) -> None:
        super().__init__()
        self.num_heads, self.num_kv_heads, self.head_dim = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        self.q_proj = nn.Linear(cfg.hidden_size, cfg.num_heads * cfg.head_dim, bias=False)
        self.k_proj = nn.Linear(cfg.hidden_size, cfg.num_kv_heads * cfg.head_dim, bias=False)
        self.v_proj = nn.Linear(cfg.hidden_size, cfg.num_kv_heads * cfg.head_dim, bias=False)
        self.o_proj = nn.Linear(cfg.num_heads * cfg.head_dim, cfg.hidden_size, bias=False)
        self.q_norm = GemmaRMSNorm(cfg.head_dim, cfg.rms_norm_eps)
        self.k_norm = GemmaRMSNorm(cfg.head_dim, cfg.rms_norm_eps)
        self.scale = cfg.query_pre_attn_scalar**-0.5
        self.sliding_window = cfg.sliding_window if sliding else None
        self.backend = backend

    def forward(self, x, rope, kv_cache, meta):  # type: ignore[no-untyped-def]
        t = x.shape[0]
        q = self.q_norm(self.q_proj(x).view(t, self.num_heads, self.head_dim))
        k = self.k_norm(self.k_proj(x).view(t, self.num_kv_heads, self.head_dim))
        v = self.v_proj(x).view(t, self.num_kv_heads, self.head_dim)
        cos, sin = rope
        q = q * cos + rotate_half(q) * sin
        k = k * cos + rotate_half(k) * sin
        o = self.backend.forward(q, k, v, kv_cache, meta, self.scale, self.sliding_window)
        return self.o_proj(o.reshape(t, -1))


class Gemma3MLP(nn.Module):
    def __init__(self, cfg: TextConfig) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(cfg.hidden_size, cfg.intermediate_size, bias=False)
        self.up_proj = nn.Linear(cfg.hidden_size, cfg.intermediate_size, bias=False)
        self.down_proj = nn.Linear(cfg.intermediate_size, cfg.hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate = nn.functional.gelu(self.gate_proj(x), approximate="tanh")
        return self.down_proj(gate * self.up_proj(x))


class Gemma3DecoderLayer(nn.Module):
    def __init__(self, cfg: Gemma3TextConfig, backend: PagedAttention, sliding: bool) -> None:
        super().__init__()
        self.is_sliding = sliding
        eps = cfg.rms_norm_eps
        self.input_layernorm = GemmaRMSNorm(cfg.hidden_size, eps)
        self.self_attn = Gemma3Attention(cfg, backend, sliding)
        self.post_attention_layernorm = GemmaRMSNorm(cfg.hidden_size, eps)
        self.pre_feedforward_layernorm = GemmaRMSNorm(cfg.hidden_size, eps)
        self.mlp = Gemma3MLP(cfg)
        self.post_feedforward_layernorm = GemmaRMSNorm(cfg.hidden_size, eps)

    def forward(self, h, rope, kv_cache, meta):  # type: ignore[no-untyped-def]
        a = self.self_attn(self.input_layernorm(h), rope, kv_cache, meta)
        h = h + self.post_attention_layernorm(a)
        m = self.mlp(self.pre_feedforward_layernorm(h))
        return h + self.post_feedforward_layernorm(m)


class Gemma3ForCausalLM(Qwen2ForCausalLM):
    """Qwen2ForCausalLM's interface (``embed_tokens``, ``forward``, ``compute_logits``, HF weight
    names without the text model's prefix) with Gemma 3's layers; none of Qwen2's modules."""

    bidirectional_mm = True  # the soft tokens of one image attend each other both ways

    def __init__(self, cfg: TextConfig, backend: PagedAttention) -> None:
        nn.Module.__init__(self)
        assert isinstance(cfg, Gemma3TextConfig)
        self.cfg = cfg
        self.gcfg = cfg
        self.embed_tokens = ScaledEmbedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(
            Gemma3DecoderLayer(cfg, backend, sliding) for sliding in cfg.layer_is_sliding
        )
        self.norm = GemmaRMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.lm_head = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)

    @property
    def uses_mrope(self) -> bool:
        return False

    def forward(
        self,
        inputs_embeds: torch.Tensor,
        positions: torch.Tensor,
        kv_caches: list[torch.Tensor],
        meta: AttentionMetadata,
    ) -> torch.Tensor:
        c, dtype = self.gcfg, inputs_embeds.dtype
        local = rope_cos_sin(positions, c.head_dim, c.local_rope_theta, 1.0, dtype)
        glob = rope_cos_sin(positions, c.head_dim, c.rope_theta, c.global_rope_factor, dtype)
        h = inputs_embeds
        for layer, kv in zip(self.layers, kv_caches, strict=True):
            h = layer(h, local if layer.is_sliding else glob, kv, meta)
        return self.norm(h)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        logits = self.lm_head(hidden)
        cap = self.gcfg.final_logit_softcapping
        return torch.tanh(logits / cap) * cap if cap else logits
