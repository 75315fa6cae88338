"""Gemma 4's audio encoder, a conformer (math as transformers 5.25's ``Gemma4AudioModel`` + ``embed_audio``)::

    log-mel [T, 128] (x frame mask) ─▶ 2 x (Conv2d 3x3 stride 2 ─▶ LayerNorm over channels ─▶ ReLU)
      ─▶ Linear ─▶ [T/4, width]
      ─▶ conformer layers: half-step FFN ─▶ chunked local self-attention (blocks of ``chunk`` frames
         seeing ``left - 1`` frames back, relative position bias, logit soft cap) ─▶ light conv
         (GLU, causal depthwise conv, SiLU) ─▶ half-step FFN ─▶ RMSNorm
      ─▶ Linear ─▶ RMSNorm (no weight) ─▶ Linear ─▶ [valid frames, hidden]

One clip per forward (clips differ in length; their cost is small beside the LLM's). The tower is
replicated on every TP rank (its linears are tiny beside the vision tower's).
"""

from __future__ import annotations

import math

import torch
from torch import nn
from torch.nn import functional as F

from encoder_service.encode.models.common import activation
from encoder_service.encode.models.gemma4_vision import Clipped, Gemma4RMSNorm
from encoder_service.encode.models.weights import CheckpointReader
from encoder_service.encode.tp.parallel import ColumnParallelLinear

TOWER_PREFIXES = ("model.audio_tower.", "audio_tower.")
EMBEDDER_PREFIXES = ("model.embed_audio.", "embed_audio.")
AUDIO_DEFAULTS = {  # transformers' Gemma4AudioConfig defaults under what config.json sets
    "hidden_size": 1024,
    "num_hidden_layers": 12,
    "num_attention_heads": 8,
    "hidden_act": "silu",
    "subsampling_conv_channels": [128, 32],
    "conv_kernel_size": 5,
    "residual_weight": 0.5,
    "attention_chunk_size": 12,
    "attention_context_left": 13,
    "attention_context_right": 0,
    "attention_logit_cap": 50.0,
    "attention_invalid_logits_value": -1.0e9,
    "use_clipped_linears": True,
    "rms_norm_eps": 1e-6,
    "gradient_clipping": 1e10,
    "output_proj_dims": 1536,
}


def _linear(n_in: int, n_out: int, clip: bool) -> Clipped:
    return Clipped(ColumnParallelLinear(n_in, n_out, bias=False), clip)


def _load(lin: Clipped, reader: CheckpointReader, name: str) -> None:
    lin.load(reader, name, torch.arange(lin.linear.weight.shape[0]))


def subsample_mask(mask: torch.Tensor) -> torch.Tensor:
    """The frame mask after the two stride-2 convolutions (what HF's processor counts soft tokens by)."""
    return mask[::2][::2]


class FeedForward(nn.Module):
    def __init__(self, ac: dict) -> None:
        super().__init__()
        d, clip = ac["hidden_size"], bool(ac["use_clipped_linears"])
        self.ffw_layer_1, self.ffw_layer_2 = _linear(d, 4 * d, clip), _linear(4 * d, d, clip)
        self.pre_layer_norm, self.post_layer_norm = Gemma4RMSNorm(d, 1e-6), Gemma4RMSNorm(d, 1e-6)
        self.act, self.scale, self.clip = (
            activation(ac["hidden_act"]),
            ac["residual_weight"],
            ac["gradient_clipping"],
        )

    def load(self, reader: CheckpointReader, name: str) -> None:
        for part in ("ffw_layer_1", "ffw_layer_2"):
            _load(getattr(self, part), reader, f"{name}.{part}")
        self.pre_layer_norm.load(reader, f"{name}.pre_layer_norm")
        self.post_layer_norm.load(reader, f"{name}.post_layer_norm")

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        c = min(self.clip, torch.finfo(x.dtype).max)
        h = self.ffw_layer_2(self.act(self.ffw_layer_1(self.pre_layer_norm(x.clamp(-c, c)))))
        return self.post_layer_norm(h.clamp(-c, c)) * self.scale + x


