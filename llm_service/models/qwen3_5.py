"""Qwen3.5's language model: a hybrid of Gated DeltaNet layers (linear attention, per-sequence
states in the state cache) and gated full-attention layers (paged KV), ``layer_types`` saying which.

Differences from Qwen3-VL's decoder, after transformers' ``modeling_qwen3_5.py``:

- RMSNorms (decoder, final, q/k) scale by ``1 + weight`` (zero-centred), computed in float32;
- attention: ``q_proj`` yields the query and a **gate** per head, ``o = o_proj(attn * sigmoid(gate))``;
  RoPE turns only the first ``partial_rotary_factor * head_dim`` dims (interleaved M-RoPE over them);
- linear attention (``linear_attn``): ``in_proj_qkv`` -> causal depthwise conv (SiLU) -> q, k, v;
  ``beta = sigmoid(in_proj_b)``, ``g = -exp(A_log) * softplus(in_proj_a + dt_bias)``; the gated delta
  rule (``gated_delta.py``) over grouped heads; a gated RMSNorm (``norm(o) * silu(in_proj_z)``) and
  ``out_proj``; no DeepStack.

``TextConfig.num_layers`` here counts the layers that hold paged KV (the full-attention ones): what
the runner allocates KV for and what a block's bytes are. ``layer_types`` has every layer.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, replace
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

from llm_service.attention import AttentionMetadata, PagedAttention
from llm_service.linear_states import LinearStates, Snapshot, StateShapes, StepStates
from llm_service.models.gated_delta import causal_conv, chunk_rule, conv_step, l2norm, recurrent_step
from llm_service.models.hf_config import section, to_float, to_int, to_list
from llm_service.models.qwen2 import DecoderLayer, PositionScheme, Qwen2ForCausalLM, TextConfig, rotate_half
from llm_service.models.qwen3_mrope import InterleavedMRope, qwen3_text_fields

LINEAR, FULL = "linear_attention", "full_attention"


@dataclass(frozen=True)
class Qwen35TextConfig(TextConfig):
    layer_types: tuple[str, ...] = ()
    rotary_dim: int = 0
    linear_num_key_heads: int = 0
    linear_num_value_heads: int = 0
    linear_key_head_dim: int = 0
    linear_value_head_dim: int = 0
    linear_conv_kernel_dim: int = 4
    attention_bias: bool = False

    @classmethod
    def from_hf_config(
        cls, model_dir: str | Path, cfg: Mapping[str, object], scheme: PositionScheme
    ) -> TextConfig:
        sections = (11, 11, 10)  # transformers' default
        shared = qwen3_text_fields(model_dir, cfg, scheme, "Qwen3.5", default_mrope_section=sections)
        text = section(cfg, "text_config") or cfg
        n = to_int(text["num_hidden_layers"])
        interval = to_int(text.get("full_attention_interval", 4))
        types = tuple(
            str(t)
            for t in to_list(
                text.get("layer_types") or [FULL if (i + 1) % interval == 0 else LINEAR for i in range(n)]
            )
        )
        if len(types) != n or set(types) - {LINEAR, FULL}:
            raise ValueError(f"{model_dir}: layer_types must name {n} linear/full attention layers")
        rotary = to_float(section(text, "rope_parameters").get("partial_rotary_factor", 0.25))
        return cls(
            **shared | {"num_layers": types.count(FULL)},
            layer_types=types,
            rotary_dim=int(shared["head_dim"] * rotary),
            linear_num_key_heads=to_int(text.get("linear_num_key_heads", 16)),
            linear_num_value_heads=to_int(text.get("linear_num_value_heads", 32)),
            linear_key_head_dim=to_int(text.get("linear_key_head_dim", 128)),
            linear_value_head_dim=to_int(text.get("linear_value_head_dim", 128)),
            linear_conv_kernel_dim=to_int(text.get("linear_conv_kernel_dim", 4)),
        )

    @property
    def conv_dim(self) -> int:
        return 2 * self.linear_num_key_heads * self.linear_key_head_dim + self.value_dim

    @property
    def value_dim(self) -> int:
        return self.linear_num_value_heads * self.linear_value_head_dim


class ZeroCenteredRMSNorm(nn.Module):
    """``x / rms(x) * (1 + weight)``, all in float32, then back to the input's dtype."""

    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # fused: the same bits as HF's ops (x * rsqrt(mean(x²) + eps), then the weight; test_model_ops.py)
        return F.rms_norm(x.float(), self.weight.shape, 1.0 + self.weight.float(), self.eps).to(x.dtype)


class GatedRMSNorm(nn.Module):
    """``weight * x / rms(x) * silu(gate)`` (norm before gate), per value head."""

    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
        if x.dtype == torch.float32 == self.weight.dtype:  # fused, as ZeroCenteredRMSNorm
            return F.rms_norm(x, self.weight.shape, self.weight, self.eps) * F.silu(gate)
        y = F.rms_norm(x.float(), self.weight.shape, None, self.eps)
        y = self.weight * y.to(x.dtype)
        return (y * F.silu(gate.float())).to(x.dtype)


