"""Qwen3-VL's language model: a Qwen3 decoder (RMSNorm on each head's q and k before RoPE, no qkv
bias, explicit ``head_dim``) with interleaved M-RoPE and DeepStack.

Interleaved M-RoPE: frequency ``i`` of ``head_dim/2`` takes its position from the height row when
``i % 3 == 1 and i < 3 * mrope_section[1]``, from the width row when ``i % 3 == 2 and i < 3 *
mrope_section[2]``, else from the temporal row (transformers' ``recomposition_frequencies``), where
Qwen2-VL takes contiguous sections.

DeepStack: an image row of the encoder's output is ``[main | level 0 | ... | level k-1]``
(``encoder_service/encode/models/qwen3_vl_vision.py``). The runner writes whole rows into the step's
``inputs_embeds`` (``mm_row_width`` wide; text and decode rows are zero past ``hidden_size``) and
this model adds level ``j`` to the hidden states after decoder layer ``j``, position by position, as
transformers' ``_deepstack_process`` does over the visual mask. Adding the zeros of a text row
changes nothing, so a chunk that holds part of an image gets exactly that part's levels, and
positions a prefix-cache hit skips are not computed at all (their cached KV already saw them).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, fields
from pathlib import Path

import torch
from torch import nn

from llm_service.attention import AttentionMetadata, PagedAttention
from llm_service.models.hf_config import section, to_list
from llm_service.models.qwen2 import (
    MLP,
    PositionScheme,
    Qwen2ForCausalLM,
    RMSNorm,
    RotaryEmbedding,
    TextConfig,
    rotate_half,
)


@dataclass(frozen=True)
class Qwen3VLTextConfig(TextConfig):
    attention_bias: bool = False
    deepstack_levels: int = 0  # len(vision_config.deepstack_visual_indexes)

    @classmethod
    def from_hf_config(
        cls, model_dir: str | Path, cfg: Mapping[str, object], scheme: PositionScheme
    ) -> TextConfig:
        text = section(cfg, "text_config") or cfg
        rope = section(text, "rope_parameters")
        if not rope.get("mrope_interleaved", True):
            raise ValueError(
                f"{model_dir}: Qwen3-VL with contiguous (non-interleaved) M-RoPE is not supported"
            )
        base = TextConfig.from_hf_config(model_dir, cfg, scheme)
        vision = section(cfg, "vision_config")
        return cls(
            **{f.name: getattr(base, f.name) for f in fields(TextConfig)},
            attention_bias=bool(text.get("attention_bias", False)),
            deepstack_levels=len(to_list(vision.get("deepstack_visual_indexes", (8, 16, 24)))),
        )


class InterleavedMRope(RotaryEmbedding):
    def _sections(self, f: torch.Tensor) -> torch.Tensor:
        assert self.mrope_section is not None
        out = f[0].clone()
        for row in (1, 2):
            idx = slice(row, 3 * self.mrope_section[row], 3)
            out[..., idx] = f[row][..., idx]
        return out


class Qwen3Attention(nn.Module):
    def __init__(self, cfg: Qwen3VLTextConfig, backend: PagedAttention) -> None:
        super().__init__()
        self.num_heads, self.num_kv_heads, self.head_dim = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        bias = cfg.attention_bias
        self.q_proj = nn.Linear(cfg.hidden_size, cfg.num_heads * cfg.head_dim, bias=bias)
        self.k_proj = nn.Linear(cfg.hidden_size, cfg.num_kv_heads * cfg.head_dim, bias=bias)
        self.v_proj = nn.Linear(cfg.hidden_size, cfg.num_kv_heads * cfg.head_dim, bias=bias)
        self.o_proj = nn.Linear(cfg.num_heads * cfg.head_dim, cfg.hidden_size, bias=bias)
        self.q_norm = RMSNorm(cfg.head_dim, cfg.rms_norm_eps)
        self.k_norm = RMSNorm(cfg.head_dim, cfg.rms_norm_eps)
        self.scale = cfg.head_dim**-0.5
        self.backend = backend

    def forward(self, x, cos, sin, kv_cache, meta):  # type: ignore[no-untyped-def]
        t = x.shape[0]
        q = self.q_norm(self.q_proj(x).view(t, self.num_heads, self.head_dim))
        k = self.k_norm(self.k_proj(x).view(t, self.num_kv_heads, self.head_dim))
        v = self.v_proj(x).view(t, self.num_kv_heads, self.head_dim)
        c, s = cos[:, None, :], sin[:, None, :]
        q = q * c + rotate_half(q) * s
        k = k * c + rotate_half(k) * s
        o = self.backend.forward(q, k, v, kv_cache, meta, self.scale)
        return self.o_proj(o.reshape(t, -1))


class Qwen3DecoderLayer(nn.Module):
    def __init__(self, cfg: Qwen3VLTextConfig, backend: PagedAttention) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.self_attn = Qwen3Attention(cfg, backend)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.mlp = MLP(cfg)

    def forward(self, h, cos, sin, kv_cache, meta):  # type: ignore[no-untyped-def]
        h = h + self.self_attn(self.input_layernorm(h), cos, sin, kv_cache, meta)
        return h + self.mlp(self.post_attention_layernorm(h))


class Qwen3VLForCausalLM(Qwen2ForCausalLM):
    """Module names mirror HF's text model with its prefix stripped (see ``weights.py``)."""

    def __init__(self, cfg: TextConfig, backend: PagedAttention) -> None:
        nn.Module.__init__(self)
        if not isinstance(cfg, Qwen3VLTextConfig):
            raise TypeError("Qwen3VLForCausalLM needs a Qwen3VLTextConfig")
        self.cfg = cfg
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(Qwen3DecoderLayer(cfg, backend) for _ in range(cfg.num_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.lm_head = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        self.rotary = InterleavedMRope(cfg)
        self.deepstack_levels = min(cfg.deepstack_levels, cfg.num_layers)
        self.mm_row_width = cfg.hidden_size * (1 + cfg.deepstack_levels)  # an encoder output row

    def forward(
        self,
        inputs_embeds: torch.Tensor,
        positions: torch.Tensor,
        kv_caches: list[torch.Tensor],
        meta: AttentionMetadata,
    ) -> torch.Tensor:
        """``inputs_embeds`` ``[T, hidden]``, or ``[T, mm_row_width]`` with DeepStack levels after the
        main columns (zero on rows that are not an image's)."""
        hidden = self.cfg.hidden_size
        h = inputs_embeds[:, :hidden]
        levels = inputs_embeds[:, hidden:] if inputs_embeds.shape[1] > hidden else None
        cos, sin = self.rotary(positions, h.dtype)
        for i, (layer, kv) in enumerate(zip(self.layers, kv_caches, strict=True)):
            h = layer(h, cos, sin, kv, meta)
            if levels is not None and i < self.deepstack_levels:
                h = h + levels[:, i * hidden : (i + 1) * hidden]
        return self.norm(h)