class ChunkedAttention(nn.Module):
    def __init__(self, ac: dict) -> None:
        super().__init__()
        d, clip = ac["hidden_size"], bool(ac["use_clipped_linears"])
        self.heads = ac["num_attention_heads"]
        self.head_dim = d // self.heads
        self.q_scale = (self.head_dim**-0.5) / math.log(2)
        self.k_scale = math.log(1 + math.e) / math.log(2)
        self.chunk = ac["attention_chunk_size"]
        self.past = ac["attention_context_left"] - 1
        self.future = ac["attention_context_right"]
        self.context = self.chunk + self.past + self.future
        self.cap, self.invalid = float(ac["attention_logit_cap"]), float(ac["attention_invalid_logits_value"])
        self.q_proj, self.k_proj, self.v_proj, self.post = (_linear(d, d, clip) for _ in range(4))
        self.relative_k_proj = nn.Parameter(torch.empty(d, d), requires_grad=False)
        self.per_dim_scale = nn.Parameter(torch.zeros(self.head_dim), requires_grad=False)

    def load(self, reader: CheckpointReader, name: str) -> None:
        for part in ("q_proj", "k_proj", "v_proj", "post"):
            _load(getattr(self, part), reader, f"{name}.{part}")
        self.relative_k_proj.data = reader.get(f"{name}.relative_k_proj.weight")
        self.per_dim_scale.data = reader.get(f"{name}.per_dim_scale")

    def _blocks(self, x: torch.Tensor) -> torch.Tensor:  # [T, H, D] -> [nb, chunk, H, D]
        nb = -(-x.shape[0] // self.chunk)
        return F.pad(x, (0, 0, 0, 0, 0, nb * self.chunk - x.shape[0])).view(nb, self.chunk, *x.shape[1:])

    def _context(self, x: torch.Tensor) -> torch.Tensor:  # [T, H, D] -> [nb, context, H, D]
        x = F.pad(x, (0, 0, 0, 0, self.past, self.future + self.chunk - 1))
        return torch.movedim(x.unfold(0, self.context, self.chunk), -1, 1)

    def _rel_shift(self, x: torch.Tensor) -> torch.Tensor:  # [H, nb, chunk, P] -> [H, nb, chunk, context]
        h, nb, c, p = x.shape
        x = F.pad(x, (0, self.context + 1 - p)).view(h, nb, c * (self.context + 1))
        return x[..., : c * self.context].view(h, nb, c, self.context)

    def forward(self, x: torch.Tensor, pos: torch.Tensor, masked: torch.Tensor) -> torch.Tensor:
        """``masked``: ``[nb, chunk, context]`` bool, True where a query may not see a key."""
        t = x.shape[0]
        shape = (t, self.heads, self.head_dim)
        q = self.q_proj(x).float().view(shape) * self.q_scale * F.softplus(self.per_dim_scale)
        k = self.k_proj(x).float().view(shape) * self.k_scale
        v = self.v_proj(x).float().view(shape)
        qb = self._blocks(q).permute(2, 0, 1, 3)  # [H, nb, chunk, D]
        kc, vc = self._context(k).permute(2, 0, 3, 1), self._context(v).permute(2, 0, 1, 3)
        rel = F.linear(pos, self.relative_k_proj).view(-1, self.heads, self.head_dim).to(qb.dtype)
        ac = qb @ kc  # [H, nb, chunk, context]
        bd = (qb.reshape(self.heads, -1, self.head_dim) @ rel.permute(1, 2, 0)).view(*qb.shape[:3], -1)
        logits = torch.tanh((ac + self._rel_shift(bd)) / self.cap) * self.cap
        logits = logits.masked_fill(masked, self.invalid)
        o = F.softmax(logits, dim=-1, dtype=torch.float32).to(vc.dtype) @ vc  # [H, nb, chunk, D]
        o = o.permute(1, 2, 0, 3).reshape(-1, self.heads * self.head_dim)[:t]
        return self.post(o.to(x.dtype))


class LightConv(nn.Module):
    def __init__(self, ac: dict) -> None:
        super().__init__()
        d, clip, eps = ac["hidden_size"], bool(ac["use_clipped_linears"]), ac["rms_norm_eps"]
        self.linear_start, self.linear_end = _linear(d, 2 * d, clip), _linear(d, d, clip)
        self.kernel = ac["conv_kernel_size"]
        self.depthwise = nn.Parameter(torch.empty(d, 1, self.kernel), requires_grad=False)
        self.pre_layer_norm, self.conv_norm = Gemma4RMSNorm(d, eps), Gemma4RMSNorm(d, eps)
        self.act, self.clip = activation(ac["hidden_act"]), ac["gradient_clipping"]

    def load(self, reader: CheckpointReader, name: str) -> None:
        _load(self.linear_start, reader, f"{name}.linear_start")
        _load(self.linear_end, reader, f"{name}.linear_end")
        self.depthwise.data = reader.get(f"{name}.depthwise_conv1d.weight")
        self.pre_layer_norm.load(reader, f"{name}.pre_layer_norm")
        self.conv_norm.load(reader, f"{name}.conv_norm")

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = F.glu(self.linear_start(self.pre_layer_norm(x)), dim=-1)
        h = F.conv1d(F.pad(h.T[None], (self.kernel - 1, 0)), self.depthwise, groups=h.shape[-1])[0].T
        c = min(self.clip, torch.finfo(h.dtype).max)
        return self.linear_end(self.act(self.conv_norm(h.clamp(-c, c)))) + x


class ConformerLayer(nn.Module):
    NORMS = ("norm_pre_attn", "norm_post_attn", "norm_out")

    def __init__(self, ac: dict) -> None:
        super().__init__()
        self.feed_forward1, self.feed_forward2 = FeedForward(ac), FeedForward(ac)
        self.self_attn, self.lconv1d = ChunkedAttention(ac), LightConv(ac)
        for norm in self.NORMS:
            setattr(self, norm, Gemma4RMSNorm(ac["hidden_size"], 1e-6))
        self.clip = ac["gradient_clipping"]

    def load(self, reader: CheckpointReader, name: str) -> None:
        for part in ("feed_forward1", "feed_forward2", "self_attn", "lconv1d", *self.NORMS):
            getattr(self, part).load(reader, f"{name}.{part}")

    def forward(self, x: torch.Tensor, pos: torch.Tensor, masked: torch.Tensor) -> torch.Tensor:
        c = min(self.clip, torch.finfo(self.norm_pre_attn.weight.dtype).max)  # type: ignore[union-attr]
        x = self.feed_forward1(x)
        a = self.self_attn(self.norm_pre_attn(x.clamp(-c, c)), pos, masked)
        x = self.norm_post_attn(a.clamp(-c, c)) + x
        x = self.feed_forward2(self.lconv1d(x))
        return self.norm_out(x.clamp(-c, c))


class SubsampleLayer(nn.Module):
    def __init__(self, c_in: int, c_out: int, eps: float) -> None:
        super().__init__()
        self.conv = nn.Parameter(torch.empty(c_out, c_in, 3, 3), requires_grad=False)
        self.norm = nn.Parameter(torch.ones(c_out), requires_grad=False)
        self.eps = eps

    def load(self, reader: CheckpointReader, name: str) -> None:
        self.conv.data = reader.get(f"{name}.conv.weight")
        self.norm.data = reader.get(f"{name}.norm.weight")

    def forward(self, x: torch.Tensor, mask: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        x = F.conv2d(x * mask[None, :, None], self.conv, stride=2, padding=1)  # [C, T, F]
        x = F.layer_norm(x.permute(1, 2, 0), (x.shape[0],), self.norm, None, self.eps).permute(2, 0, 1)
        return F.relu(x), mask[::2]


class Gemma4AudioTower(nn.Module):
    def __init__(self, config: dict, text_hidden: int) -> None:
        super().__init__()
        ac = {**AUDIO_DEFAULTS, **(config.get("audio_config") or {})}
        ch, eps, d = ac["subsampling_conv_channels"], ac["rms_norm_eps"], ac["hidden_size"]
        self.layer0, self.layer1 = SubsampleLayer(1, ch[0], eps), SubsampleLayer(ch[0], ch[1], eps)
        self.input_proj = nn.Parameter(torch.empty(d, (ch[0] // 4) * ch[1]), requires_grad=False)
        self.layers = nn.ModuleList(ConformerLayer(ac) for _ in range(ac["num_hidden_layers"]))
        self.output_proj = nn.Linear(d, ac["output_proj_dims"])
        self.embed_norm = Gemma4RMSNorm(ac["output_proj_dims"], eps, with_scale=False)
        self.projection = nn.Parameter(torch.empty(text_hidden, ac["output_proj_dims"]), requires_grad=False)
        self.chunk, self.past, self.future = (
            ac["attention_chunk_size"],
            ac["attention_context_left"] - 1,
            ac["attention_context_right"],
        )
        self.context = self.chunk + self.past + self.future
        # sinusoidal relative positions, newest first: [context // 2 + 1, width] as [sin..., cos...]
        half = d // 2
        inv = torch.exp(torch.arange(half) * -(math.log(10000.0) / max(half - 1, 1)))
        t = torch.arange(self.context // 2, -1, -1)[:, None] * inv[None, :]
        self.register_buffer("rel_pos", torch.cat([t.sin(), t.cos()], -1), persistent=False)

    def load(self, reader: CheckpointReader) -> None:
        p = reader.resolve_prefix(*TOWER_PREFIXES)
        self.layer0.load(reader, f"{p}subsample_conv_projection.layer0")
        self.layer1.load(reader, f"{p}subsample_conv_projection.layer1")
        self.input_proj.data = reader.get(f"{p}subsample_conv_projection.input_proj_linear.weight")
        for i, layer in enumerate(self.layers):
            layer.load(reader, f"{p}layers.{i}")
        self.output_proj.weight.data = reader.get(f"{p}output_proj.weight")
        self.output_proj.bias.data = reader.get(f"{p}output_proj.bias")
        e = reader.resolve_prefix(*EMBEDDER_PREFIXES)
        self.projection.data = reader.get(f"{e}embedding_projection.weight")
        self.output_proj.requires_grad_(False)

    def _masked(self, valid: torch.Tensor) -> torch.Tensor:
        """``[nb, chunk, context]``: True where a query may NOT see a key (padding, beyond the window)."""
        t = valid.shape[0]
        nb = -(-t // self.chunk)
        q = torch.arange(nb * self.chunk, device=valid.device).view(nb, self.chunk, 1)
        kv = (torch.arange(nb, device=valid.device) * self.chunk - self.past)[:, None, None]
        kv = kv + torch.arange(self.context, device=valid.device)[None, None, :]
        dist = q - kv
        ok = ((dist >= 0) & (dist < self.past)) | ((dist < 0) & (-dist < self.future))
        inside = (kv >= 0) & (kv < t) & (q < t)
        key_valid = valid[kv.clamp(0, t - 1)]
        return ~(ok & inside & key_valid)

    def forward(self, features: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        """``features`` ``[T, mel]``, ``mask`` ``[T]`` bool -> ``[valid output frames, text hidden]``."""
        x, m = self.layer0(features[None], mask.to(features.dtype))
        x, m = self.layer1(x, m)
        x = F.linear(x.permute(1, 2, 0).reshape(x.shape[1], -1), self.input_proj)  # [T/4, width]
        valid = m.bool()
        masked = self._masked(valid)
        pos = self.rel_pos.to(x.dtype)
        for layer in self.layers:
            x = layer(x, pos, masked)
        h = self.output_proj(x)[valid]
        return F.linear(self.embed_norm(h), self.projection)
