"""Gemma 3's image encoder: a SigLIP vision tower, then the average-pooling multimodal projector.

Every image arrives resized to the tower's square ``image_size`` (one ``[3, S, S]`` tensor per item),
so a batch is a plain ``[B, N, D]`` stack and no image attends to another::

    pixels [B,3,S,S] ─conv (patch p, stride p)─▶ [B, (S/p)^2, D] + learned positions
      ─▶ SigLIP layers (LayerNorm, full attention inside the image, GELU-tanh MLP) ─▶ post LayerNorm
      ─▶ [B, D, S/p, S/p] ─avg pool k x k─▶ mm_tokens_per_image rows ─▶ RMSNorm(1 + w) ─▶ @ W ─▶ [B, T, hidden]

TP ``weights``: each rank holds its heads of q/k/v and its fc1 units (column-parallel), out_proj and fc2
are row-parallel (one all-reduce each). The patch embedding, norms and projector are replicated.
"""

from __future__ import annotations

import math

import torch
from torch import nn

from encoder_service.encode.models.common import EncoderModel, ParallelMLP, load_layer_norm
from encoder_service.encode.models.weights import CheckpointReader
from encoder_service.encode.tp.parallel import ColumnParallelLinear, RowParallelLinear, TPContext, head_rows
from encoder_service.types import EncoderInput

TOWER_PREFIXES = ("model.vision_tower.vision_model.", "vision_tower.vision_model.", "model.vision_tower.")
PROJECTOR_PREFIXES = ("model.multi_modal_projector.", "multi_modal_projector.")
SIGLIP_DEFAULTS = {
    "hidden_size": 768,
    "intermediate_size": 3072,
    "num_hidden_layers": 12,
    "num_attention_heads": 12,
    "image_size": 224,
    "patch_size": 16,
}


