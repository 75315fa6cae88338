"""Gemma 4's image encoder: patch embedder, vision transformer, position pooler, then the multimodal
embedder into the LLM's width (math as transformers 5.25's ``Gemma4VisionModel`` + ``embed_vision``).

Each item is its real patches ``[n, 3 p^2]`` and their (x, y) grid positions ``[n, 2]`` (the processor's
padding stripped); a batch is padded to its longest item and the padding masked out of attention::

    pixels ─2(x - 0.5)─▶ Linear ─▶ + table_x[x] + table_y[y]
      ─▶ layers (RMSNorm; q/k/v RMS-normed per head, 2-D RoPE: x on the first half of each head, y on the
         second; attention scale 1; gated GELU-tanh MLP; post-norms)
      ─▶ average of each k x k block of patches (k: pooling_kernel_size), x sqrt(width), in float32
      ─▶ (standardize) ─▶ RMSNorm (no weight) ─▶ Linear ─▶ [n / k^2, hidden]

TP ``weights``: each rank holds its heads of q/k/v and its MLP units (column-parallel); o_proj and
down_proj are row-parallel (one all-reduce each). Embedder, norms, pooler and projection are replicated.
"""

from __future__ import annotations

import math

import torch
from torch import nn

from encoder_service.encode.models.common import EncoderModel, activation
from encoder_service.encode.models.weights import CheckpointReader
from encoder_service.encode.tp.parallel import (
    ColumnParallelLinear,
    RowParallelLinear,
    TPContext,
    head_rows,
    unit_rows,
)
from encoder_service.types import EncoderInput

TOWER_PREFIXES = ("model.vision_tower.", "vision_tower.")
EMBEDDER_PREFIXES = ("model.embed_vision.", "embed_vision.")
VISION_DEFAULTS = {  # transformers' Gemma4VisionConfig defaults under what config.json sets
    "hidden_size": 768,
    "intermediate_size": 3072,
    "num_hidden_layers": 16,
    "num_attention_heads": 12,
    "num_key_value_heads": 12,
    "head_dim": 64,
    "hidden_activation": "gelu_pytorch_tanh",
    "rms_norm_eps": 1e-6,
    "pooling_kernel_size": 3,
    "patch_size": 16,
    "position_embedding_size": 10 * 1024,
    "use_clipped_linears": False,
    "standardize": False,
}


class Gemma4RMSNorm(nn.Module):
    """float32 ``x * (ms + eps) ** -0.5``, times ``weight`` when it has one (as HF's ``Gemma4RMSNorm``)."""

    def __init__(self, dim: int, eps: float, with_scale: bool = True) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim), requires_grad=False) if with_scale else None

    def load(self, reader: CheckpointReader, name: str) -> None:
        if self.weight is not None:
            self.weight.data = reader.get(f"{name}.weight")

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = x.float()
        h = h * torch.pow(h.pow(2).mean(-1, keepdim=True) + self.eps, -0.5)
        if self.weight is not None:
            h = h * self.weight.float()
        return h.type_as(x)


class Clipped(nn.Module):
    """HF's ``Gemma4ClippableLinear``: input and output clamped to the checkpoint's bounds (after the
    all-reduce of a row-parallel layer); a plain linear when the config does not clip."""

    def __init__(self, linear: ColumnParallelLinear | RowParallelLinear, clip: bool) -> None:
        super().__init__()
        self.linear, self.clip = linear, clip
        self.bounds = nn.Parameter(torch.tensor([-math.inf, math.inf] * 2), requires_grad=False)

    def load(self, reader: CheckpointReader, name: str, index: torch.Tensor) -> None:
        self.linear.load(reader.get(f"{name}.linear.weight"), None, index)
        if self.clip:
            parts = ("input_min", "input_max", "output_min", "output_max")
            self.bounds.data = torch.stack([reader.get(f"{name}.{p}").reshape(()) for p in parts])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not self.clip:
            return self.linear(x)
        b = self.bounds
        return self.linear(x.clamp(b[0], b[1])).clamp(b[2], b[3])


