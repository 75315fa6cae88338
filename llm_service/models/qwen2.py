"""Qwen2 decoder (Qwen2-Audio's LM) and the Qwen2-VL / Qwen2.5-VL decoders (the same with M-RoPE).

Inputs are flat: ``inputs_embeds [T, hidden]`` for every token of the batch and ``positions`` ``[T]``
(1-D RoPE) or ``[3, T]`` (M-RoPE: temporal, height, width). Math follows transformers' Qwen2 /
Qwen2-VL text models so greedy outputs agree token for token.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

import torch
from torch import nn

from llm_service.attention import AttentionMetadata, PagedAttention
from llm_service.models.hf_config import number, section, to_float, to_int, to_list

PositionScheme = Literal["rope", "mrope", "mrope_abs_time"]


@dataclass(frozen=True)
class TextConfig:
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    mrope_section: tuple[int, ...] | None  # set for the M-RoPE schemes
    spatial_merge_size: int
    tie_word_embeddings: bool
    eos_token_ids: tuple[int, ...]
    architecture: str
    model_type: str = "qwen2"
    tokens_per_second: float | None = None  # set for "mrope_abs_time" (Qwen2.5-VL video positions)

    @classmethod
    def from_hf_config(
        cls, model_dir: str | Path, cfg: Mapping[str, object], scheme: PositionScheme
    ) -> TextConfig:
        """The decoder's facts from a ``config.json`` dict (text fields top-level or under ``text_config``)."""
        text = section(cfg, "text_config") or cfg
        arch = str(to_list(cfg.get("architectures") or ["Qwen2ForCausalLM"])[0])
        if text.get("use_sliding_window"):
            raise ValueError(f"{model_dir}: sliding-window attention (use_sliding_window) is not supported")
        rope = section(text, "rope_parameters") or section(text, "rope_scaling")
        theta = rope.get("rope_theta", text.get("rope_theta", 10000.0))
        mrope = None
        if scheme != "rope":
            mrope = to_list(rope.get("mrope_section") or [16, 24, 24])  # transformers' default
        vision = section(cfg, "vision_config")
        tps = None
        if scheme == "mrope_abs_time":
            tps = to_float(vision.get("tokens_per_second", 4))  # transformers' default
        heads = to_int(text["num_attention_heads"])
        head_dim = to_int(text.get("head_dim") or to_int(text["hidden_size"]) // heads)
        return cls(
            vocab_size=to_int(text["vocab_size"]),
            hidden_size=to_int(text["hidden_size"]),
            intermediate_size=to_int(text["intermediate_size"]),
            num_layers=to_int(text["num_hidden_layers"]),
            num_heads=heads,
            num_kv_heads=to_int(text.get("num_key_value_heads", heads)),
            head_dim=head_dim,
            rms_norm_eps=number(text.get("rms_norm_eps", 1e-6)),
            rope_theta=to_float(theta),
            mrope_section=tuple(to_int(m) for m in mrope) if mrope else None,
            spatial_merge_size=to_int(vision.get("spatial_merge_size", 2)),
            tie_word_embeddings=bool(cfg.get("tie_word_embeddings", text.get("tie_word_embeddings", False))),
            eos_token_ids=_eos_ids(Path(model_dir), cfg, text),
            architecture=arch,
            model_type=str(cfg.get("model_type", "qwen2")),
            tokens_per_second=tps,
        )

    def kv_layer_specs(self) -> list[tuple[int, int]]:
        """``(num_kv_heads, head_dim)`` of each KV cache the decoder writes, in layer order: one per layer
        here (Gemma 4's KV-shared layers own none, and its full layers have other shapes)."""
        return [(self.num_kv_heads, self.head_dim)] * self.num_layers

    def kv_layer_windows(self) -> list[int | None]:
        """Per KV cache of ``kv_layer_specs``: the sliding window of the layers that read it (None: full)."""
        return [None] * len(self.kv_layer_specs())


def _eos_ids(d: Path, cfg: Mapping[str, object], text: Mapping[str, object]) -> tuple[int, ...]:
    gen_path = d / "generation_config.json"
    eos: object = json.loads(gen_path.read_text()).get("eos_token_id") if gen_path.exists() else None
    if eos is None:
        eos = cfg.get("eos_token_id", text.get("eos_token_id"))
    if eos is None:
        return ()
    return tuple(to_int(e) for e in eos) if isinstance(eos, list) else (to_int(eos),)


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """HF's ``weight * (x * rsqrt(mean(x²) + eps))`` with the norm in float32; one fused op in
        float32 (the same bits as HF's four: checked in tests/unit/llm_service/models/test_model_ops.py)."""
        if x.dtype == torch.float32 == self.weight.dtype:
            return nn.functional.rms_norm(x, self.weight.shape, self.weight, self.eps)
        return self.weight * nn.functional.rms_norm(x.float(), self.weight.shape, None, self.eps).to(x.dtype)


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


class RotaryEmbedding(nn.Module):
    """cos/sin for 1-D positions ``[T]`` or M-RoPE positions ``[3, T]`` (frequency sections taken from
    the t, h, w position rows in turn, as in Qwen2-VL)."""

    def __init__(self, cfg: TextConfig) -> None:
        super().__init__()
        dim = cfg.head_dim
        inv_freq = 1.0 / (cfg.rope_theta ** (torch.arange(0, dim, 2, dtype=torch.float) / dim))
        self.register_buffer("inv_freq", inv_freq, persistent=False)
        self.mrope_section = cfg.mrope_section

    def forward(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        freqs = positions[..., None].float() * self.inv_freq.float()  # [T, d/2] or [3, T, d/2]
        cos, sin = freqs.cos(), freqs.sin()
        if self.mrope_section is not None:
            if positions.dim() == 1:
                cos, sin = cos.expand(3, -1, -1), sin.expand(3, -1, -1)
            cos, sin = self._sections(cos), self._sections(sin)
        cos, sin = torch.cat((cos, cos), dim=-1), torch.cat((sin, sin), dim=-1)
        return cos.to(dtype), sin.to(dtype)

    def _sections(self, f: torch.Tensor) -> torch.Tensor:
        assert self.mrope_section is not None
        parts = f.split(list(self.mrope_section), dim=-1)
        return torch.cat([p[i % 3] for i, p in enumerate(parts)], dim=-1)


class Attention(nn.Module):
    """Paged self-attention with RoPE on q and k. Qwen2: bias on q, k, v only; Qwen3 (``qk_norm``):
    an RMSNorm over each head's q and k before RoPE, one bias flag for all four projections."""

    def __init__(
        self,
        cfg: TextConfig,
        backend: PagedAttention,
        qkv_bias: bool = True,
        o_bias: bool = False,
        qk_norm: bool = False,
    ) -> None:
        super().__init__()
        self.num_heads, self.num_kv_heads, self.head_dim = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        self.q_proj = nn.Linear(cfg.hidden_size, cfg.num_heads * cfg.head_dim, bias=qkv_bias)
        self.k_proj = nn.Linear(cfg.hidden_size, cfg.num_kv_heads * cfg.head_dim, bias=qkv_bias)
        self.v_proj = nn.Linear(cfg.hidden_size, cfg.num_kv_heads * cfg.head_dim, bias=qkv_bias)
        self.o_proj = nn.Linear(cfg.num_heads * cfg.head_dim, cfg.hidden_size, bias=o_bias)
        self.q_norm = RMSNorm(cfg.head_dim, cfg.rms_norm_eps) if qk_norm else None
        self.k_norm = RMSNorm(cfg.head_dim, cfg.rms_norm_eps) if qk_norm else None
        self.scale = cfg.head_dim**-0.5
        self.backend = backend

    def forward(self, x, cos, sin, kv_cache, meta):  # type: ignore[no-untyped-def]
        t = x.shape[0]
        q = self.q_proj(x).view(t, self.num_heads, self.head_dim)
        k = self.k_proj(x).view(t, self.num_kv_heads, self.head_dim)
        if self.q_norm is not None and self.k_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        v = self.v_proj(x).view(t, self.num_kv_heads, self.head_dim)
        c, s = cos[:, None, :], sin[:, None, :]
        q = q * c + rotate_half(q) * s
        k = k * c + rotate_half(k) * s
        o = self.backend.forward(q, k, v, kv_cache, meta, self.scale)
        return self.o_proj(o.reshape(t, -1))


class MLP(nn.Module):
    def __init__(self, cfg: TextConfig) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(cfg.hidden_size, cfg.intermediate_size, bias=False)
        self.up_proj = nn.Linear(cfg.hidden_size, cfg.intermediate_size, bias=False)
        self.down_proj = nn.Linear(cfg.intermediate_size, cfg.hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(nn.functional.silu(self.gate_proj(x)) * self.up_proj(x))


class DecoderLayer(nn.Module):
    """The Qwen decoder block, pre-norm: ``h + mixer(input_layernorm(h))``, then
    ``h + mlp(post_attention_layernorm(h))``.

    The token mixer is the family's, kept under its HF name ``mixer_name`` (``self_attn``; Qwen3.5's
    linear layers: ``linear_attn``) and called with the arguments after ``h``; ``norm`` makes the two
    norms (``RMSNorm``; Qwen3.5: zero-centred).
    """

    def __init__(
        self,
        cfg: TextConfig,
        mixer: nn.Module,
        norm: Callable[[int, float], nn.Module] = RMSNorm,
        mixer_name: str = "self_attn",
    ) -> None:
        super().__init__()
        self.mixer_name = mixer_name
        self.input_layernorm = norm(cfg.hidden_size, cfg.rms_norm_eps)
        self.add_module(mixer_name, mixer)
        self.post_attention_layernorm = norm(cfg.hidden_size, cfg.rms_norm_eps)
        self.mlp = MLP(cfg)

    def forward(self, h: torch.Tensor, *mixer_args: object) -> torch.Tensor:
        mixer = getattr(self, self.mixer_name)
        h = h + mixer(self.input_layernorm(h), *mixer_args)
        return h + self.mlp(self.post_attention_layernorm(h))


class Qwen2ForCausalLM(nn.Module):
    """Module names mirror HF's text model with its prefix stripped (see ``weights.py``)."""

    def __init__(self, cfg: TextConfig, backend: PagedAttention) -> None:
        super().__init__()
        self.cfg = cfg
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(cfg, Attention(cfg, backend)) for _ in range(cfg.num_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.lm_head = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        self.rotary = RotaryEmbedding(cfg)

    @property
    def uses_mrope(self) -> bool:
        return self.cfg.mrope_section is not None

    def forward(
        self,
        inputs_embeds: torch.Tensor,
        positions: torch.Tensor,
        kv_caches: list[torch.Tensor],
        meta: AttentionMetadata,
    ) -> torch.Tensor:
        cos, sin = self.rotary(positions, inputs_embeds.dtype)
        h = inputs_embeds
        for layer, kv in zip(self.layers, kv_caches, strict=True):
            h = layer(h, cos, sin, kv, meta)
        return self.norm(h)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.lm_head(hidden)