class SiglipAttention(nn.Module):
    def __init__(self, dim: int, num_heads: int, tp: TPContext) -> None:
        super().__init__()
        self.head_dim = dim // num_heads
        self.rows = head_rows(num_heads, self.head_dim, tp, "vision num_attention_heads")
        self.local_heads = len(self.rows) // self.head_dim
        self.q_proj = ColumnParallelLinear(dim, len(self.rows))
        self.k_proj = ColumnParallelLinear(dim, len(self.rows))
        self.v_proj = ColumnParallelLinear(dim, len(self.rows))
        self.out_proj = RowParallelLinear(len(self.rows), dim, tp)

    def load(self, reader: CheckpointReader, name: str) -> None:
        for proj in ("q_proj", "k_proj", "v_proj"):
            w, b = reader.get(f"{name}.{proj}.weight"), reader.get(f"{name}.{proj}.bias")
            getattr(self, proj).load(w, b, self.rows)
        self.out_proj.load(
            reader.get(f"{name}.out_proj.weight"), reader.get(f"{name}.out_proj.bias"), self.rows
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, n, _ = x.shape

        def heads(t: torch.Tensor) -> torch.Tensor:
            return t.view(b, n, self.local_heads, self.head_dim).transpose(1, 2)

        o = nn.functional.scaled_dot_product_attention(
            heads(self.q_proj(x)), heads(self.k_proj(x)), heads(self.v_proj(x))
        )
        return self.out_proj(o.transpose(1, 2).reshape(b, n, -1))


class SiglipLayer(nn.Module):
    def __init__(
        self, dim: int, num_heads: int, mlp_hidden: int, act: str, eps: float, tp: TPContext
    ) -> None:
        super().__init__()
        self.layer_norm1 = nn.LayerNorm(dim, eps=eps)
        self.self_attn = SiglipAttention(dim, num_heads, tp)
        self.layer_norm2 = nn.LayerNorm(dim, eps=eps)
        self.mlp = ParallelMLP(dim, mlp_hidden, act, tp)

    def load(self, reader: CheckpointReader, name: str) -> None:
        load_layer_norm(self.layer_norm1, reader, f"{name}.layer_norm1")
        load_layer_norm(self.layer_norm2, reader, f"{name}.layer_norm2")
        self.self_attn.load(reader, f"{name}.self_attn")
        self.mlp.load(reader, f"{name}.mlp.fc1", f"{name}.mlp.fc2")

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.self_attn(self.layer_norm1(x))
        return x + self.mlp(self.layer_norm2(x))


class AvgPoolProjector(nn.Module):
    """``Gemma3MultiModalProjector``: k x k average pooling of the patch grid, RMSNorm, projection."""

    def __init__(
        self, vision_dim: int, text_dim: int, patches_per_side: int, tokens: int, eps: float
    ) -> None:
        super().__init__()
        side = math.isqrt(tokens)
        if side * side != tokens or patches_per_side % side:
            raise ValueError(
                f"mm_tokens_per_image={tokens} does not pool a {patches_per_side}^2 patch grid evenly"
            )
        self.side, self.kernel, self.eps = patches_per_side, patches_per_side // side, eps
        self.norm_weight = nn.Parameter(torch.zeros(vision_dim), requires_grad=False)
        self.projection = nn.Parameter(torch.zeros(vision_dim, text_dim), requires_grad=False)

    def load(self, reader: CheckpointReader, prefix: str) -> None:
        self.norm_weight.data = reader.get(f"{prefix}mm_soft_emb_norm.weight")
        self.projection.data = reader.get(f"{prefix}mm_input_projection_weight")

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, _, d = x.shape
        grid = x.transpose(1, 2).reshape(b, d, self.side, self.side).contiguous()
        pooled = nn.functional.avg_pool2d(grid, self.kernel, self.kernel).flatten(2).transpose(1, 2)
        h = pooled.float()
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        normed = (h * (1.0 + self.norm_weight.float())).type_as(pooled)
        return torch.matmul(normed, self.projection).type_as(x)


class Gemma3VisionEncoder(EncoderModel):
    family = "gemma3"
    modalities = ("image",)

    def __init__(self, config: dict, tp: TPContext) -> None:
        super().__init__()
        # transformers' SiglipVisionConfig / Gemma3TextConfig defaults under what config.json sets
        vc = {**SIGLIP_DEFAULTS, **config.get("vision_config", {})}
        text = {"hidden_size": 2304, **(config.get("text_config") or {})}
        self.embed_dim = vc["hidden_size"]
        self.hidden_size = text["hidden_size"]
        self.image_size, self.patch = vc["image_size"], vc["patch_size"]
        self.channels = vc.get("num_channels", 3)
        num_heads = vc["num_attention_heads"]
        if self.embed_dim % num_heads:
            raise ValueError(
                f"vision hidden_size={self.embed_dim} not divisible by num_attention_heads={num_heads}"
            )
        side = self.image_size // self.patch
        eps = vc.get("layer_norm_eps", 1e-6)
        self.patch_embedding = nn.Conv2d(self.channels, self.embed_dim, self.patch, self.patch)
        self.position_embedding = nn.Parameter(torch.zeros(side * side, self.embed_dim), requires_grad=False)
        act = vc.get("hidden_act", "gelu_pytorch_tanh")
        self.layers = nn.ModuleList(
            SiglipLayer(self.embed_dim, num_heads, vc["intermediate_size"], act, eps, tp)
            for _ in range(vc["num_hidden_layers"])
        )
        self.post_layernorm = nn.LayerNorm(self.embed_dim, eps=eps)
        self.num_tokens = int(config.get("mm_tokens_per_image", 256))
        self.projector = AvgPoolProjector(self.embed_dim, self.hidden_size, side, self.num_tokens, eps)

    def load_weights(self, reader: CheckpointReader) -> None:
        p = reader.resolve_prefix(*TOWER_PREFIXES)  # longest first: "model.vision_tower." matches all three
        self.patch_embedding.weight.data = reader.get(f"{p}embeddings.patch_embedding.weight")
        self.patch_embedding.bias.data = reader.get(f"{p}embeddings.patch_embedding.bias")  # type: ignore[union-attr]
        self.position_embedding.data = reader.get(f"{p}embeddings.position_embedding.weight")
        for i, layer in enumerate(self.layers):
            layer.load(reader, f"{p}encoder.layers.{i}")
        load_layer_norm(self.post_layernorm, reader, f"{p}post_layernorm")
        self.projector.load(reader, reader.resolve_prefix(*PROJECTOR_PREFIXES))
        for param in self.parameters():
            param.requires_grad_(False)

    def _pixels(self, item: EncoderInput) -> torch.Tensor:
        if item.modality != "image":
            raise ValueError(f"Gemma 3's vision tower cannot encode {item.modality!r} item {item.mm_hash}")
        pv = torch.as_tensor(item.tensors["pixel_values"])
        want = (self.channels, self.image_size, self.image_size)
        if tuple(pv.shape[-3:]) != want or pv.numel() != math.prod(want):
            raise ValueError(f"item {item.mm_hash}: pixel tensor {tuple(pv.shape)} is not one {want} image")
        return pv.reshape(want)

    def num_embeds(self, item: EncoderInput) -> int:
        self._pixels(item)
        return self.num_tokens

    def encode(self, items: list[EncoderInput]) -> list[torch.Tensor]:
        if not items:
            return []
        weight = self.patch_embedding.weight
        pixels = torch.stack([self._pixels(it) for it in items]).to(device=weight.device, dtype=weight.dtype)
        x = self.patch_embedding(pixels).flatten(2).transpose(1, 2) + self.position_embedding
        for layer in self.layers:
            x = layer(x)
        return list(self.projector(self.post_layernorm(x)).unbind(0))
