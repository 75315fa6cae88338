"""Qwen3-VL's language model: a Qwen3 decoder (RMSNorm on each head's q and k before RoPE, no qkv
bias, explicit ``head_dim``) with interleaved M-RoPE and DeepStack.

Interleaved M-RoPE: see ``qwen3_mrope.py``.

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
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn

from llm_service.attention import AttentionMetadata, PagedAttention
from llm_service.models.hf_config import section, to_list
from llm_service.models.qwen2 import (
    Attention,
    DecoderLayer,
    PositionScheme,
    Qwen2ForCausalLM,
    RMSNorm,
    TextConfig,
)
from llm_service.models.qwen3_mrope import InterleavedMRope, qwen3_text_fields


@dataclass(frozen=True)
class Qwen3VLTextConfig(TextConfig):
    attention_bias: bool = False
    deepstack_levels: int = 0  # len(vision_config.deepstack_visual_indexes)

    @classmethod
    def from_hf_config(
        cls, model_dir: str | Path, cfg: Mapping[str, object], scheme: PositionScheme
    ) -> TextConfig:
        shared = qwen3_text_fields(model_dir, cfg, scheme, "Qwen3-VL")
        vision = section(cfg, "vision_config")
        return cls(
            **shared,
            deepstack_levels=len(to_list(vision.get("deepstack_visual_indexes", (8, 16, 24)))),
        )


def qwen3_attention(cfg: Qwen3VLTextConfig, backend: PagedAttention) -> Attention:
    """Qwen3's attention: q/k RMSNorm per head, ``attention_bias`` on all four projections."""
    bias = cfg.attention_bias
    return Attention(cfg, backend, qkv_bias=bias, o_bias=bias, qk_norm=True)


class Qwen3VLForCausalLM(Qwen2ForCausalLM):
    """Module names mirror HF's text model with its prefix stripped (see ``weights.py``)."""

    def __init__(self, cfg: TextConfig, backend: PagedAttention) -> None:
        nn.Module.__init__(self)
        if not isinstance(cfg, Qwen3VLTextConfig):
            raise TypeError("Qwen3VLForCausalLM needs a Qwen3VLTextConfig")
        self.cfg = cfg
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(
            DecoderLayer(cfg, qwen3_attention(cfg, backend)) for _ in range(cfg.num_layers)
        )
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