def rope_2d(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate the first half of each head by the x angles, the second by the y angles (HF's
    ``apply_multidimensional_rope`` with two dims); ``cos``/``sin``: ``[B, N, 1, head_dim]``."""
    out = []
    for part, c, s in zip(x.chunk(2, -1), cos.chunk(2, -1), sin.chunk(2, -1), strict=True):
        a, b = part.chunk(2, -1)
        out.append(part * c + torch.cat((-b, a), -1) * s)
    return torch.cat(out, -1)


class Gemma4VisionAttention(nn.Module):
    def __init__(self, vc: dict, tp: TPContext) -> None:
        super().__init__()
        dim, self.head_dim = vc["hidden_size"], vc["head_dim"]
        heads, kv_heads = vc["num_attention_heads"], vc["num_key_value_heads"]
        if heads != kv_heads:
            raise ValueError(f"vision num_key_value_heads={kv_heads} != num_attention_heads={heads}")
        clip, eps = bool(vc["use_clipped_linears"]), vc["rms_norm_eps"]
        self.rows = head_rows(heads, self.head_dim, tp, "vision num_attention_heads")
        self.local_heads = len(self.rows) // self.head_dim
        n = len(self.rows)
        self.q_proj = Clipped(ColumnParallelLinear(dim, n, bias=False), clip)
        self.k_proj = Clipped(ColumnParallelLinear(dim, n, bias=False), clip)
        self.v_proj = Clipped(ColumnParallelLinear(dim, n, bias=False), clip)
        self.o_proj = Clipped(RowParallelLinear(n, dim, tp, bias=False), clip)
        self.q_norm = Gemma4RMSNorm(self.head_dim, eps)
        self.k_norm = Gemma4RMSNorm(self.head_dim, eps)
        self.v_norm = Gemma4RMSNorm(self.head_dim, eps, with_scale=False)

    def load(self, reader: CheckpointReader, name: str) -> None:
        for proj in ("q_proj", "k_proj", "v_proj", "o_proj"):
            getattr(self, proj).load(reader, f"{name}.{proj}", self.rows)
        self.q_norm.load(reader, f"{name}.q_norm")
        self.k_norm.load(reader, f"{name}.k_norm")

    def forward(self, x, cos, sin, mask):  # type: ignore[no-untyped-def]
        b, n, _ = x.shape
        shape = (b, n, self.local_heads, self.head_dim)
        q = rope_2d(self.q_norm(self.q_proj(x).view(shape)), cos, sin).transpose(1, 2)
        k = rope_2d(self.k_norm(self.k_proj(x).view(shape)), cos, sin).transpose(1, 2)
        v = self.v_norm(self.v_proj(x).view(shape)).transpose(1, 2)
        o = nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=1.0)
        return self.o_proj(o.transpose(1, 2).reshape(b, n, -1))


class Gemma4VisionMLP(nn.Module):
    def __init__(self, vc: dict, tp: TPContext) -> None:
        super().__init__()
        dim, clip = vc["hidden_size"], bool(vc["use_clipped_linears"])
        self.rows = unit_rows(vc["intermediate_size"], tp, "vision intermediate_size")
        self.gate_proj = Clipped(ColumnParallelLinear(dim, len(self.rows), bias=False), clip)
        self.up_proj = Clipped(ColumnParallelLinear(dim, len(self.rows), bias=False), clip)
        self.down_proj = Clipped(RowParallelLinear(len(self.rows), dim, tp, bias=False), clip)
        self.act = activation(vc["hidden_activation"])

    def load(self, reader: CheckpointReader, name: str) -> None:
        for proj in ("gate_proj", "up_proj", "down_proj"):
            getattr(self, proj).load(reader, f"{name}.{proj}", self.rows)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.act(self.gate_proj(x)) * self.up_proj(x))


class Gemma4VisionLayer(nn.Module):
    NORMS = (
        "input_layernorm",
        "post_attention_layernorm",
        "pre_feedforward_layernorm",
        "post_feedforward_layernorm",
    )

    def __init__(self, vc: dict, tp: TPContext) -> None:
        super().__init__()
        for norm in self.NORMS:
            setattr(self, norm, Gemma4RMSNorm(vc["hidden_size"], vc["rms_norm_eps"]))
        self.self_attn = Gemma4VisionAttention(vc, tp)
        self.mlp = Gemma4VisionMLP(vc, tp)

    def load(self, reader: CheckpointReader, name: str) -> None:
        for norm in self.NORMS:
            getattr(self, norm).load(reader, f"{name}.{norm}")
        self.self_attn.load(reader, f"{name}.self_attn")
        self.mlp.load(reader, f"{name}.mlp")

    def forward(self, x, cos, sin, mask):  # type: ignore[no-untyped-def]
        x = x + self.post_attention_layernorm(self.self_attn(self.input_layernorm(x), cos, sin, mask))
        return x + self.post_feedforward_layernorm(self.mlp(self.pre_feedforward_layernorm(x)))


class Gemma4VisionEncoder(EncoderModel):
    """The vision side alone (``encoder_service/encode/models/gemma4.py`` adds the audio tower)."""

    family = "gemma4"
    modalities: tuple[str, ...] = ("image",)

    def __init__(self, config: dict, tp: TPContext) -> None:
        super().__init__()
        vc = {**VISION_DEFAULTS, **(config.get("vision_config") or {})}
        self.hidden_size = int((config.get("text_config") or {}).get("hidden_size", 2304))
        self.width, self.patch, self.k = vc["hidden_size"], vc["patch_size"], vc["pooling_kernel_size"]
        self.head_dim = vc["head_dim"]
        theta = float((vc.get("rope_parameters") or {}).get("rope_theta", 100.0))
        spatial = self.head_dim // 2
        inv = 1.0 / (theta ** (torch.arange(0, spatial, 2, dtype=torch.float) / spatial))
        self.register_buffer("inv_freq", inv, persistent=False)
        self.input_proj = nn.Parameter(torch.empty(self.width, 3 * self.patch**2), requires_grad=False)
        self.position_table = nn.Parameter(
            torch.empty(2, vc["position_embedding_size"], self.width), requires_grad=False
        )
        self.layers = nn.ModuleList(Gemma4VisionLayer(vc, tp) for _ in range(vc["num_hidden_layers"]))
        self.standardize = bool(vc["standardize"])
        self.std = nn.Parameter(torch.zeros(2, self.width), requires_grad=False)  # bias, scale
        self.pre_projection_norm = Gemma4RMSNorm(self.width, vc["rms_norm_eps"], with_scale=False)
        self.projection = nn.Parameter(torch.empty(self.hidden_size, self.width), requires_grad=False)

    def load_weights(self, reader: CheckpointReader) -> None:
        p = reader.resolve_prefix(*TOWER_PREFIXES)
        self.input_proj.data = reader.get(f"{p}patch_embedder.input_proj.weight")
        self.position_table.data = reader.get(f"{p}patch_embedder.position_embedding_table")
        for i, layer in enumerate(self.layers):
            layer.load(reader, f"{p}encoder.layers.{i}")
        if self.standardize:
            self.std.data = torch.stack([reader.get(f"{p}std_bias"), reader.get(f"{p}std_scale")])
        e = reader.resolve_prefix(*EMBEDDER_PREFIXES)
        self.projection.data = reader.get(f"{e}embedding_projection.weight")

    def _patches(self, item: EncoderInput) -> tuple[torch.Tensor, torch.Tensor]:
        if item.modality != "image":
            raise ValueError(f"Gemma 4's vision tower cannot encode {item.modality!r} item {item.mm_hash}")
        pv = torch.as_tensor(item.tensors["pixel_values"])
        pos = torch.as_tensor(item.tensors["image_position_ids"]).long()
        n, k2 = pv.shape[0], self.k**2
        if (
            pv.dim() != 2
            or pv.shape[1] != 3 * self.patch**2
            or tuple(pos.shape) != (n, 2)
            or n % k2
            or n == 0
        ):
            raise ValueError(
                f"item {item.mm_hash}: pixel tensor {tuple(pv.shape)} / positions {tuple(pos.shape)} are not "
                f"n x {3 * self.patch**2} patches with n x 2 positions, n a multiple of {k2}"
            )
        if bool((pos < 0).any()) or int(pos.max()) >= self.position_table.shape[1]:
            raise ValueError(f"item {item.mm_hash}: patch positions outside the position table")
        return pv, pos

    def num_embeds(self, item: EncoderInput) -> int:
        return self._patches(item)[0].shape[0] // self.k**2

    def encode(self, items: list[EncoderInput]) -> list[torch.Tensor]:
        if not items:
            return []
        dev, dtype = self.input_proj.device, self.input_proj.dtype
        parts = [self._patches(it) for it in items]
        lengths = [pv.shape[0] for pv, _ in parts]
        longest = max(lengths)
        pixels = torch.zeros(len(items), longest, self.input_proj.shape[1], device=dev, dtype=dtype)
        pos = torch.zeros(len(items), longest, 2, device=dev, dtype=torch.long)
        for i, (pv, ps) in enumerate(parts):
            pixels[i, : lengths[i]], pos[i, : lengths[i]] = pv.to(dev, dtype), ps.to(dev)
        valid = torch.arange(longest, device=dev)[None, :] < torch.tensor(lengths, device=dev)[:, None]
        x = nn.functional.linear(2 * (pixels - 0.5), self.input_proj)
        x = x + self.position_table[0][pos[..., 0]] + self.position_table[1][pos[..., 1]]
        freqs = pos[..., None].float() * self.inv_freq  # [B, N, 2, spatial / 2]
        fx, fy = freqs[:, :, 0], freqs[:, :, 1]
        angles = torch.cat([fx, fx, fy, fy], -1)[:, :, None, :]  # [B, N, 1, head_dim]
        cos, sin = angles.cos().to(dtype), angles.sin().to(dtype)
        mask = valid[:, None, None, :]
        for layer in self.layers:
            x = layer(x, cos, sin, mask)
        return [self._pool(x[i, :n], pos[i, :n]) for i, n in enumerate(lengths)]

    def _pool(self, h: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:
        """HF's ``Gemma4VisionPooler``: mean of each k x k block, row-major over the block grid, then
        x sqrt(width) in float32; then (standardize and) the multimodal embedder."""
        k = self.k
        blocks_x = (int(pos[:, 0].max()) + 1) // k
        index = pos[:, 0] // k + blocks_x * (pos[:, 1] // k)
        n = h.shape[0] // (k * k)
        weights = nn.functional.one_hot(index, n).float() / (k * k)
        pooled = (weights.transpose(0, 1) @ h.float()).to(h.dtype).float() * math.sqrt(self.width)
        if self.standardize:
            pooled = (pooled - self.std[0].float()) * self.std[1].float()
        pooled = pooled.to(h.dtype)
        return nn.functional.linear(self.pre_projection_norm(pooled), self.projection)