class GatedAttention(nn.Module):
    def __init__(self, cfg: Qwen35TextConfig, backend: PagedAttention) -> None:
        super().__init__()
        self.num_heads, self.num_kv_heads, self.head_dim = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        self.rotary_dim = cfg.rotary_dim
        bias = cfg.attention_bias
        self.q_proj = nn.Linear(cfg.hidden_size, 2 * cfg.num_heads * cfg.head_dim, bias=bias)
        self.k_proj = nn.Linear(cfg.hidden_size, cfg.num_kv_heads * cfg.head_dim, bias=bias)
        self.v_proj = nn.Linear(cfg.hidden_size, cfg.num_kv_heads * cfg.head_dim, bias=bias)
        self.o_proj = nn.Linear(cfg.num_heads * cfg.head_dim, cfg.hidden_size, bias=bias)
        self.q_norm = ZeroCenteredRMSNorm(cfg.head_dim, cfg.rms_norm_eps)
        self.k_norm = ZeroCenteredRMSNorm(cfg.head_dim, cfg.rms_norm_eps)
        self.scale = cfg.head_dim**-0.5
        self.backend = backend

    def _rope(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        turn, keep = x[..., : self.rotary_dim], x[..., self.rotary_dim :]
        return torch.cat([turn * cos + rotate_half(turn) * sin, keep], dim=-1)

    def forward(self, x, cos, sin, kv_cache, meta):  # type: ignore[no-untyped-def]
        t = x.shape[0]
        q, gate = self.q_proj(x).view(t, self.num_heads, 2 * self.head_dim).chunk(2, dim=-1)
        q = self.q_norm(q)
        k = self.k_norm(self.k_proj(x).view(t, self.num_kv_heads, self.head_dim))
        v = self.v_proj(x).view(t, self.num_kv_heads, self.head_dim)
        c, s = cos[:, None, :], sin[:, None, :]
        q, k = self._rope(q, c, s), self._rope(k, c, s)
        o = self.backend.forward(q, k, v, kv_cache, meta, self.scale).reshape(t, -1)
        return self.o_proj(o * torch.sigmoid(gate.reshape(t, -1)))


class GatedDeltaNet(nn.Module):
    """One linear-attention layer; ``index`` is its place among the linear layers (its states)."""

    def __init__(self, cfg: Qwen35TextConfig, index: int) -> None:
        super().__init__()
        self.index = index
        self.hk, self.hv = cfg.linear_num_key_heads, cfg.linear_num_value_heads
        self.dk, self.dv = cfg.linear_key_head_dim, cfg.linear_value_head_dim
        self.key_dim = self.hk * self.dk
        self.kernel = cfg.linear_conv_kernel_dim
        conv_dim = cfg.conv_dim
        self.in_proj_qkv = nn.Linear(cfg.hidden_size, conv_dim, bias=False)
        self.in_proj_z = nn.Linear(cfg.hidden_size, cfg.value_dim, bias=False)
        self.in_proj_b = nn.Linear(cfg.hidden_size, self.hv, bias=False)
        self.in_proj_a = nn.Linear(cfg.hidden_size, self.hv, bias=False)
        self.conv1d = nn.Conv1d(conv_dim, conv_dim, self.kernel, groups=conv_dim, bias=False)
        self.dt_bias = nn.Parameter(torch.ones(self.hv))
        self.A_log = nn.Parameter(torch.zeros(self.hv))
        self.norm = GatedRMSNorm(self.dv, cfg.rms_norm_eps)
        self.out_proj = nn.Linear(cfg.value_dim, cfg.hidden_size, bias=False)

    def state_shapes(self) -> StateShapes:
        return (self.conv1d.in_channels, self.kernel - 1), (self.hv, self.dk, self.dv)

    def forward(self, x: torch.Tensor, states: LinearStates, step: StepStates) -> torch.Tensor:
        t = x.shape[0]
        mixed = self.in_proj_qkv(x)
        beta = self.in_proj_b(x).sigmoid().float()
        g = -self.A_log.float().exp() * F.softplus(self.in_proj_a(x).float() + self.dt_bias.float())
        conv0, rec0 = states.read(self.index, step)
        conv1, rec1 = torch.empty_like(conv0), torch.empty_like(rec0)
        core = x.new_empty(t, self.hv, self.dv, dtype=torch.float32)
        snaps = step.snapshots.setdefault(self.index, [])
        for i in step.prefills:
            rows = slice(step.q_starts[i], step.q_starts[i] + step.q_lens[i])
            core[rows], conv1[i], rec1[i] = self._prefill(
                mixed[rows], g[rows], beta[rows], conv0[i], rec0[i], dict(step.captures[i]), snaps
            )
        if dec := step.decodes:
            idx = torch.tensor(dec, dtype=torch.long, device=x.device)
            rows_t = torch.tensor([step.q_starts[i] for i in dec], dtype=torch.long, device=x.device)
            out, conv1[idx] = conv_step(mixed[rows_t], conv0[idx], self.conv1d.weight[:, 0, :])
            q, k, v = self._heads(out)  # [B, H, d]
            core[rows_t], rec1[idx] = recurrent_step(q, k, v, g[rows_t], beta[rows_t], rec0[idx])
            snaps.extend((slot, conv1[i], rec1[i]) for i in dec for _, slot in step.captures[i])
        step.staged[self.index] = (conv1, rec1)
        z = self.in_proj_z(x).view(t * self.hv, self.dv)
        o = self.norm(core.to(x.dtype).view(t * self.hv, self.dv), z)
        return self.out_proj(o.view(t, -1))

    def _prefill(
        self,
        mixed: torch.Tensor,
        g: torch.Tensor,
        beta: torch.Tensor,
        conv: torch.Tensor,
        state: torch.Tensor,
        captures: dict[int, int],
        snaps: list[Snapshot],
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """One sequence's chunk of ``n`` tokens from ``(conv, state)``: its outputs ``[n, H, d_v]`` and
        final states; cut where ``captures`` (offset -> snapshot slot) want the states, which go to
        ``snaps``."""
        n = mixed.shape[0]
        out, full = causal_conv(mixed, conv, self.conv1d.weight[:, 0, :])
        q, k, v = (y.transpose(0, 1) for y in self._heads(out))  # [H, n, d]
        g, beta = g.t(), beta.t()
        inner = sorted(c for c in captures if 0 < c < n)
        core, end, at_inner = chunk_rule(q, k, v, g, beta, state, inner)
        at = {0: state, n: end, **dict(zip(inner, at_inner, strict=True))}
        for cut in sorted(captures):
            snaps.append((captures[cut], full[:, cut : cut + self.kernel - 1], at[cut]))
        return core.transpose(0, 1), full[:, n:], end

    def _heads(self, mixed: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """q, k (L2-normalised, q scaled, grouped up to the value heads) and v, float32, ``[..., H, d]``."""
        lead = mixed.shape[:-1]
        q, k, v = mixed.float().split([self.key_dim, self.key_dim, self.hv * self.dv], dim=-1)
        q, k = (l2norm(y.view(*lead, self.hk, self.dk)) for y in (q, k))
        if self.hv != self.hk:
            q, k = (y.repeat_interleave(self.hv // self.hk, dim=-2) for y in (q, k))
        return q * self.dk**-0.5, k, v.view(*lead, self.hv, self.dv)


class HybridDecoderLayer(DecoderLayer):
    """A Qwen decoder block around a Gated DeltaNet (``linear_attn``: called with the states) or a
    gated attention (``self_attn``: called with RoPE and a KV cache), with zero-centred norms."""

    def __init__(self, cfg: Qwen35TextConfig, kind: str, index: int, backend: PagedAttention) -> None:
        if kind == LINEAR:
            super().__init__(cfg, GatedDeltaNet(cfg, index), ZeroCenteredRMSNorm, "linear_attn")
        else:
            super().__init__(cfg, GatedAttention(cfg, backend), ZeroCenteredRMSNorm)
        self.kind = kind
        self.index = index  # among the layers of its kind: its KV cache or its states


class Qwen35ForCausalLM(Qwen2ForCausalLM):
    """Module names mirror HF's text model with its prefix stripped (see ``weights.py``).

    ``linear_states`` (the runner's, one per engine) is where its linear layers' states live; a step's
    ``AttentionMetadata.states`` says which slots its sequences read and write."""

    def __init__(self, cfg: TextConfig, backend: PagedAttention) -> None:
        nn.Module.__init__(self)
        if not isinstance(cfg, Qwen35TextConfig):
            raise TypeError("Qwen35ForCausalLM needs a Qwen35TextConfig")
        self.cfg = cfg
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        seen = {LINEAR: 0, FULL: 0}
        layers = []
        for kind in cfg.layer_types:
            layers.append(HybridDecoderLayer(cfg, kind, seen[kind], backend))
            seen[kind] += 1
        self.layers = nn.ModuleList(layers)
        self.norm = ZeroCenteredRMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.lm_head = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        self.rotary = InterleavedMRope(replace(cfg, head_dim=cfg.rotary_dim))
        self.linear_states: LinearStates | None = None

    def state_shapes(self) -> list[StateShapes]:
        return [layer.linear_attn.state_shapes() for layer in self.layers if layer.kind == LINEAR]

    def forward(
        self,
        inputs_embeds: torch.Tensor,
        positions: torch.Tensor,
        kv_caches: list[torch.Tensor],
        meta: AttentionMetadata,
    ) -> torch.Tensor:
        states, step = self.linear_states, meta.states
        if states is None or step is None:
            raise RuntimeError("a hybrid decoder runs with the runner's linear states and a step's slots")
        cos, sin = self.rotary(positions, inputs_embeds.dtype)
        h = inputs_embeds
        for layer in self.layers:
            if layer.kind == LINEAR:
                h = layer(h, states, step)
            else:
                h = layer(h, cos, sin, kv_caches[layer.index], meta)
        return self.norm(h)
